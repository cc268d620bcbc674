"""Tests for dipaco_jax.routing: k-means, product k-means, discriminative."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dipaco_jax.routing import discriminative
from dipaco_jax.routing import kmeans as km


def _planted(seed, n, d, k, sep=10.0, noise=0.5):
  """n points around k well-separated random centres in d dims."""
  rng = np.random.default_rng(seed)
  centres_KxD = sep * rng.standard_normal((k, d))
  labels_N = rng.integers(0, k, size=n)
  labels_N[:k] = np.arange(k)  # every cluster is non-empty
  x_NxD = centres_KxD[labels_N] + noise * rng.standard_normal((n, d))
  return x_NxD.astype(np.float32), labels_N


def _same_partition(a_N, b_N):
  """True if labellings a and b agree up to a permutation of label names."""
  a_N, b_N = np.asarray(a_N), np.asarray(b_N)
  pairs = set(zip(a_N.tolist(), b_N.tolist()))
  return (len(pairs) == len(set(a_N.tolist()))
          == len(set(b_N.tolist())))


def _inertia(x_NxD, c_KxD):
  d_NxK = ((x_NxD[:, None, :] - c_KxD[None, :, :]) ** 2).sum(-1)
  return d_NxK.min(-1).mean()


# ----------------------------------------------------------------- k-means


def test_squared_distances_match_numpy():
  rng = np.random.default_rng(0)
  x_NxD = rng.standard_normal((50, 7)).astype(np.float32)
  c_KxD = rng.standard_normal((5, 7)).astype(np.float32)
  want = ((x_NxD[:, None] - c_KxD[None]) ** 2).sum(-1)
  got = np.asarray(km.squared_distances(x_NxD, c_KxD))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert (got >= 0).all()


def test_kmeans_plus_plus_picks_distinct_data_points():
  x_NxD, _ = _planted(1, 200, 8, 4)
  c_KxD = np.asarray(km.kmeans_plus_plus_init(jax.random.key(0), x_NxD, 16))
  assert c_KxD.shape == (16, 8)
  # Every centre is a data row, and all 16 rows are different.
  idx = [int(np.flatnonzero((x_NxD == c).all(1))[0]) for c in c_KxD]
  assert len(set(idx)) == 16


def test_kmeans_plus_plus_distinct_with_duplicates():
  # Only 3 distinct values but k = 5: D^2 weights hit 0, the uniform
  # fallback must still give distinct row indices (and cover all 3 values).
  x_NxD = np.repeat(np.eye(3, dtype=np.float32), 4, axis=0)
  c_KxD = np.asarray(km.kmeans_plus_plus_init(jax.random.key(3), x_NxD, 5))
  assert {tuple(r) for r in c_KxD} == {tuple(r) for r in np.eye(3)}


def test_kmeans_plus_plus_covers_planted_clusters():
  # With separation >> noise, D^2 sampling seeds one centre per cluster.
  x_NxD, labels_N = _planted(2, 400, 8, 4)
  for seed in range(3):
    c_KxD = np.asarray(
        km.kmeans_plus_plus_init(jax.random.key(seed), x_NxD, 4))
    rows = [int(np.flatnonzero((x_NxD == c).all(1))[0]) for c in c_KxD]
    assert sorted(labels_N[rows].tolist()) == [0, 1, 2, 3]


def test_kmeans_recovers_planted_clusters():
  x_NxD, labels_N = _planted(3, 400, 8, 4)
  res = km.kmeans(jax.random.key(0), x_NxD, 4)
  assert res.centroids_KxD.shape == (4, 8)
  assert res.assignments_N.shape == (400,)
  assert res.assignments_N.dtype == jnp.int32
  assert _same_partition(res.assignments_N, labels_N)
  # Inertia is the mean squared distance to the assigned centroid.
  c_KxD = np.asarray(res.centroids_KxD)
  want = ((x_NxD - c_KxD[np.asarray(res.assignments_N)]) ** 2).sum(-1).mean()
  np.testing.assert_allclose(float(res.inertia), want, rtol=1e-4)
  # ~ D * noise^2 = 8 * 0.25 for a correct clustering.
  assert float(res.inertia) < 3.0


def test_kmeans_not_worse_than_init_and_random():
  # Overlapping blobs so Lloyd actually has work to do.
  x_NxD, _ = _planted(4, 500, 6, 8, sep=1.0, noise=1.0)
  key = jax.random.key(7)
  seeded = km.kmeans(key, x_NxD, 8, num_iters=0)
  fitted = km.kmeans(key, x_NxD, 8, num_iters=30)
  assert float(fitted.inertia) <= float(seeded.inertia) + 1e-6
  assert float(fitted.inertia) < 0.97 * float(seeded.inertia)
  rng = np.random.default_rng(0)
  for _ in range(5):
    random_KxD = x_NxD[rng.choice(500, 8, replace=False)]
    assert float(fitted.inertia) <= _inertia(x_NxD, random_KxD) + 1e-6


def test_kmeans_restarts_keep_best():
  x_NxD, _ = _planted(5, 300, 4, 6, sep=1.5, noise=1.0)
  key = jax.random.key(11)
  best = km.kmeans(key, x_NxD, 6, num_iters=20, num_restarts=4)
  # The restarts use split(key, 4); each single run is one of them.
  centred_NxD = jnp.asarray(x_NxD) - x_NxD.mean(0, keepdims=True)
  singles = [
      float(km._lloyd(  # pylint: disable=protected-access
          centred_NxD, km.kmeans_plus_plus_init(k, centred_NxD, 6),
          20).inertia) for k in jax.random.split(key, 4)
  ]
  np.testing.assert_allclose(float(best.inertia), min(singles), rtol=1e-5)


def test_kmeans_deterministic_and_key_dependent():
  x_NxD, _ = _planted(6, 300, 5, 5, sep=1.0, noise=1.0)
  a = km.kmeans(jax.random.key(1), x_NxD, 5, num_iters=10)
  b = km.kmeans(jax.random.key(1), x_NxD, 5, num_iters=10)
  c = km.kmeans(jax.random.key(2), x_NxD, 5, num_iters=10)
  np.testing.assert_array_equal(a.centroids_KxD, b.centroids_KxD)
  np.testing.assert_array_equal(a.assignments_N, b.assignments_N)
  assert not np.array_equal(a.centroids_KxD, c.centroids_KxD)


def test_kmeans_empty_cluster_keeps_centroid():
  # 3 distinct values, k = 4: one seeded centre duplicates a value, so after
  # the first step one cluster is empty (argmin ties go to the lower index)
  # and must keep its seed instead of becoming NaN or zero.
  x_NxD = np.repeat(np.eye(3, dtype=np.float32) * 5, 10, axis=0)
  res = km.kmeans(jax.random.key(0), x_NxD, 4, num_iters=5)
  c_KxD = np.asarray(res.centroids_KxD)
  assert np.isfinite(c_KxD).all()
  # Each centroid sits on one of the 3 values (up to the rounding of the
  # internal centring), the duplicated one included.
  dist_Kx3 = ((c_KxD[:, None] - 5 * np.eye(3)[None]) ** 2).sum(-1)
  assert (dist_Kx3.min(1) < 1e-8).all()
  assert sorted(set(dist_Kx3.argmin(1).tolist())) == [0, 1, 2]
  assert float(res.inertia) < 1e-5


def test_kmeans_rejects_bad_k():
  with pytest.raises(ValueError, match="k must be"):
    km.kmeans(jax.random.key(0), np.zeros((3, 2), np.float32), 4)


# --------------------------------------------------------- product k-means


def test_feature_parts_matches_array_split():
  x_NxD = np.arange(3 * 11, dtype=np.float32).reshape(3, 11)
  for num_parts in (1, 2, 3, 4, 11):
    got = km.feature_parts(x_NxD, num_parts)
    want = np.array_split(x_NxD, num_parts, axis=1)
    assert len(got) == len(want)
    for g, w in zip(got, want):
      np.testing.assert_array_equal(g, w)


def test_product_kmeans_recovers_product_labelling():
  rng = np.random.default_rng(8)
  n = 600
  # Two halves carry independent planted clusterings (3 and 4 clusters).
  left_NxD, left_N = _planted(10, n, 5, 3)
  right_NxD, right_N = _planted(11, n, 5, 4)
  perm = rng.permutation(n)
  right_NxD, right_N = right_NxD[perm], right_N[perm]
  x_NxD = np.concatenate([left_NxD, right_NxD], axis=1)
  ks = (3, 4)
  cents = km.product_kmeans(jax.random.key(0), x_NxD, ks)
  assert [c.shape for c in cents] == [(3, 5), (4, 5)]
  paths_N = km.top_k_paths(km.path_distances(x_NxD, cents), 1)[:, 0]
  truth_N = np.ravel_multi_index((left_N, right_N), ks)
  assert _same_partition(paths_N, truth_N)
  assert len(set(np.asarray(paths_N).tolist())) == 12
  # Per level, the decoded ids match each half's planted labels.
  ids_NxL = np.asarray(km.path_to_level_ids(paths_N, ks))
  assert _same_partition(ids_NxL[:, 0], left_N)
  assert _same_partition(ids_NxL[:, 1], right_N)


def test_path_distances_match_brute_force():
  rng = np.random.default_rng(9)
  ks = (2, 3, 2)
  x_NxD = rng.standard_normal((20, 8)).astype(np.float32)
  parts = np.array_split(x_NxD, 3, axis=1)  # dims 3, 3, 2
  cents = [rng.standard_normal((k, p.shape[1])).astype(np.float32)
           for k, p in zip(ks, parts)]
  want_NxP = np.zeros((20, 12), np.float32)
  for ids in itertools.product(*[range(k) for k in ks]):
    p = np.ravel_multi_index(ids, ks)
    for part, c, i in zip(parts, cents, ids):
      want_NxP[:, p] += ((part - c[i]) ** 2).sum(-1)
  got_NxP = np.asarray(km.path_distances(x_NxD, cents))
  np.testing.assert_allclose(got_NxP, want_NxP, rtol=1e-5, atol=1e-5)
  # One level is the plain k-means distance.
  np.testing.assert_allclose(
      km.path_distances(x_NxD, [cents[0][:, :1].repeat(8, 1)]),
      km.squared_distances(x_NxD, cents[0][:, :1].repeat(8, 1)),
      rtol=1e-6)


def test_path_distances_rejects_wrong_part_dims():
  with pytest.raises(ValueError, match="feature part 1"):
    km.path_distances(np.zeros((4, 6), np.float32),
                      [np.zeros((2, 3)), np.zeros((2, 2))])


def test_top_k_paths_order():
  d_NxP = np.array([[3.0, 1.0, 2.0, 0.5],
                    [0.0, 5.0, 4.0, 1.0]], np.float32)
  got = np.asarray(km.top_k_paths(d_NxP, 2))
  assert got.dtype == np.int32
  np.testing.assert_array_equal(got, [[3, 1], [0, 3]])
  np.testing.assert_array_equal(km.top_k_paths(d_NxP, 1)[:, 0],
                                np.argmin(d_NxP, axis=1))
  np.testing.assert_array_equal(km.top_k_paths(d_NxP, 4),
                                np.argsort(d_NxP, axis=1))


def test_level_ids_round_trip_matches_numpy():
  for ks in [(4,), (2, 3), (3, 1, 4), (16, 16)]:
    p = int(np.prod(ks))
    paths = np.arange(p)
    ids_NxL = np.asarray(km.path_to_level_ids(paths, ks))
    want = np.stack(np.unravel_index(paths, ks), axis=-1)
    np.testing.assert_array_equal(ids_NxL, want)
    back = np.asarray(km.level_ids_to_path(ids_NxL, ks))
    np.testing.assert_array_equal(back, paths)
    np.testing.assert_array_equal(back, np.ravel_multi_index(want.T, ks))
  # Works on [N, k] path arrays too (top-2 routing output).
  ids = km.path_to_level_ids(np.array([[5, 0], [3, 4]]), (2, 3))
  assert ids.shape == (2, 2, 2)
  np.testing.assert_array_equal(ids[0, 0], [1, 2])


# ----------------------------------------------------------- discriminative


def test_best_path_labels_hand_made():
  nll_NxP = np.array([[5.0, 2.0, 3.0],
                      [1.0, 4.0, 1.5],
                      [9.0, 8.0, 7.0],
                      [2.0, 2.0, 3.0]], np.float32)  # tie -> lower index
  got = np.asarray(discriminative.best_path_labels(nll_NxP))
  assert got.dtype == np.int32
  np.testing.assert_array_equal(got, [1, 0, 2, 0])
  # Per-token NLL [N, P, T] is summed over tokens first.
  per_token = np.stack([nll_NxP - 1.0, np.ones_like(nll_NxP)], axis=-1)
  np.testing.assert_array_equal(
      discriminative.best_path_labels(per_token), [1, 0, 2, 0])


def test_linear_router_separable_accuracy():
  rng = np.random.default_rng(12)
  n, d, p = 800, 16, 6
  true_w_DxP = rng.standard_normal((d, p))
  # Features with a large offset and uneven scales: standardization matters.
  x_NxD = (rng.standard_normal((n, d)) * rng.uniform(0.1, 10, d)
           + 50.0).astype(np.float32)
  labels_N = np.argmax(((x_NxD - 50.0) / x_NxD.std(0)) @ true_w_DxP, axis=1)
  router = discriminative.fit_linear_router(
      jax.random.key(0), x_NxD, labels_N, num_paths=p)
  assert router.w_DxP.shape == (d, p) and router.b_P.shape == (p,)
  pred_N = np.asarray(discriminative.route_top_k(router, x_NxD, 1)[:, 0])
  assert (pred_N == labels_N).mean() > 0.95
  logits_NxP = np.asarray(discriminative.router_logits(router, x_NxD))
  np.testing.assert_array_equal(pred_N, logits_NxP.argmax(1))
  top2 = np.asarray(discriminative.route_top_k(router, x_NxD, 2))
  np.testing.assert_array_equal(top2, np.argsort(-logits_NxP, 1)[:, :2])


def test_linear_router_handles_unused_path_and_constant_feature():
  rng = np.random.default_rng(13)
  x_NxD = rng.standard_normal((200, 4)).astype(np.float32)
  x_NxD[:, 3] = 1.0  # zero variance
  labels_N = (x_NxD[:, 0] > 0).astype(np.int32)  # path 2 never labelled
  router = discriminative.fit_linear_router(
      jax.random.key(1), x_NxD, labels_N, num_paths=3, num_steps=200)
  assert all(np.isfinite(np.asarray(a)).all() for a in router)
  pred_N = np.asarray(discriminative.route_top_k(router, x_NxD, 1)[:, 0])
  assert (pred_N == labels_N).mean() > 0.95


def _shares(logits_NxP):
  p = logits_NxP.shape[1]
  return np.bincount(np.asarray(logits_NxP).argmax(1), minlength=p) / len(
      logits_NxP)


def test_calibrate_bias_uniform_target_from_skew():
  rng = np.random.default_rng(14)
  n, p = 4000, 5
  logits_NxP = rng.standard_normal((n, p)).astype(np.float32)
  logits_NxP[:, 0] += 2.0  # raw argmax sends ~80% to path 0
  raw = _shares(logits_NxP)
  assert raw[0] > 0.75
  target_P = np.full(p, 1.0 / p)
  bias_P = discriminative.calibrate_bias(logits_NxP, target_P)
  got = _shares(logits_NxP + np.asarray(bias_P))
  assert np.abs(got - target_P).max() < 0.03, got


def test_calibrate_bias_skewed_target_no_empty_path():
  rng = np.random.default_rng(15)
  n, p = 5000, 8
  logits_NxP = 2.0 * rng.standard_normal((n, p)).astype(np.float32)
  logits_NxP[:, :2] += 6.0  # paths 2.. get almost nothing raw
  assert _shares(logits_NxP)[2:].sum() < 0.03
  target_P = np.array([0.3, 0.2, 0.15, 0.1, 0.1, 0.1, 0.04, 0.01])
  bias_P = discriminative.calibrate_bias(logits_NxP, target_P)
  got = _shares(logits_NxP + np.asarray(bias_P))
  assert (got > 0).all()
  assert np.abs(got - target_P).max() < 0.03, got


def test_calibrated_router_via_replace():
  rng = np.random.default_rng(16)
  x_NxD = rng.standard_normal((1000, 6)).astype(np.float32)
  labels_N = np.where(x_NxD[:, 0] > -0.8, 0, 1 + (x_NxD[:, 1] > 0))
  router = discriminative.fit_linear_router(
      jax.random.key(2), x_NxD, labels_N, num_paths=3, num_steps=200)
  target_P = np.array([1 / 3, 1 / 3, 1 / 3])
  bias_P = discriminative.calibrate_bias(
      discriminative.router_logits(router, x_NxD), target_P)
  router = router._replace(b_P=router.b_P + bias_P)
  pred_N = np.asarray(discriminative.route_top_k(router, x_NxD, 1)[:, 0])
  got = np.bincount(pred_N, minlength=3) / len(pred_N)
  assert np.abs(got - target_P).max() < 0.03, got


def test_router_fit_save_load_and_top_k(tmp_path):
  from dipaco_jax.routing import router as router_lib  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  centers = rng.normal(size=(4, 6)) * 10
  x = np.concatenate([c + rng.normal(size=(50, 6)) for c in centers])
  x = x.astype(np.float32)
  gen = router_lib.fit_generative(0, x, (2, 2), "product_kmeans", 20)
  assert gen.kind == "product_kmeans" and len(gen.centroids) == 2
  top = gen.top_k(x, 2)
  assert top.shape == (200, 2) and (top[:, 0] != top[:, 1]).all()
  gen.save(tmp_path / "g.npz")
  loaded = router_lib.Router.load(tmp_path / "g.npz")
  np.testing.assert_array_equal(loaded.top_k(x, 2), top)
  assert loaded.sha256() == gen.sha256()
  # Discriminative: documents labelled by their lowest-NLL path.
  labels = np.repeat(np.arange(4), 50)
  nll = np.ones((200, 4)) + 5.0 * (labels[:, None] != np.arange(4))
  disc, info = router_lib.fit_discriminative(0, x, nll, (2, 2),
                                             num_steps=200)
  assert info["train_accuracy"] > 0.95
  np.testing.assert_allclose(info["label_shares"], [0.25] * 4)
  disc.save(tmp_path / "d.npz")
  again = router_lib.Router.load(tmp_path / "d.npz")
  np.testing.assert_array_equal(again.top_k(x, 1), disc.top_k(x, 1))
  assert (disc.top_k(x, 1)[:, 0] == labels).mean() > 0.95


def test_routing_in_bounded_blocks_equals_routing_at_once(monkeypatch):
  """k-means on a sample of the rows, scores and top-k a block at a time,
  prefix features a block of documents at a time: the memory of routing
  stays flat in the corpus, and a cap above the corpus changes nothing."""
  from dipaco_jax.data import token_store  # pylint: disable=g-import-not-at-top
  from dipaco_jax.routing import features as features_lib  # pylint: disable=g-import-not-at-top
  from dipaco_jax.routing import router as router_lib  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(1)
  centers = rng.normal(size=(4, 6)) * 10
  x = np.concatenate([c + rng.normal(size=(300, 6)) for c in centers])
  x = x.astype(np.float32)
  whole = router_lib.fit_generative(0, x, (2, 2), "product_kmeans", 20)
  capped = router_lib.fit_generative(0, x, (2, 2), "product_kmeans", 20,
                                     max_points=len(x))
  assert capped.sha256() == whole.sha256()  # A cap above N: the same fit.
  sample = router_lib.fit_sample(0, len(x), 500)
  assert len(sample) == 500 and np.all(np.diff(sample) > 0)
  np.testing.assert_array_equal(sample, router_lib.fit_sample(0, len(x), 500))
  sampled = router_lib.fit_generative(0, x, (2, 2), "product_kmeans", 20,
                                      max_points=500)
  assert sampled.sha256() == router_lib.fit_generative(
      0, x[sample], (2, 2), "product_kmeans", 20).sha256()
  # Four clear clusters: the sample finds the same ones (named otherwise).
  pairs = set(zip(sampled.top_k(x, 1)[:, 0].tolist(),
                  whole.top_k(x, 1)[:, 0].tolist()))
  assert len(pairs) == 4

  scores, top = whole.scores(x), whole.top_k(x, 2)
  monkeypatch.setattr(router_lib, "SCORE_BLOCK", 128)
  np.testing.assert_allclose(whole.scores(x), scores, rtol=1e-6, atol=1e-5)
  np.testing.assert_array_equal(whole.top_k(x, 2), top)

  lengths = rng.integers(1, 60, size=300)
  offsets = np.concatenate([[0], np.cumsum(lengths)])
  docs = token_store.TokenDocs(
      rng.integers(0, 50, size=offsets[-1]).astype(np.int32), offsets)
  params = {"embed_head": {"embedding": rng.normal(size=(50, 8)).astype(
      np.float32)}}
  at_once = features_lib.prefix_features(None, params, docs, 32,
                                         "token_embedding")
  monkeypatch.setattr(features_lib, "FEATURE_BLOCK_DOCS", 64)
  np.testing.assert_allclose(
      features_lib.prefix_features(None, params, docs, 32, "token_embedding"),
      at_once, rtol=1e-6)
