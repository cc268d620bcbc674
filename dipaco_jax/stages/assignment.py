"""Which documents each worker trains on: i.i.d. or k-means replica shards,
top-k path shards by a router, and the held-out router and early-stopping
documents."""

import math

import numpy as np

from dipaco_jax.routing import features as features_lib
from dipaco_jax.routing import router as router_lib
from dipaco_jax.stages import cache
from dipaco_jax.stages import feature_source as feature_source_lib


def iid_shards(doc_ids: np.ndarray, num_shards: int, seed: int) -> list:
  """Documents dealt round-robin after a seeded shuffle (DiLoCo i.i.d.)."""
  order = np.random.default_rng([seed, 7]).permutation(doc_ids)
  return [np.sort(order[w::num_shards]) for w in range(num_shards)]


def split_router_docs(num_docs: int, fraction: float, seed: int):
  """Training documents for paths, and a held-out set for the router."""
  order = np.random.default_rng([seed, 11]).permutation(num_docs)
  num_router = int(round(num_docs * fraction))
  return np.sort(order[num_router:]), np.sort(order[:num_router])


def replica_shards(config, data, workdir, topology, train_ids, base_exp,
                   base_params):
  """Shards of the workers of a single path: i.i.d., or k-means clusters
  (DiLoCo's non-i.i.d. setting, computed once and cached); returns them
  and the hash of what made them."""
  w = topology.num_workers
  if w == 1 or config.routing.replica_shards == "iid":
    return iid_shards(train_ids, w, config.seed), "iid"

  source = feature_source_lib.FeatureSource.of(config, data, base_exp,
                                               base_params)

  def cluster():
    docs = data.docs["train"].subset(train_ids)
    if source.base_params is not None:
      feats = feature_source_lib.features(config, docs, source)
    else:  # No base model: the initial embedding's prefix means.
      feats = features_lib.prefix_features(None, source.init_params, docs,
                                           config.data.prefix_len,
                                           "token_embedding")
    router = router_lib.fit_generative(config.seed, feats, (w,), "kmeans",
                                       config.routing.kmeans_iters)
    return {"assign": router.top_k(feats, 1)[:, 0],
            "router_sha256": np.array(router.sha256())}
  z = cache.cached_arrays(workdir / "router" / "replicas_{}.npz".format(
      cache.key(data.hashes, source.cache_key(config), config.seed,
                config.routing.features, config.data.prefix_len, w,
                config.routing.kmeans_iters, train_ids)), cluster)
  return ([train_ids[z["assign"] == k] for k in range(w)],
          str(z["router_sha256"]))


def path_shards(router, feats, doc_ids, top_k, num_paths, min_fraction):
  """Each document to its top-k paths; a path left with fewer than
  `min_fraction` x the mean shard size takes its best-scoring documents
  (product k-means can leave a cell of the grid nearly empty)."""
  scores_NxP = router.scores(feats)
  top = router.top_k(feats, top_k)
  member_NxP = np.zeros(scores_NxP.shape, bool)
  np.put_along_axis(member_NxP, top, True, axis=1)
  need = int(math.ceil(min_fraction * member_NxP.sum() / num_paths))
  topped_up = []
  for p in range(num_paths):
    if member_NxP[:, p].sum() < need:
      best = np.argsort(-scores_NxP[:, p], kind="stable")[:need]
      member_NxP[best, p] = True
      topped_up.append(p)
  if topped_up:
    print(f"[router] paths {topped_up} had under {need} documents; "
          "topped up with their best-scoring ones "
          "(config.routing.min_shard_fraction)", flush=True)
  return [doc_ids[member_NxP[:, p]] for p in range(num_paths)]


def holdout(shard_ids: list, fraction: float, seed: int):
  """Splits each shard into (train, held out) for per-path early stopping."""
  train, held = [], []
  for p, ids in enumerate(shard_ids):
    order = np.random.default_rng([seed, 13, p]).permutation(ids)
    n = max(1, int(round(len(ids) * fraction))) if fraction > 0 else 0
    held.append(np.sort(order[:n]))
    train.append(np.sort(order[n:]))
  return train, held
