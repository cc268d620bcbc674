"""Tokenized documents in two flat numpy arrays.

`TokenDocs` holds N documents as one int32 token array and N+1 int64
offsets: document i is `tokens[offsets[i]:offsets[i + 1]]`. Flat arrays
save and load as one `.npz` with numpy alone (DESIGN invariant 2: training
never needs TensorFlow), slice without copies and hash cheaply.
"""

import concurrent.futures
import dataclasses
import hashlib
import io
import multiprocessing
import os
import sys
from typing import Sequence
import zipfile

from etils import epath
import numpy as np

from dipaco_jax.data import tokenizer as tokenizer_lib
from dipaco_jax.store import atomic


@dataclasses.dataclass
class TokenDocs:
  """N tokenized documents: `tokens` (int32, flat) and `offsets` (N+1)."""
  tokens: np.ndarray
  offsets: np.ndarray

  def __post_init__(self):
    self.tokens = np.ascontiguousarray(self.tokens, dtype=np.int32)
    self.offsets = np.ascontiguousarray(self.offsets, dtype=np.int64)
    if self.tokens.ndim != 1 or self.offsets.ndim != 1:
      raise ValueError('TokenDocs needs 1-D tokens and offsets, got shapes '
                       f'{self.tokens.shape} and {self.offsets.shape}.')
    if (self.offsets.size == 0 or self.offsets[0] != 0
        or self.offsets[-1] != self.tokens.size
        or np.any(np.diff(self.offsets) < 0)):
      raise ValueError(
          'TokenDocs offsets must start at 0, never decrease and end at '
          f'len(tokens)={self.tokens.size}; got {self.offsets[:3]}...'
          f'{self.offsets[-3:]}.')

  def __len__(self) -> int:
    return self.offsets.size - 1

  def doc(self, i: int) -> np.ndarray:
    return self.tokens[self.offsets[i]:self.offsets[i + 1]]

  def lengths(self) -> np.ndarray:
    return np.diff(self.offsets)

  @property
  def num_tokens(self) -> int:
    return int(self.tokens.size)

  def subset(self, indices: Sequence[int] | np.ndarray) -> 'TokenDocs':
    """The documents at `indices`, in that order (repeats allowed)."""
    indices = subset_indices(indices, len(self))
    lengths_n = self.lengths()[indices]
    offsets = np.zeros(indices.size + 1, dtype=np.int64)
    np.cumsum(lengths_n, out=offsets[1:])
    # Source position of every output token: its doc's start plus its
    # position within the doc, vectorized over all tokens at once.
    starts = np.repeat(self.offsets[:-1][indices] - offsets[:-1], lengths_n)
    positions = np.arange(offsets[-1], dtype=np.int64) + starts
    return TokenDocs(self.tokens[positions], offsets)

  def sha256(self) -> str:
    """Hex sha256 of the tokens and offsets (little-endian, fixed dtypes)."""
    h = hashlib.sha256()
    h.update(b'tokens:int32<')
    h.update(self.tokens.astype('<i4', copy=False).tobytes())
    h.update(b'offsets:int64<')
    h.update(self.offsets.astype('<i8', copy=False).tobytes())
    return h.hexdigest()

  def prefixes(self, prefix_len: int,
               pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The first `prefix_len` tokens of every doc, right-padded.

    Args:
      prefix_len: T, the prefix length (routing reads these tokens).
      pad_id: fills positions past a short doc's end.

    Returns:
      (prefix_NxT int32, lengths_N int64): the prefixes and how many of
      each row's tokens are real (min(doc length, T)).
    """
    lengths_n = np.minimum(self.lengths(), prefix_len)
    cols_t = np.arange(prefix_len, dtype=np.int64)
    valid_nxt = cols_t[None, :] < lengths_n[:, None]
    positions_nxt = self.offsets[:-1, None] + cols_t[None, :]
    positions_nxt = np.where(valid_nxt, positions_nxt, 0)
    if self.tokens.size == 0:
      prefix_nxt = np.full(positions_nxt.shape, pad_id, dtype=np.int32)
    else:
      prefix_nxt = np.where(valid_nxt, self.tokens[positions_nxt],
                            pad_id).astype(np.int32)
    return prefix_nxt, lengths_n

  def save(self, path: str | os.PathLike[str]) -> None:
    """Writes an `.npz` atomically (temp file, then rename)."""
    path = epath.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_npz(path, tokens=self.tokens, offsets=self.offsets)

  @classmethod
  def load(cls, path: str | os.PathLike[str]) -> 'TokenDocs':
    arrays = load_npz(path, ('tokens', 'offsets'))
    return cls(arrays['tokens'], arrays['offsets'])


def subset_indices(indices, num_docs: int) -> np.ndarray:
  """`indices` of a subset of `num_docs` documents, checked, negatives
  counted from the end, as int64 [K]."""
  indices = np.asarray(indices, dtype=np.int64).reshape(-1)
  if indices.size and (indices.min() < -num_docs
                       or indices.max() >= num_docs):
    raise IndexError(f'subset indices out of range for {num_docs} docs.')
  return np.where(indices < 0, indices + num_docs, indices)


def save_npz(path: epath.Path, **arrays: np.ndarray) -> None:
  """`np.savez` written atomically (`store.atomic.write_npz`).

  A reader never sees a half-written file under the final name.

  Args:
    path: the destination.
    **arrays: the arrays to store.
  """
  atomic.write_npz(path, **arrays)


def load_npz(path: str | os.PathLike[str],
             keys: Sequence[str]) -> dict[str, np.ndarray]:
  """Reads `keys` from an `.npz`; errors name the file."""
  path = epath.Path(path)
  try:
    # Read the bytes first: np.load needs a seekable file, gs:// may not be.
    data = path.read_bytes()
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
      missing = [k for k in keys if k not in npz.files]
      if missing:
        raise ValueError(f'{path} lacks arrays {missing} (has {npz.files}).')
      return {k: npz[k] for k in keys}
  except (OSError, EOFError, ValueError, zipfile.BadZipFile) as e:
    if isinstance(e, ValueError) and str(path) in str(e):
      raise
    raise ValueError(
        f'Cannot read {path} ({type(e).__name__}: {e}). Delete it and rerun '
        'the stage that writes it.') from e


# Below this many characters worker processes cost more than they save.
_PARALLEL_MIN_CHARS = 4_000_000
_CHUNK_CHARS = 1_000_000
_worker_tokenizer = None


def _init_worker(model_proto: bytes) -> None:
  global _worker_tokenizer
  _worker_tokenizer = tokenizer_lib.Tokenizer(model_proto)


def _encode_chunk(texts: list[str]) -> list[np.ndarray]:
  return _worker_tokenizer.encode_batch(texts, num_threads=1)


class Encoder:
  """Encodes batches of texts, in worker processes when it pays; the same
  ids either way. A pool, once started, serves every later batch.

  SentencePiece's batch threads gave no speed-up here (measured: 2.1 s with
  1 thread, 2.3 s with 2), so large corpora use processes. 'spawn', not
  'fork': the caller may have JAX's threads running.
  """

  def __init__(self, tokenizer, num_workers: int | None = None):
    """`num_workers`: processes; None: by the size of each batch and the
    CPUs (a batch under `_PARALLEL_MIN_CHARS` stays in this process)."""
    self._tokenizer = tokenizer
    self._num_workers = num_workers
    self._pool = None
    # 'spawn' re-runs the parent's main file in each worker; a main read
    # from stdin has none and its workers die at start, so stay serial.
    main_file = getattr(sys.modules.get('__main__'), '__file__', None)
    self._can_spawn = main_file is None or os.path.exists(main_file)

  def __enter__(self) -> 'Encoder':
    return self

  def __exit__(self, *exc) -> None:
    if self._pool is not None:
      self._pool.shutdown()
      self._pool = None

  def _workers_for(self, total_chars: int) -> int:
    if not self._can_spawn:
      return 1
    if self._num_workers is not None:
      return self._num_workers
    if total_chars < _PARALLEL_MIN_CHARS and self._pool is None:
      return 1
    return min(os.cpu_count() or 1, 16)

  def encode(self, texts: list[str]) -> list[np.ndarray]:
    """The ids of each text, in order."""
    total_chars = sum(len(t) for t in texts)
    num_workers = self._workers_for(total_chars)
    if num_workers <= 1 or len(texts) < 2:
      return self._tokenizer.encode_batch(texts, num_threads=1)
    chunks, current, size = [], [], 0
    for text in texts:
      current.append(text)
      size += len(text)
      if size >= min(_CHUNK_CHARS, total_chars // (2 * num_workers) + 1):
        chunks.append(current)
        current, size = [], 0
    if current:
      chunks.append(current)
    if self._pool is None:
      self._pool = concurrent.futures.ProcessPoolExecutor(
          num_workers, mp_context=multiprocessing.get_context('spawn'),
          initializer=_init_worker,
          initargs=(self._tokenizer.model_proto,))
    # map keeps the input order, so the result does not depend on timing.
    return [ids for part in self._pool.map(_encode_chunk, chunks)
            for ids in part]


def _encode_all(tokenizer, texts: list[str],
                num_workers: int | None) -> list[np.ndarray]:
  """The ids of each text, in order (`Encoder`, for one batch)."""
  with Encoder(tokenizer, num_workers) as encoder:
    return encoder.encode(texts)


def check_vocab(tokens: np.ndarray, vocab_size: int, tokenizer,
                what: str) -> None:
  """Raises ValueError naming `what` (a document) when an id is too big."""
  if not tokens.size or tokens.max() < vocab_size:
    return
  bad = int(tokens[np.argmax(tokens >= vocab_size)])
  raise ValueError(
      f'{what} has token id {bad} >= vocab size {vocab_size} (the '
      f'tokenizer has {tokenizer.vocab_size} pieces): the tokenizer does not '
      'match the model. Set config.data.vocab_size to the tokenizer size, '
      'or use a tokenizer (config.data.tokenizer_model) with at most that '
      'many pieces.')


def encode_documents(tokenizer, texts: Sequence[str],
                     vocab_size_check: int | None = None,
                     num_workers: int | None = None) -> TokenDocs:
  """Tokenizes documents: each becomes `[BOS] + encode(text)`.

  Documents are encoded independently and placed in order, so the output
  does not depend on `num_workers`.

  Args:
    tokenizer: a `Tokenizer`.
    texts: the documents.
    vocab_size_check: if set, every id must be below it (the model's
      embedding size).
    num_workers: worker processes; None: several for large corpora only.

  Returns:
    The documents as `TokenDocs`.

  Raises:
    ValueError: an id is >= `vocab_size_check`.
  """
  encoded = _encode_all(tokenizer, list(texts), num_workers)
  lengths_n = np.array([ids.size + 1 for ids in encoded], dtype=np.int64)
  offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
  np.cumsum(lengths_n, out=offsets[1:])
  tokens = np.empty(int(offsets[-1]), dtype=np.int32)
  tokens[offsets[:-1]] = tokenizer.bos_id
  for i, ids in enumerate(encoded):
    tokens[offsets[i] + 1:offsets[i + 1]] = ids
  if vocab_size_check is not None and tokens.size:
    bad = np.flatnonzero(tokens >= vocab_size_check)
    if bad.size:
      doc = int(np.searchsorted(offsets, bad[0], side='right') - 1)
      check_vocab(tokens[bad[:1]], vocab_size_check, tokenizer,
                  f'Document {doc}')
  return TokenDocs(tokens, offsets)
