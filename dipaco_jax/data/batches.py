"""Packed training rows, batches as a pure function of the step, eval windows.

DESIGN invariant 3: the batch of stream (path) w at step s depends only on
(seed, the rows, w, s). There is no iterator state to checkpoint; a resumed
run asks for step s and gets exactly the batch the uninterrupted run got.

Example i = s * B + b is taken from epoch i // N, whose order is a
permutation seeded by (seed, w, epoch), so every row is seen exactly once
per epoch and batches may straddle an epoch boundary.
"""

import functools
from typing import Sequence

import numpy as np

from dipaco_jax.data import doc_view
from dipaco_jax.data import token_store


def pack_rows(token_docs: token_store.TokenDocs | doc_view.DocView,
              seq_len: int) -> np.ndarray | doc_view.StreamRows:
  """Cuts the concatenated documents into rows of `seq_len + 1` tokens.

  Row r is `stream[r * L : r * L + L + 1]`: consecutive rows share one token
  so that inputs `row[:-1]` and targets `row[1:]` cover every position once.
  Documents already start with BOS, so the model sees the boundaries.

  Args:
    token_docs: the documents, in order: in memory, or a view of a token
      store on disk, whose rows are then read when a batch asks for them
      (`doc_view.StreamRows`, the same rows; nothing is copied).
    seq_len: L.

  Returns:
    rows_NxLp1, int32 (or its on-disk equivalent); the remainder after the
    last full row is dropped.

  Raises:
    ValueError: fewer than `seq_len + 1` tokens.
  """
  if seq_len <= 0:
    raise ValueError(f'seq_len must be > 0, got {seq_len}.')
  total = token_docs.num_tokens
  num_rows = (total - 1) // seq_len if total else 0
  if num_rows <= 0:
    raise ValueError(
        f'Only {total} tokens, fewer than seq_len + 1 = {seq_len + 1}: '
        'not one training row. Lower config.data.seq_len, use more data, or '
        'use fewer paths.')
  if isinstance(token_docs, doc_view.DocView):
    return doc_view.StreamRows(token_docs, seq_len)
  stream = token_docs.tokens
  windows = np.lib.stride_tricks.sliding_window_view(stream, seq_len + 1)
  return np.ascontiguousarray(windows[::seq_len][:num_rows], dtype=np.int32)


@functools.lru_cache(maxsize=1024)  # >= streams x 2 epochs in flight
def _permutation(seed: int, stream_index: int, epoch: int,
                 num_rows: int) -> np.ndarray:
  """The epoch's row order; cached since a step needs only one or two."""
  perm = np.random.default_rng([seed, stream_index, epoch]).permutation(
      num_rows)
  perm.flags.writeable = False  # Shared by the cache.
  return perm


def example_indices(num_rows: int, seed: int, stream_index: int, step: int,
                    batch_size: int) -> np.ndarray:
  """The row indices of `batch_for_step` (int64 [B])."""
  for name, value in (('seed', seed), ('stream_index', stream_index),
                      ('step', step)):
    if value < 0:
      raise ValueError(f'{name} must be >= 0, got {value}.')
  if batch_size <= 0 or num_rows <= 0:
    raise ValueError(f'Need batch_size > 0 and rows > 0, got {batch_size} '
                     f'and {num_rows}.')
  i_b = int(step) * batch_size + np.arange(batch_size, dtype=np.int64)
  epoch_b = i_b // num_rows
  out_b = np.empty(batch_size, dtype=np.int64)
  for epoch in np.unique(epoch_b):
    mask = epoch_b == epoch
    perm = _permutation(int(seed), int(stream_index), int(epoch), num_rows)
    out_b[mask] = perm[i_b[mask] % num_rows]
  return out_b


def batch_for_step(rows_NxLp1: np.ndarray | doc_view.StreamRows, seed: int,
                   stream_index: int, step: int,
                   batch_size: int) -> np.ndarray:
  """The batch [B, L+1] of one stream at one step: a pure function.

  Args:
    rows_NxLp1: the stream's packed rows.
    seed: the run's data seed.
    stream_index: which stream (path); streams get different orders.
    step: the step (counts from 0, never resets across rounds).
    batch_size: B.

  Returns:
    rows_NxLp1[perm_e[i % N]] for i = step * B + b, e = i // N.
  """
  idx_b = example_indices(rows_NxLp1.shape[0], seed, stream_index, step,
                          batch_size)
  return rows_NxLp1[idx_b]


class StackedBatches:
  """Batches of W streams at once: [W, B, L+1], stream w = path w."""

  def __init__(self, rows_per_stream: Sequence[np.ndarray], seed: int,
               batch_size: int, stream_ids: Sequence[int] | None = None):
    """`stream_ids[i]` is the worker whose batches stream i draws (default
    i): an island worker holding workers 4 and 5 draws exactly their rows
    of the SPMD run."""
    if not rows_per_stream:
      raise ValueError('StackedBatches needs at least one stream.')
    widths = {rows.shape[1] for rows in rows_per_stream}
    if len(widths) != 1 or any(r.ndim != 2 for r in rows_per_stream):
      raise ValueError(
          'All streams must have rows of the same length (seq_len + 1); got '
          f'shapes {[r.shape for r in rows_per_stream]}.')
    self._rows = list(rows_per_stream)
    self._ids = (list(range(len(self._rows))) if stream_ids is None
                 else [int(i) for i in stream_ids])
    if len(self._ids) != len(self._rows):
      raise ValueError(f'{len(self._ids)} stream ids for {len(self._rows)} '
                       'streams.')
    self._seed = seed
    self._batch_size = batch_size

  @property
  def num_streams(self) -> int:
    return len(self._rows)

  @property
  def rows_per_stream(self) -> list[int]:
    """The number of rows N of each stream."""
    return [r.shape[0] for r in self._rows]

  def batch(self, step: int, streams: Sequence[int] | None = None
            ) -> np.ndarray:
    """int32 [len(streams), B, L+1] (all W streams by default); stream w is
    `batch_for_step(rows[w], ..., w, ...)` whichever others are made."""
    streams = range(len(self._rows)) if streams is None else streams
    width = self._rows[0].shape[1]
    out = np.empty((len(streams), self._batch_size, width), dtype=np.int32)
    for i, w in enumerate(streams):
      out[i] = batch_for_step(self._rows[w], self._seed, self._ids[w], step,
                              self._batch_size)
    return out


def eval_windows(token_docs: token_store.TokenDocs, seq_len: int,
                 prefix_len: int = 32,
                 pad_id: int = 0) -> dict[str, np.ndarray]:
  """Cuts every document into scoring windows, without its first tokens.

  Window k of document d has inputs d[kL : kL+L] and targets
  d[kL+1 : kL+L+1], padded past the end. A target at absolute position j
  is scored (weight 1) only if j >= prefix_len: the first `prefix_len`
  tokens of a document (BOS included) are what the router reads, so the
  DiPaCo evaluation never scores them. Windows with nothing to score are
  dropped.

  Args:
    token_docs: the documents (each starting with BOS).
    seq_len: L.
    prefix_len: positions below this are never scored.
    pad_id: fills positions past a document's end.

  Returns:
    {'inputs': [M, L] int32, 'targets': [M, L] int32, 'weights': [M, L]
    float32, 'doc_index': [M] int64}.
  """
  # The windows are held whole (12 bytes a token of the documents scored).
  token_docs = doc_view.as_token_docs(token_docs)
  lengths_n = token_docs.lengths()
  # Windows per doc: enough to cover targets 1..n-1.
  windows_n = np.where(lengths_n > 1, -(-(lengths_n - 1) // seq_len), 0)
  doc_m = np.repeat(np.arange(len(token_docs), dtype=np.int64), windows_n)
  first_m = np.repeat(np.cumsum(windows_n) - windows_n, windows_n)
  k_m = np.arange(doc_m.size, dtype=np.int64) - first_m
  start_m = k_m * seq_len
  n_m = lengths_n[doc_m]
  # Keep windows with a scored target: last target min(kL+L, n-1) must
  # reach prefix_len (its first target kL+1 <= n-1 holds by construction).
  keep_m = np.minimum(start_m + seq_len, n_m - 1) >= max(prefix_len, 1)
  doc_m, start_m, n_m = doc_m[keep_m], start_m[keep_m], n_m[keep_m]

  cols_l = np.arange(seq_len, dtype=np.int64)
  pos_in_mxl = start_m[:, None] + cols_l[None, :]
  pos_tgt_mxl = pos_in_mxl + 1
  valid_in_mxl = pos_in_mxl < n_m[:, None]
  valid_tgt_mxl = pos_tgt_mxl < n_m[:, None]
  base_m = token_docs.offsets[:-1][doc_m]
  tokens = token_docs.tokens
  if tokens.size == 0:
    tokens = np.zeros(1, dtype=np.int32)
  gather_in = np.where(valid_in_mxl, base_m[:, None] + pos_in_mxl, 0)
  gather_tgt = np.where(valid_tgt_mxl, base_m[:, None] + pos_tgt_mxl, 0)
  inputs_mxl = np.where(valid_in_mxl, tokens[gather_in], pad_id)
  targets_mxl = np.where(valid_tgt_mxl, tokens[gather_tgt], pad_id)
  weights_mxl = valid_tgt_mxl & (pos_tgt_mxl >= prefix_len)
  return {
      'inputs': inputs_mxl.astype(np.int32),
      'targets': targets_mxl.astype(np.int32),
      'weights': weights_mxl.astype(np.float32),
      'doc_index': doc_m,
  }
