"""Documents of a token store, and the training rows cut from them, read
from disk as they are asked for (`data/doc_store.py` holds the format).

A `DocView` of some documents holds 16 bytes a document of the view (their
store indices and cumulative lengths); the view of the whole store holds
nothing per document (the store's memory-mapped offsets serve).
"""

import hashlib
from typing import Sequence

import numpy as np

from dipaco_jax.data import doc_store
from dipaco_jax.data import token_store

# Documents per block when a view is read whole (prefixes, materialize).
_BLOCK_DOCS = 4096


class DocView:
  """Documents of a store, in the order of `indices`: nothing is copied.

  Answers what `TokenDocs` answers (`len`, `lengths`, `num_tokens`, `doc`,
  `subset`, `prefixes`), reading from disk; `read_stream` gives a range of
  the view's documents concatenated, which training rows are cut from.
  """

  def __init__(self, store: doc_store.DocStore,
               indices: np.ndarray | None = None):
    """`indices`: the store's documents, in order; None: all of them, as
    stored (then nothing is held per document: the store's memory-mapped
    offsets serve)."""
    self.store = store
    if indices is None:
      self._indices = None
      self.offsets = store.offsets
      return
    indices = np.asarray(indices, dtype=np.int64).reshape(-1)
    if indices.size and (indices.min() < 0 or indices.max() >= len(store)):
      raise IndexError(f'document indices out of range for {len(store)} '
                       'documents.')
    self._indices = indices
    lengths_n = np.asarray(store.offsets[indices + 1] - store.offsets[indices])
    self.offsets = np.zeros(indices.size + 1, np.int64)
    np.cumsum(lengths_n, out=self.offsets[1:])

  def __len__(self) -> int:
    return len(self.offsets) - 1

  @property
  def indices(self) -> np.ndarray:
    """The store's index of each document of the view."""
    if self._indices is None:
      return np.arange(len(self), dtype=np.int64)
    return self._indices

  def store_indices(self, docs) -> np.ndarray:
    """The store's indices of the view's documents `docs`."""
    docs = np.asarray(docs, dtype=np.int64)
    return docs if self._indices is None else self._indices[docs]

  def lengths(self) -> np.ndarray:
    return np.diff(self.offsets)

  @property
  def num_tokens(self) -> int:
    return int(self.offsets[-1])

  def _store_starts(self, docs: np.ndarray) -> np.ndarray:
    return np.asarray(self.store.offsets[self.store_indices(docs)], np.int64)

  def doc(self, i: int) -> np.ndarray:
    start = int(self._store_starts(np.array([i]))[0])
    return self.store.read_ranges([start], [start + self.lengths()[i]])[0]

  def subset(self, indices: Sequence[int] | np.ndarray) -> 'DocView':
    """The documents at `indices` of this view (repeats allowed)."""
    indices = token_store.subset_indices(indices, len(self))
    return DocView(self.store, self.store_indices(indices))

  def sha256(self) -> str:
    """The store's digest and the view's document indices."""
    h = hashlib.sha256(self.store.sha256.encode('ascii'))
    if self._indices is None:
      h.update(b'all')
    else:
      h.update(b'indices:int64<')
      h.update(self._indices.astype('<i8', copy=False).tobytes())
    return h.hexdigest()

  def prefixes(self, prefix_len: int,
               pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """As `TokenDocs.prefixes`, read a block of documents at a time."""
    lengths_n = np.minimum(self.lengths(), prefix_len)
    prefix_nxt = np.full((len(self), prefix_len), pad_id, np.int32)
    for first in range(0, len(self), _BLOCK_DOCS):
      docs = np.arange(first, min(first + _BLOCK_DOCS, len(self)))
      starts = self._store_starts(docs)
      pieces = self.store.read_ranges(starts, starts + lengths_n[docs])
      for row, piece in zip(docs.tolist(), pieces):
        prefix_nxt[row, :piece.size] = piece
    return prefix_nxt, lengths_n

  def read_stream(self, starts: np.ndarray, stops: np.ndarray
                  ) -> list[np.ndarray]:
    """Ranges of the view's documents concatenated, [starts[i], stops[i])."""
    starts = np.asarray(starts, np.int64).reshape(-1)
    stops = np.asarray(stops, np.int64).reshape(-1)
    if starts.size and (starts.min() < 0 or stops.max() > self.num_tokens):
      raise IndexError(f'stream ranges out of [0, {self.num_tokens}].')
    # Every range in pieces, one per document it crosses.
    first_r = np.searchsorted(self.offsets, starts, side='right') - 1
    last_r = np.searchsorted(self.offsets, np.maximum(stops - 1, starts),
                             side='right') - 1
    owner, piece_starts, piece_stops = [], [], []
    for r, (a, b, d0, d1) in enumerate(zip(starts.tolist(), stops.tolist(),
                                           first_r.tolist(),
                                           last_r.tolist())):
      for d in range(d0, d1 + 1 if b > a else d0):
        lo = max(a, int(self.offsets[d]))
        hi = min(b, int(self.offsets[d + 1]))
        if hi > lo:
          base = int(self._store_starts(np.array([d]))[0]) - int(
              self.offsets[d])
          owner.append(r)
          piece_starts.append(base + lo)
          piece_stops.append(base + hi)
    pieces = self.store.read_ranges(np.array(piece_starts, np.int64),
                                    np.array(piece_stops, np.int64))
    parts = [[] for _ in range(starts.size)]
    for r, piece in zip(owner, pieces):
      parts[r].append(piece)
    return [np.concatenate(p) if p else np.zeros(0, np.int32) for p in parts]

  def materialize(self) -> token_store.TokenDocs:
    """The view read into memory (for the small sets that need it whole:
    validation, router and early-stopping documents)."""
    tokens = np.empty(self.num_tokens, np.int32)
    for first in range(0, len(self), _BLOCK_DOCS):
      docs = np.arange(first, min(first + _BLOCK_DOCS, len(self)))
      starts = self._store_starts(docs)
      pieces = self.store.read_ranges(starts, starts + self.lengths()[docs])
      for d, piece in zip(docs.tolist(), pieces):
        tokens[self.offsets[d]:self.offsets[d + 1]] = piece
    return token_store.TokenDocs(tokens, np.array(self.offsets, np.int64))


def as_token_docs(docs) -> token_store.TokenDocs:
  """`docs` in memory: a `TokenDocs` as it is, a `DocView` read whole."""
  return docs.materialize() if isinstance(docs, DocView) else docs


class StreamRows:
  """The packed rows of a view, read on demand: `pack_rows` without the copy.

  Row r is the view's stream [r * L, r * L + L + 1), exactly the row
  `batches.pack_rows` cuts from the same documents in memory, so batches
  and the runs built on them do not change. Indexing with an int array
  gives [B, L + 1] int32.
  """

  def __init__(self, docs: DocView, seq_len: int):
    self.docs = docs
    self.seq_len = seq_len
    total = docs.num_tokens
    self.num_rows = (total - 1) // seq_len if total else 0
    self.shape = (self.num_rows, seq_len + 1)
    self.ndim = 2
    self.dtype = np.dtype(np.int32)

  def __len__(self) -> int:
    return self.num_rows

  def __getitem__(self, rows_b) -> np.ndarray:
    rows_b = np.asarray(rows_b, np.int64)
    flat = rows_b.reshape(-1)
    if flat.size and (flat.min() < 0 or flat.max() >= self.num_rows):
      raise IndexError(f'rows out of range for {self.num_rows} rows.')
    starts = flat * self.seq_len
    pieces = self.docs.read_stream(starts, starts + self.seq_len + 1)
    out = np.stack(pieces) if pieces else np.zeros(
        (0, self.seq_len + 1), np.int32)
    return out.reshape(rows_b.shape + (self.seq_len + 1,))
