"""Routed evaluation: which path scores which token."""

import numpy as np

from dipaco_jax.data import token_store
from dipaco_jax.eval import routed


def _docs(lengths):
  tokens = np.concatenate([np.arange(n, dtype=np.int32) + 4 for n in lengths])
  return token_store.TokenDocs(tokens, np.r_[0, np.cumsum(lengths)])


def test_layout_positions_and_scored_tokens():
  layout = routed.make_layout(_docs([20, 6]), seq_len=8, prefix_len=4)
  w = layout.windows
  # Doc 0 (20 tokens): windows at 0, 8, 16; doc 1 (6 tokens): one window.
  np.testing.assert_array_equal(w["doc_index"], [0, 0, 0, 1])
  np.testing.assert_array_equal(layout.input_pos_MxL[:, 0], [0, 8, 16, 0])
  scored = layout.target_pos_MxL[w["weights"] > 0]
  assert scored.min() == 4
  # Targets 4..19 of doc 0 and 4..5 of doc 1: 16 + 2 tokens.
  assert w["weights"].sum() == 18


def test_route_every_uses_the_previous_chunk():
  layout = routed.make_layout(_docs([20]), seq_len=8, prefix_len=4)
  seen = {}

  def route_chunks(input_chunks_MxL, num_chunks):
    seen["ids"] = input_chunks_MxL
    return 10 + np.arange(num_chunks)  # chunk c -> path 10 + c

  path_MxL = routed.route_every(layout, prefix_len=4, every=4,
                                doc_paths_N=np.array([5]),
                                route_features_fn=route_chunks)
  target = layout.target_pos_MxL
  weights = layout.windows["weights"] > 0
  for t, p in zip(target[weights], path_MxL[weights]):
    chunk = (t - 4) // 4
    # Chunk 0 takes the prefix's path; chunk c takes the path read from c-1.
    assert p == (5 if chunk == 0 else 10 + chunk - 1), (t, p)
  # The router of chunk c reads input positions of chunk c only.
  ids = seen["ids"]
  pos = layout.input_pos_MxL
  np.testing.assert_array_equal(ids[pos < 4], -1)
  np.testing.assert_array_equal(ids[(pos >= 4) & (pos < 8)], 0)
  np.testing.assert_array_equal(ids[(pos >= 8) & (pos < 12)], 1)


def test_routed_once_selects_each_documents_path():
  layout = routed.make_layout(_docs([12, 12]), seq_len=8, prefix_len=4)
  path = routed.route_once(layout, np.array([1, 0]))
  nll = np.stack([np.full(path.shape, 1.0), np.full(path.shape, 3.0)])
  nll = nll * layout.windows["weights"][None]
  # Doc 0 (8 scored tokens) on path 1 (3.0), doc 1 (8) on path 0 (1.0).
  assert routed.routed_nll(nll, path) == 8 * 3.0 + 8 * 1.0
