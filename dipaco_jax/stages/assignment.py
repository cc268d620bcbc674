"""Which documents each worker trains on: i.i.d. or k-means replica shards,
top-k path shards by a router, and the held-out router and early-stopping
documents.

Held-out documents are drawn by *file* (the split unit of
`data.corpora.unit_of`, the unit that separates training from validation),
before any path assignment, and never trained on: not by a path, the base,
or the dense baselines.
"""

import dataclasses
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


@dataclasses.dataclass(frozen=True)
class DocumentSplit:
  """Training documents and the two held-out sets, as sorted indices into
  the training split. No two share a file."""
  train_ids: np.ndarray
  router_ids: np.ndarray  # For fitting routers (discriminative, window).
  holdout_ids: np.ndarray  # For per-path early stopping.

  def to_json(self) -> dict:
    return {name: getattr(self, name).tolist()
            for name in ("train_ids", "router_ids", "holdout_ids")}


def split_documents(units_N: np.ndarray, router_fraction: float,
                    holdout_fraction: float, seed: int) -> DocumentSplit:
  """Draws whole files, in a seeded order, into the router set until it
  holds `router_fraction` of the documents, then into the early-stopping
  holdout until it holds `holdout_fraction`; the rest trains."""
  units_N = np.asarray(units_N)
  num_docs = len(units_N)
  unique_U, docs_per_unit_U = np.unique(units_N, return_counts=True)
  order_U = np.random.default_rng([seed, 11]).permutation(len(unique_U))
  targets = [int(round(num_docs * router_fraction)),
             int(round(num_docs * holdout_fraction))]
  # Whole files, in the seeded order, fill the router set until it has its
  # share, then the holdout. Files are never cut, so a set may overshoot by
  # part of one file; a file that would take a set past twice its share
  # (one file of hundreds of chunks in a small corpus) is passed over and
  # trains.
  chosen, counts = ([], []), [0, 0]
  for u in order_U:
    for s, target in enumerate(targets):
      if counts[s] < target:
        if counts[s] + docs_per_unit_U[u] <= 2 * target:
          chosen[s].append(unique_U[u])
          counts[s] += docs_per_unit_U[u]
        break
    else:
      break
  for s, target in enumerate(targets):
    taken = set(chosen[0]) | set(chosen[1])
    if target and not chosen[s] and len(taken) < len(unique_U) - 1:
      # Every file was too big: the smallest one left, so the set exists.
      left_U = [u for u in np.argsort(docs_per_unit_U, kind="stable")
                if unique_U[u] not in taken]
      chosen[s].append(unique_U[left_U[0]])
  router_U, held_U = chosen
  ids = np.arange(num_docs)
  router = np.isin(units_N, router_U)
  held = np.isin(units_N, held_U)
  return DocumentSplit(ids[~router & ~held], ids[router], ids[held])


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
                                       config.routing.kmeans_iters,
                                       config.routing.kmeans_max_points)
    return {"assign": router.top_k(feats, 1)[:, 0],
            "router_sha256": np.array(router.sha256())}
  z = cache.cached_arrays(workdir / "router" / "replicas_{}.npz".format(
      cache.key(data.hashes, source.cache_key(config), config.seed,
                config.routing.features, config.data.prefix_len, w,
                config.routing.kmeans_iters, train_ids,
                router_lib.fit_size(len(train_ids),
                                    config.routing.kmeans_max_points))),
      cluster)
  return ([train_ids[z["assign"] == k] for k in range(w)],
          str(z["router_sha256"]))


def path_shards(router, feats, doc_ids, top_k, num_paths, min_fraction,
                what="training documents"):
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
    print(f"[router] paths {topped_up} had under {need} {what}; "
          "topped up with their best-scoring ones "
          "(config.routing.min_shard_fraction)", flush=True)
  return [doc_ids[member_NxP[:, p]] for p in range(num_paths)]


def holdout_per_path(router, feats, holdout_ids, num_paths, min_fraction):
  """Each early-stopping document to the path its router picks (as
  validation documents are routed), with the top-up of `path_shards` so
  that no path is left without one."""
  if not len(holdout_ids):
    raise ValueError("Per-path early stopping has no held-out documents; "
                     "raise config.eval.holdout_fraction or use more data.")
  return path_shards(router, feats, holdout_ids, 1, num_paths, min_fraction,
                     "early-stopping documents")
