"""Routed evaluation: each document (or each window of it) scored by one path.

Per-token negative log-likelihoods are computed once under every path (a
group of paths at a time, sharded over the devices: `eval/sharded.py`);
routing decisions just pick, per token, which path's number
counts (`RoutedTotals`). That makes routed-once, re-routed every N tokens, the dense
baseline and per-path best (oracle) scores exactly comparable: the same
tokens, the first `prefix_len` of each document never scored.
"""

import dataclasses
import math

import numpy as np

from dipaco_jax.data import batches as batches_lib
from dipaco_jax.eval import sharded


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


def document_blocks(docs, block_tokens: int):
  """Consecutive (first, stop) document ranges of about `block_tokens`
  tokens each (`config.eval.block_tokens`; a longer document is a block
  alone; 0: one block), so that a split is scored a block at a time. A
  layout holds about 80 bytes a token (windows, positions, routes and a
  group's NLLs). Every per-token and per-document number is the same as in
  one layout: windows never cross documents."""
  lengths = np.asarray(docs.lengths())
  if block_tokens <= 0 or lengths.sum() <= block_tokens:
    return [(0, len(lengths))] if len(lengths) else []
  ends = np.cumsum(lengths)
  out, first = [], 0
  while first < len(lengths):
    base = ends[first - 1] if first else 0
    stop = int(np.searchsorted(ends, base + block_tokens, side="right"))
    stop = max(stop, first + 1)
    out.append((first, stop))
    first = stop
  return out


def make_layout(docs, seq_len: int, prefix_len: int) -> Layout:
  windows = batches_lib.eval_windows(docs, seq_len, prefix_len)
  doc_M = windows["doc_index"]
  # Windows of a document are consecutive: window k starts at k * L.
  first = np.r_[0, np.flatnonzero(np.diff(doc_M)) + 1]
  k_M = np.arange(len(doc_M)) - np.repeat(first, np.diff(np.r_[first,
                                                             len(doc_M)]))
  input_pos = k_M[:, None] * seq_len + np.arange(seq_len)[None, :]
  return Layout(windows, input_pos, len(docs), docs.lengths()[doc_M])


def token_nll(model, params, layout: Layout, batch_size: int) -> np.ndarray:
  """[M, L] weighted per-token NLL of one set of path parameters (its
  windows spread over this process's devices, `eval/sharded.py`)."""
  return sharded.group_token_nll(model, [params], layout, batch_size)[0]


class RoutedTotals:
  """Adds up, path by path, the NLL of the tokens each routing scheme gives
  to that path (so only one group of paths' NLLs is in memory at a time)."""

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


def compact_ids(paths) -> np.ndarray:
  """Path ids in the smallest integer type that holds them: a route holds
  one id per validation token and scheme (int16 up to 32,767 paths)."""
  paths = np.asarray(paths)
  top = int(paths.max(initial=0))
  return paths.astype(np.int16 if top < 2 ** 15 else np.int32)


def route_once(layout: Layout, doc_paths_N) -> np.ndarray:
  """Every token of a document goes to the path chosen from its prefix."""
  return np.broadcast_to(
      compact_ids(doc_paths_N)[layout.windows["doc_index"]][:, None],
      layout.input_pos_MxL.shape)


@dataclasses.dataclass
class Chunks:
  """The routing feature of every re-routing chunk of every document.

  Target chunk c of a document covers target positions [prefix_len + c *
  every, prefix_len + (c + 1) * every). Input group 0 is the prefix and input
  group 1 + c the input positions of chunk c, so groups 0 .. c are exactly
  the tokens read before target chunk c is predicted (the input at position
  t predicts the target at t + 1).
  """
  prefix_len: int
  every: int
  num_chunks: int  # chunks per document: the longest document's, plus one
  sums_NxGxD: np.ndarray  # feature sums per input group, G = num_chunks + 1
  counts_NxG: np.ndarray

  def features(self, context: str) -> np.ndarray:
    """[N, num_chunks - 1, D'] features that route chunks 1 .. num_chunks - 1.

    context: 'previous_chunk' (the router reads chunk c and picks the path
    for chunk c + 1, the paper's scheme), 'cumulative' (every token so far),
    or 'both' (the two concatenated, D' = 2 D).
    """
    if context == "both":
      return np.concatenate([self.features("cumulative"),
                             self.features("previous_chunk")], axis=-1)
    sums, counts = self.sums_NxGxD, self.counts_NxG
    if context == "cumulative":
      sums, counts = sums.cumsum(1), counts.cumsum(1)
    elif context != "previous_chunk":
      raise ValueError(f"Unknown re-routing context {context!r}.")
    # Groups 1 .. num_chunks - 1 (input chunks 0 .. num_chunks - 2) route
    # target chunks 1 .. num_chunks - 1.
    return (sums[:, 1:-1] / np.maximum(counts[:, 1:-1], 1)[..., None]
            ).astype(np.float32)


def target_chunk_MxL(layout: Layout, prefix_len: int, every: int,
                     num_chunks: int) -> np.ndarray:
  """The chunk of every target token (0 for the unscored prefix)."""
  pos_out = layout.target_pos_MxL
  return np.where(pos_out >= prefix_len,
                  np.minimum((pos_out - prefix_len) // every, num_chunks - 1),
                  0)


def chunk_features(layout: Layout, prefix_len: int, every: int,
                   group_sums_fn) -> Chunks:
  """Feature sums of the prefix and of every chunk's input tokens.

  `group_sums_fn`: `(group_ids_MxL, num_groups) -> (sums_GxD, counts_G)`,
  feature sums over groups of input positions (-1: no group).
  """
  doc_M = layout.windows["doc_index"]
  pos_in = layout.input_pos_MxL
  num_chunks = -(-(int(layout.target_pos_MxL.max()) + 1 - prefix_len)
                 // every) + 1
  groups_per_doc = num_chunks + 1
  local = np.where(pos_in < prefix_len, 0, (pos_in - prefix_len) // every + 1)
  groups = np.where(layout.real_input_MxL,
                    doc_M[:, None] * groups_per_doc + local, -1)
  sums, counts = group_sums_fn(groups, layout.num_docs * groups_per_doc)
  return Chunks(prefix_len, every, num_chunks,
                np.asarray(sums).reshape(layout.num_docs, groups_per_doc, -1),
                np.asarray(counts).reshape(layout.num_docs, groups_per_doc))


def chunk_nll(layout: Layout, chunks: Chunks, nll_MxL) -> np.ndarray:
  """[N, num_chunks] summed NLL of each target chunk of each document."""
  ids = (layout.windows["doc_index"][:, None] * chunks.num_chunks +
         target_chunk_MxL(layout, chunks.prefix_len, chunks.every,
                          chunks.num_chunks))
  return np.bincount(ids.ravel(), weights=np.asarray(nll_MxL).ravel(),
                     minlength=layout.num_docs * chunks.num_chunks).reshape(
                         layout.num_docs, chunks.num_chunks)


def window_router_features(chunks: Chunks, doc_paths_N, num_paths: int,
                           context: str = "both",
                           prefix_path: bool = False) -> np.ndarray:
  """[N, num_chunks - 1, D'] inputs of the learned window router: the mean
  feature of the tokens read so far (`Chunks.features(context)`; 'both' is
  everything so far and the previous chunk) and, with `prefix_path`, the
  one-hot path the prefix chose. All of it is known before the chunk.

  The prefix path is off by default: after a discriminative phase the
  document router was fit on the router documents themselves, so on them
  the prefix path is an in-sample guess, better than it is on new text; and
  5-fold cross-validation on the router documents preferred the inputs
  without it (bench/window_router_study.py, docs/quality.md).
  """
  feats = chunks.features(context)
  if not prefix_path:
    return feats
  one_hot = np.eye(num_paths, dtype=np.float32)[np.asarray(doc_paths_N)]
  return np.concatenate([feats, np.broadcast_to(
      one_hot[:, None, :], feats.shape[:2] + (num_paths,))], axis=-1)


def window_router_examples(chunks: Chunks, doc_paths_N, nll_NxCxP,
                           scored_NxC, **feature_kwargs):
  """Training examples of the learned window router: one per chunk c >= 1
  with scored tokens (`scored_NxC`: `chunk_nll` of the token weights).
  Returns (inputs_XxD, nll_XxP, tokens_X, prefix_paths_X, doc_X): what was
  read before the chunk (`window_router_features(**feature_kwargs)`), the
  chunk's summed NLL under every path (its label is the best path), its
  scored tokens, the path the prefix chose and the chunk's document."""
  keep_NxC = np.asarray(scored_NxC)[:, 1:] > 0
  inputs = window_router_features(chunks, doc_paths_N, nll_NxCxP.shape[-1],
                                  **feature_kwargs)[keep_NxC]
  doc_NxC = np.broadcast_to(np.arange(len(keep_NxC))[:, None], keep_NxC.shape)
  return (inputs, np.asarray(nll_NxCxP)[:, 1:][keep_NxC],
          np.asarray(scored_NxC)[:, 1:][keep_NxC],
          np.asarray(doc_paths_N)[doc_NxC[keep_NxC]], doc_NxC[keep_NxC])


def route_chunks(layout: Layout, chunks: Chunks, doc_paths_N,
                 later_paths_NxC) -> np.ndarray:
  """The path of every target token: chunk 0 takes the prefix's path
  (`doc_paths_N`), chunk c >= 1 takes `later_paths_NxC[:, c - 1]`."""
  chunk_path = np.concatenate([np.asarray(doc_paths_N)[:, None],
                               np.asarray(later_paths_NxC)], axis=1)
  target_chunk = target_chunk_MxL(layout, chunks.prefix_len, chunks.every,
                                  chunks.num_chunks)
  doc_M = layout.windows["doc_index"]
  return compact_ids(np.where(layout.target_pos_MxL >= chunks.prefix_len,
                              chunk_path[doc_M[:, None], target_chunk], 0))


def route_by_features(layout: Layout, chunks: Chunks, doc_paths_N, route_fn,
                      feats_NxCxD) -> np.ndarray:
  """`route_chunks` with chunk c >= 1 routed by `route_fn` (`features_XxD ->
  paths_X`) on `feats_NxCxD[:, c - 1]`."""
  paths = np.asarray(route_fn(feats_NxCxD.reshape(-1, feats_NxCxD.shape[-1])))
  return route_chunks(layout, chunks, doc_paths_N, paths.reshape(
      feats_NxCxD.shape[:2]))
