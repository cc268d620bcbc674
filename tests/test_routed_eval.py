"""Routed evaluation: which path scores which token."""

import numpy as np
import pytest

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


def _want_previous_chunk(chunk):
  # Chunk c reads chunk c - 1, whose input positions are 4 + 4 (c - 1) ...
  # + 3 (mean: + 1.5).
  return int(4 + 4 * (chunk - 1) + 1.5)


def _want_cumulative(chunk):
  # Positions 0 .. 4 + 4 c - 1 are read before chunk c: mean (4c + 3) / 2.
  return int((4 * chunk + 3) / 2)


@pytest.mark.parametrize("context,want_fn", [
    ("previous_chunk", _want_previous_chunk),
    ("cumulative", _want_cumulative)])
def test_rerouting_reads_only_tokens_before_the_chunk(context, want_fn):
  """The feature is each token's position, the route its floor: the path
  of every scored token names exactly what the router read."""
  layout = routed.make_layout(_docs([20]), seq_len=8, prefix_len=4)
  chunks = routed.chunk_features(layout, 4, 4, _position_sums(layout))
  path_MxL = routed.route_by_features(
      layout, chunks, np.array([99]), lambda f: np.floor(f[:, 0]).astype(int),
      chunks.features(context))
  weights = layout.windows["weights"] > 0
  for t, p in zip(layout.target_pos_MxL[weights], path_MxL[weights]):
    chunk = (t - 4) // 4
    want = 99 if chunk == 0 else want_fn(chunk)  # chunk 0: the prefix's path
    assert p == want, (t, p, want)


def test_routed_once_selects_each_documents_path():
  layout = routed.make_layout(_docs([12, 12]), seq_len=8, prefix_len=4)
  path = routed.route_once(layout, np.array([1, 0]))
  totals = routed.RoutedTotals({"once": path})
  for p, value in ((0, 1.0), (1, 3.0)):  # path p scores every token `value`
    totals.add(p, np.full(path.shape, value) * layout.windows["weights"])
  # Doc 0 (8 scored tokens) on path 1 (3.0), doc 1 (8) on path 0 (1.0).
  assert totals.nll["once"] == 8 * 3.0 + 8 * 1.0


def _topic_docs(topics_NxC, prefix_len, every):
  """Documents whose tokens name a topic (token 4 + t): the prefix takes the
  topic of chunk 0, chunk c's input tokens the topic of chunk c."""
  docs = []
  for topics in topics_NxC:
    tokens = [4 + topics[0]] * prefix_len
    for t in topics:
      tokens += [4 + t] * every
    docs.append(tokens)
  lengths = [len(d) for d in docs]
  return token_store.TokenDocs(np.concatenate(docs).astype(np.int32),
                               np.r_[0, np.cumsum(lengths)])


def _topic_sums(layout):
  """The routing feature of a token: the one-hot of its topic."""
  def group_sums(group_MxL, num_groups):
    valid = group_MxL >= 0
    one_hot = np.eye(2)[layout.windows["inputs"][valid] - 4]
    sums = np.zeros((num_groups, 2))
    np.add.at(sums, group_MxL[valid], one_hot)
    return sums, np.bincount(group_MxL[valid], minlength=num_groups)
  return group_sums


def _topic_nll(layout, path):
  """Path p predicts topic p: NLL 1 on its topic's tokens, 3 elsewhere."""
  targets = layout.windows["targets"]
  return np.where(targets - 4 == path, 1.0, 3.0) * layout.windows["weights"]


def test_chunk_nll_and_window_features():
  prefix, every = 4, 8
  topics = np.array([[0, 1, 1], [1, 0, 1]])
  layout = routed.make_layout(_topic_docs(topics, prefix, every), seq_len=16,
                              prefix_len=prefix)
  chunks = routed.chunk_features(layout, prefix, every, _topic_sums(layout))
  nll = routed.chunk_nll(layout, chunks, _topic_nll(layout, path=1))
  # Target chunk c is chunk c's own 8 tokens: 1.0 each on topic 1, else 3.0.
  np.testing.assert_allclose(nll[:, :3], [[24, 8, 8], [8, 24, 8]])
  assert not nll[:, 3:].any()
  feats = routed.window_router_features(chunks, np.array([0, 1]), 2,
                                        prefix_path=True)
  # [N, chunks - 1, cumulative (2) + previous chunk (2) + prefix path (2)].
  assert feats.shape == (2, chunks.num_chunks - 1, 6)
  # Doc 0 chunk 1 is routed from chunk 0 (topic 0) and the prefix (topic 0).
  np.testing.assert_allclose(feats[0, 0], [1, 0, 1, 0, 1, 0])
  # Doc 1 chunk 2 reads prefix + chunks 0, 1: 12 of topic 1, 8 of topic 0.
  np.testing.assert_allclose(feats[1, 1], [0.4, 0.6, 1, 0, 0, 1])


@pytest.mark.parametrize("objective", ["expected_nll", "best_path"])
def test_learned_window_router_recovers_a_planted_rule(objective):
  """Topics alternate chunk by chunk: routing once per document gets half
  the chunks wrong, a router that learns "the next chunk has the other
  topic" from the previous chunk's feature gets all of them."""
  from dipaco_jax.routing import router as router_lib  # pylint: disable=g-import-not-at-top
  prefix, every, chunks_per_doc = 4, 8, 6
  start = np.random.default_rng(0).integers(0, 2, size=40)
  topics = (start[:, None] + np.arange(chunks_per_doc)[None, :]) % 2
  layout = routed.make_layout(_topic_docs(topics, prefix, every), seq_len=16,
                              prefix_len=prefix)
  chunks = routed.chunk_features(layout, prefix, every, _topic_sums(layout))
  doc_paths = topics[:, 0]  # the prefix router is right about chunk 0
  nll_NxCxP = np.stack([routed.chunk_nll(layout, chunks,
                                         _topic_nll(layout, p))
                        for p in range(2)], axis=-1)
  scored_NxC = routed.chunk_nll(layout, chunks, layout.windows["weights"])
  inputs, nll_XxP, tokens_X, prefix_paths, doc_X = (
      routed.window_router_examples(chunks, doc_paths, nll_NxCxP, scored_NxC))
  assert (tokens_X == every).all() and (np.bincount(doc_X) == 5).all()
  assert len(inputs) == 40 * (chunks_per_doc - 1)
  assert np.mean(prefix_paths == nll_XxP.argmin(1)) == pytest.approx(0.4)
  window_router, info = router_lib.fit_window_router(
      0, inputs, nll_XxP, tokens_X, (2,), objective)
  assert info["train_accuracy"] == 1.0
  assert info["train_excess_nll_per_token"] == 0.0
  routes = {"once": routed.route_once(layout, doc_paths),
            "learned": routed.route_by_features(
                layout, chunks, doc_paths,
                lambda f: window_router.top_k(f, 1)[:, 0],
                routed.window_router_features(chunks, doc_paths, 2))}
  totals = routed.RoutedTotals(routes)
  for p in range(2):
    totals.add(p, _topic_nll(layout, p))
  scores = totals.nll
  scored = layout.windows["weights"].sum()
  # Learned: every token on its topic's path (NLL 1). Once: the 3 chunks of
  # 8 tokens per document whose topic differs from chunk 0's cost 3.
  assert scores["learned"] == pytest.approx(scored * 1.0)
  assert scores["once"] == pytest.approx(scored * 1.0 + 2.0 * 40 * 3 * 8)


def test_expected_nll_router_weighs_wins_by_their_size():
  """70% of chunks: path 0 better by a hair; 30%: path 1 better by a lot.
  Best-path labels say path 0; the expected NLL says path 1."""
  from dipaco_jax.routing import router as router_lib  # pylint: disable=g-import-not-at-top
  n = 100
  inputs = np.ones((n, 3), np.float32)  # nothing to tell chunks apart
  nll = np.where(np.arange(n)[:, None] < 70, [10.0, 10.1], [20.0, 10.0])
  tokens = np.full(n, 10)
  picks = {}
  for objective in ("best_path", "expected_nll"):
    router, info = router_lib.fit_window_router(0, inputs, nll, tokens, (2,),
                                                objective)
    picks[objective] = set(router.top_k(inputs, 1)[:, 0].tolist())
  assert picks == {"best_path": {0}, "expected_nll": {1}}
  # Excess per token of always choosing path 1: 70 x 0.1 / 1000 tokens.
  assert info["train_excess_nll_per_token"] == pytest.approx(0.007)
