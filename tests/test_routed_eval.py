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


def _position_sums(layout):
  """A feature that is the token's position: sums and counts per group."""
  def group_sums(group_MxL, num_groups):
    valid = group_MxL >= 0
    sums = np.bincount(group_MxL[valid], layout.input_pos_MxL[valid],
                       minlength=num_groups)[:, None]
    return sums, np.bincount(group_MxL[valid], minlength=num_groups)
  return group_sums


def test_route_every_reads_the_previous_chunk_only():
  layout = routed.make_layout(_docs([20]), seq_len=8, prefix_len=4)
  path_MxL = routed.route_every(
      layout, prefix_len=4, every=4, doc_paths_N=np.array([99]),
      group_sums_fn=_position_sums(layout),
      route_fn=lambda f: np.floor(f[:, 0]).astype(int))
  weights = layout.windows["weights"] > 0
  for t, p in zip(layout.target_pos_MxL[weights], path_MxL[weights]):
    chunk = (t - 4) // 4
    # Chunk 0 takes the prefix's path; chunk c reads chunk c - 1, whose
    # input positions are 4 + 4 (c - 1) ... + 3 (mean: + 1.5).
    want = 99 if chunk == 0 else int(4 + 4 * (chunk - 1) + 1.5)
    assert p == want, (t, p, want)


def test_route_every_cumulative_reads_everything_so_far():
  layout = routed.make_layout(_docs([20]), seq_len=8, prefix_len=4)
  path_MxL = routed.route_every(
      layout, prefix_len=4, every=4, doc_paths_N=np.array([99]),
      group_sums_fn=_position_sums(layout),
      route_fn=lambda f: np.floor(f[:, 0]).astype(int), cumulative=True)
  weights = layout.windows["weights"] > 0
  for t, p in zip(layout.target_pos_MxL[weights], path_MxL[weights]):
    chunk = (t - 4) // 4
    # Positions 0 .. 4 + 4 c - 1 are read before chunk c: mean (4c + 3) / 2.
    want = 99 if chunk == 0 else int((4 * chunk + 3) / 2)
    assert p == want, (t, p, want)


def test_routed_once_selects_each_documents_path():
  layout = routed.make_layout(_docs([12, 12]), seq_len=8, prefix_len=4)
  path = routed.route_once(layout, np.array([1, 0]))
  totals = routed.RoutedTotals({"once": path})
  for p, value in ((0, 1.0), (1, 3.0)):  # path p scores every token `value`
    totals.add(p, np.full(path.shape, value) * layout.windows["weights"])
  # Doc 0 (8 scored tokens) on path 1 (3.0), doc 1 (8) on path 0 (1.0).
  assert totals.nll["once"] == 8 * 3.0 + 8 * 1.0
