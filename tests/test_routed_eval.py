"""Routed evaluation: which path scores which token."""

import dataclasses

import numpy as np
import pytest

from dipaco_jax.data import token_store
from dipaco_jax.eval import routed
from dipaco_jax.routing import router as router_lib
from dipaco_jax.routing import window_cv
from dipaco_jax.stages import cache
from dipaco_jax.stages import evaluation


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


def _planted(topics_NxC, doc_paths_N, nll_NxCxP_fn):
  """Topic documents (`_topic_docs`, chunks of 8 after a prefix of 4) and
  the window router's examples, each chunk's NLL under every path given
  by `nll_NxCxP_fn(layout, chunks, scored_NxC)`."""
  prefix, every = 4, 8
  layout = routed.make_layout(_topic_docs(topics_NxC, prefix, every),
                              seq_len=16, prefix_len=prefix)
  chunks = routed.chunk_features(layout, prefix, every, _topic_sums(layout))
  scored_NxC = routed.chunk_nll(layout, chunks, layout.windows["weights"])
  examples = routed.window_router_examples(
      chunks, doc_paths_N, nll_NxCxP_fn(layout, chunks, scored_NxC),
      scored_NxC)
  return layout, chunks, examples


def _alternating_topics():
  """Topics alternate chunk by chunk; the prefix router is right about
  chunk 0, and path p predicts topic p (`_topic_nll`)."""
  start = np.random.default_rng(0).integers(0, 2, size=40)
  topics = (start[:, None] + np.arange(6)[None, :]) % 2
  nll_fn = lambda layout, chunks, _: np.stack(
      [routed.chunk_nll(layout, chunks, _topic_nll(layout, p))
       for p in range(2)], axis=-1)
  return topics, topics[:, 0], nll_fn


def _no_signal(seed=1):
  """Random chunk topics that say nothing about the best path; each
  document's prefix path is best on about 80% of its chunks (NLL 1 per
  token against 1.5), the other path on the rest, at random."""
  rng = np.random.default_rng(seed)
  topics = rng.integers(0, 2, size=(40, 6))
  doc_paths = np.arange(40) % 2

  def nll_fn(unused_layout, unused_chunks, scored_NxC):
    flip_NxC = rng.random(scored_NxC.shape) < 0.2
    best_NxC = np.where(flip_NxC, 1 - doc_paths[:, None], doc_paths[:, None])
    is_best_NxCxP = np.arange(2)[None, None, :] == best_NxC[:, :, None]
    return scored_NxC[:, :, None] * np.where(is_best_NxCxP, 1.0, 1.5)
  return topics, doc_paths, nll_fn


def _fit_with_cv(examples, objective="expected_nll"):
  inputs, nll_XxP, tokens_X, prefix_paths, doc_X = examples
  return window_cv.fit_window_router(0, inputs, nll_XxP, tokens_X,
                                     prefix_paths, doc_X, (2,), objective)


@pytest.mark.parametrize("objective", ["expected_nll", "best_path"])
def test_learned_window_router_recovers_a_planted_rule(objective):
  """Topics alternate chunk by chunk: routing once per document gets half
  the chunks wrong, a router that learns "the next chunk has the other
  topic" from the previous chunk's feature gets all of them, and
  cross-validation on the router documents says so."""
  topics, doc_paths, nll_fn = _alternating_topics()
  layout, chunks, examples = _planted(topics, doc_paths, nll_fn)
  inputs, nll_XxP, tokens_X, prefix_paths, doc_X = examples
  assert (tokens_X == 8).all() and (np.bincount(doc_X) == 5).all()
  assert len(inputs) == 40 * 5
  assert np.mean(prefix_paths == nll_XxP.argmin(1)) == pytest.approx(0.4)
  window_router, info = _fit_with_cv(examples, objective)
  assert info["train_accuracy"] == 1.0
  assert info["train_excess_nll_per_token"] == 0.0
  assert info["decision"] == "reroute" and info["cv_folds"] == 5
  assert not window_router.keep_document_path
  # Held out, every chunk on its topic's path (NLL 1 per token); the
  # prefix path is wrong on 3 of 5 chunks (NLL 3).
  assert info["cv_nll_per_token_reroute"] == pytest.approx(1.0)
  assert info["cv_nll_per_token_document_path"] == pytest.approx(
      (2 * 1.0 + 3 * 3.0) / 5)
  assert evaluation.window_router_label(64, window_router) == (
      "dipaco re-routed every 64 tokens (learned window router)")
  routes = {"once": routed.route_once(layout, doc_paths),
            "learned": evaluation.window_router_routes(
                layout, chunks, doc_paths, window_router, 2)}
  totals = routed.RoutedTotals(routes)
  for p in range(2):
    totals.add(p, _topic_nll(layout, p))
  scores = totals.nll
  scored = layout.windows["weights"].sum()
  # Learned: every token on its topic's path (NLL 1). Once: the 3 chunks of
  # 8 tokens per document whose topic differs from chunk 0's cost 3.
  assert scores["learned"] == pytest.approx(scored * 1.0)
  assert scores["once"] == pytest.approx(scored * 1.0 + 2.0 * 40 * 3 * 8)


@pytest.mark.parametrize("objective", ["expected_nll", "best_path"])
def test_window_router_keeps_document_path_when_chunks_tell_nothing(
    objective):
  """No router reading the chunks can beat the prefix path here (it does
  not see that path): cross-validation keeps each document's path, and
  re-routing then is routing once, exactly."""
  topics, doc_paths, nll_fn = _no_signal()
  layout, chunks, examples = _planted(topics, doc_paths, nll_fn)
  window_router, info = _fit_with_cv(examples, objective)
  assert info["decision"] == "keep_document_path" and info["cv_folds"] == 5
  assert info["cv_nll_per_token_document_path"] < (
      info["cv_nll_per_token_reroute"])
  assert window_router.keep_document_path
  once_MxL = routed.route_once(layout, doc_paths)
  np.testing.assert_array_equal(evaluation.window_router_routes(
      layout, chunks, doc_paths, window_router, 2), once_MxL)
  # The fitted router's own choices would differ: the flag does the work.
  learned_MxL = evaluation.window_router_routes(
      layout, chunks, doc_paths,
      dataclasses.replace(window_router, keep_document_path=False), 2)
  assert (learned_MxL != once_MxL)[layout.windows["weights"] > 0].any()
  assert "kept each document's path" in evaluation.window_router_label(
      64, window_router)


def test_fewer_than_two_router_documents_keep_the_document_path():
  topics, doc_paths, nll_fn = _alternating_topics()
  _, _, examples = _planted(topics[:1], doc_paths[:1], nll_fn)
  window_router, info = _fit_with_cv(examples)
  assert info["decision"] == "keep_document_path" and info["cv_folds"] == 0
  assert info["cv_nll_per_token_reroute"] is None
  assert window_router.keep_document_path


@pytest.mark.parametrize("planted,decision", [
    (_alternating_topics, "reroute"), (_no_signal, "keep_document_path")])
def test_window_router_decision_survives_the_cache(tmp_path, planted,
                                                   decision):
  """Saved by `cache.cached_router`, reloaded: the same decision, routes
  and hash."""
  topics, doc_paths, nll_fn = planted()
  layout, chunks, examples = _planted(topics, doc_paths, nll_fn)
  path = tmp_path / "window_x.npz"
  fitted, info = cache.cached_router(
      path, lambda: _fit_with_cv(examples))
  loaded, loaded_info = cache.cached_router(
      path, lambda: pytest.fail("refit instead of reloading"))
  assert info["decision"] == loaded_info["decision"] == decision
  assert loaded.keep_document_path == (decision == "keep_document_path")
  assert loaded.sha256() == fitted.sha256()
  np.testing.assert_array_equal(
      evaluation.window_router_routes(layout, chunks, doc_paths, loaded, 2),
      evaluation.window_router_routes(layout, chunks, doc_paths, fitted, 2))


def test_expected_nll_router_weighs_wins_by_their_size():
  """70% of chunks: path 0 better by a hair; 30%: path 1 better by a lot.
  Best-path labels say path 0; the expected NLL says path 1."""
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


def test_a_gain_within_the_noise_of_the_router_documents_is_not_clear():
  """One-sided paired test over documents: a consistent gain is clear, a
  tiny mean gain under a large spread is not (so the path is kept)."""
  rng = np.random.default_rng(0)
  doc_X = np.repeat(np.arange(50), 4)
  consistent = window_cv.clear_gain(np.full(200, 0.01), doc_X)
  assert consistent == float("inf")
  noisy = rng.normal(0.0, 1.0, 200)
  noisy += 0.001 - noisy.mean()  # A positive mean gain, swamped by noise.
  assert 0 < window_cv.clear_gain(noisy, doc_X) < (
      window_cv.MARGIN_STANDARD_ERRORS)
  assert window_cv.clear_gain(-np.ones(200), doc_X) < 0
