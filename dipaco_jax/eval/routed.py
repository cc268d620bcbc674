"""Routed evaluation: each document (or each window of it) scored by one path.

Per-token negative log-likelihoods are computed once under every path, one
path at a time; routing decisions just pick, per token, which path's number
counts (`RoutedTotals`). That makes routed-once, re-routed every N tokens, the dense
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
  doc_length_M: np.ndarray  # length of each window's document

  @property
  def real_input_MxL(self):
    """Input positions inside their document (not padding)."""
    return self.input_pos_MxL < self.doc_length_M[:, None]

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
  return Layout(windows, input_pos, len(docs), docs.lengths()[doc_M])


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


class RoutedTotals:
  """Adds up, path by path, the NLL of the tokens each routing scheme gives
  to that path (so only one path's NLLs are in memory at a time)."""

  def __init__(self, routes: dict):
    self.routes = routes  # name -> path of every token [M, L]
    self.nll = {name: 0.0 for name in routes}

  def add(self, path: int, nll_MxL) -> None:
    for name, path_MxL in self.routes.items():
      self.nll[name] += float(nll_MxL[path_MxL == path].sum())


def summary(nll: float, count: float) -> dict:
  loss = float(nll) / max(float(count), 1.0)
  return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)),
          "tokens": int(count)}


def route_once(layout: Layout, doc_paths_N) -> np.ndarray:
  """Every token of a document goes to the path chosen from its prefix."""
  return np.broadcast_to(doc_paths_N[layout.windows["doc_index"]][:, None],
                         layout.input_pos_MxL.shape)


def route_every(layout: Layout, prefix_len: int, every: int, doc_paths_N,
                group_sums_fn, route_fn, cumulative: bool = False):
  """Re-routing every `every` tokens; returns the path of every target.

  Target chunk c of a document covers positions [prefix_len + c * every,
  prefix_len + (c + 1) * every). Chunk 0 takes the prefix's path
  (`doc_paths_N`); chunk c + 1 takes the path `route_fn` picks from the
  tokens read so far: chunk c alone (`cumulative=False`: "the router reads
  chunk i and picks the path for chunk i+1"), or the whole document up to
  the end of chunk c (`cumulative=True`).

  Args:
    layout: the validation windows.
    prefix_len: the routing prefix (never scored).
    every: the re-routing interval N.
    doc_paths_N: each document's path from its prefix.
    group_sums_fn: `(group_ids_MxL, num_groups) -> (sums_GxD, counts_G)`,
      feature sums over groups of input positions (-1: no group).
    route_fn: `features_NxD -> paths_N`.
    cumulative: see above.
  """
  doc_M = layout.windows["doc_index"]
  pos_in, pos_out = layout.input_pos_MxL, layout.target_pos_MxL
  per_doc = -(-(int(pos_out.max()) + 1 - prefix_len) // every) + 1
  # Group 0 of a document is its prefix, group 1 + c its chunk c.
  local = np.where(pos_in < prefix_len, 0, (pos_in - prefix_len) // every + 1)
  groups = np.where(layout.real_input_MxL,
                    doc_M[:, None] * (per_doc + 1) + local, -1)
  sums, counts = group_sums_fn(groups, layout.num_docs * (per_doc + 1))
  sums = np.asarray(sums).reshape(layout.num_docs, per_doc + 1, -1)
  counts = np.asarray(counts).reshape(layout.num_docs, per_doc + 1)
  if cumulative:
    sums, counts = sums.cumsum(1), counts.cumsum(1)
  # Features of chunks 0 .. per_doc - 2 route chunks 1 .. per_doc - 1.
  feats = sums[:, 1:-1] / np.maximum(counts[:, 1:-1], 1)[..., None]
  paths = np.asarray(route_fn(feats.reshape(-1, feats.shape[-1]))).reshape(
      layout.num_docs, per_doc - 1)
  # A chunk with no tokens read (past the document's end) routes nothing.
  chunk_path = np.concatenate([np.asarray(doc_paths_N)[:, None], paths],
                              axis=1)
  target_chunk = np.where(pos_out >= prefix_len,
                          (pos_out - prefix_len) // every, 0)
  return np.where(pos_out >= prefix_len,
                  chunk_path[doc_M[:, None], np.minimum(target_chunk,
                                                        per_doc - 1)], 0)
