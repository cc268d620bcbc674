"""Routed evaluation: each document (or each window of it) scored by one path.

Per-token negative log-likelihoods are computed once under every path
(`nll_PxMxL`); routing decisions then just pick, per token, which path's
number counts. That makes routed-once, re-routed every N tokens, the dense
baseline and per-path best (oracle) scores exactly comparable: the same
tokens, the first `prefix_len` of each document never scored.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dipaco_jax.data import batches as batches_lib


@dataclasses.dataclass
class Layout:
  """Validation windows and, per token, where it sits in its document."""
  windows: dict  # inputs, targets, weights, doc_index  ([M, L] / [M])
  input_pos_MxL: np.ndarray  # absolute position of each input token
  num_docs: int

  @property
  def target_pos_MxL(self):
    return self.input_pos_MxL + 1


def make_layout(docs, seq_len: int, prefix_len: int) -> Layout:
  windows = batches_lib.eval_windows(docs, seq_len, prefix_len)
  doc_M = windows["doc_index"]
  # Windows of a document are consecutive: window k starts at k * L.
  first = np.r_[0, np.flatnonzero(np.diff(doc_M)) + 1]
  k_M = np.arange(len(doc_M)) - np.repeat(first, np.diff(np.r_[first,
                                                             len(doc_M)]))
  input_pos = k_M[:, None] * seq_len + np.arange(seq_len)[None, :]
  return Layout(windows, input_pos, len(docs))


@functools.partial(jax.jit, static_argnums=0)
def _token_nll(model, params, inputs_BxL, targets_BxL, weights_BxL):
  logits = model.apply({"params": params}, inputs_BxL)
  nll = optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), targets_BxL)
  return nll * weights_BxL


def token_nll(model, params, layout: Layout, batch_size: int) -> np.ndarray:
  """[M, L] weighted per-token NLL of one set of path parameters."""
  w = layout.windows
  m = len(w["inputs"])
  out = np.zeros(w["inputs"].shape, np.float32)
  for start in range(0, m, batch_size):
    idx = np.arange(start, min(start + batch_size, m))
    take = np.concatenate([idx, np.full(batch_size - len(idx), idx[0])])
    weights = w["weights"][take].copy()
    weights[len(idx):] = 0
    nll = _token_nll(model, params, w["inputs"][take], w["targets"][take],
                     weights)
    out[idx] = np.asarray(nll)[:len(idx)]
  return out


def chunk_ids(pos_MxL, doc_M, prefix_len: int, every: int,
              max_chunks_per_doc: int):
  """Global chunk id of each position: chunk c of doc d covers positions
  [prefix_len + c*every, prefix_len + (c+1)*every); -1 before the prefix
  ends. Returns (ids_MxL, chunks_per_doc)."""
  local = np.where(pos_MxL >= prefix_len, (pos_MxL - prefix_len) // every,
                   -1)
  ids = np.where(local >= 0, doc_M[:, None] * max_chunks_per_doc + local, -1)
  return ids, max_chunks_per_doc


def routed_nll(nll_PxMxL, path_MxL) -> float:
  return float(np.take_along_axis(nll_PxMxL, path_MxL[None], 0).sum())


def summary(nll: float, count: float) -> dict:
  loss = float(nll) / max(float(count), 1.0)
  return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)),
          "tokens": int(count)}


def route_once(layout: Layout, doc_paths_N) -> np.ndarray:
  """Every token of a document goes to the path chosen from its prefix."""
  return np.broadcast_to(doc_paths_N[layout.windows["doc_index"]][:, None],
                         layout.input_pos_MxL.shape)


def route_every(layout: Layout, prefix_len: int, every: int, doc_paths_N,
                route_features_fn) -> np.ndarray:
  """Re-routing: chunk 0 (right after the prefix) takes the prefix's path;
  chunk c + 1 takes the path chosen from chunk c's tokens.

  `route_features_fn(input_chunk_ids_MxL, num_chunks) -> paths [num_chunks]`
  routes every chunk by its own tokens; the result is shifted by one chunk.
  """
  doc_M = layout.windows["doc_index"]
  max_pos = int(layout.input_pos_MxL.max()) + 2
  per_doc = max(1, -(-(max_pos - prefix_len) // every) + 1)
  input_ids, _ = chunk_ids(layout.input_pos_MxL, doc_M, prefix_len, every,
                           per_doc)
  target_ids, _ = chunk_ids(layout.target_pos_MxL, doc_M, prefix_len, every,
                            per_doc)
  chunk_path = route_features_fn(input_ids, layout.num_docs * per_doc)
  chunk_path = np.asarray(chunk_path).reshape(layout.num_docs, per_doc)
  # The path for chunk c + 1 is read from chunk c; chunk 0 uses the prefix.
  shifted = np.concatenate([np.asarray(doc_paths_N)[:, None],
                            chunk_path[:, :-1]], axis=1).reshape(-1)
  return np.where(target_ids >= 0, shifted[np.maximum(target_ids, 0)], 0)
