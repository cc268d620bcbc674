"""The main job's stages, each cached in the workdir.

  data      corpus -> tokenizer -> token documents     {workdir}/data
  base      dense pretraining the paths fork from      {workdir}/runs/base
  router    prefix features -> (product) k-means       {workdir}/router
  shards    documents per worker + manifest            {workdir}/shards/NAME
  train     SPMD training, checkpoints, metrics        {workdir}/runs/NAME
  eval      routed / dense perplexity, same tokens     {workdir}/results.json
  report    table on stdout, plots                     {workdir}/plots

A finished stage is reused when the same workdir is run again; an
interrupted training run resumes from its latest checkpoint.

One path (dense, or DiLoCo with `paths.num_replicas` > 1) skips routing;
more paths run the DiPaCo pipeline: base -> router -> top-k shards -> paths
forked from the base -> (discriminative phase) -> routed evaluation against
the dense baseline continued from the same base for the same steps.
"""

import copy
import functools
import hashlib
import json
import math
import time
import zlib

from absl import logging
from etils import epath
import jax
import numpy as np

from dipaco_jax import config_base
from dipaco_jax import paths as paths_lib
from dipaco_jax import report as report_lib
from dipaco_jax.data import batches as batches_lib
from dipaco_jax.data import prepare
from dipaco_jax.data import shards as shards_lib
from dipaco_jax.eval import early_stopping as early_stopping_lib
from dipaco_jax.eval import routed
from dipaco_jax.model import bank as bank_lib
from dipaco_jax.model import layers
from dipaco_jax.parallel import mesh as mesh_lib
from dipaco_jax.parallel import multihost
from dipaco_jax.routing import features as features_lib
from dipaco_jax.routing import router as router_lib
from dipaco_jax.train import loop
from dipaco_jax.train import state as state_lib


def training_hash(config) -> str:
  """Hash of what determines the training numbers (not logging/ckpt)."""
  keep = config.to_dict()
  # Routing and evaluation reach training only through the shards, whose
  # own hashes are checked; `base` only through the base run's own config.
  for section in ("ckpt", "eval", "routing", "base"):
    keep.pop(section, None)
  keep["train"] = {k: v for k, v in keep["train"].items()
                   if k not in ("log_every", "eval_batch_size")}
  keep["data"] = {k: v for k, v in keep["data"].items() if k != "prefetch"}
  return hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()
                        ).hexdigest()[:16]


def derive_config(config, **overrides):
  """A copy of `config` with dotted-path overrides ('train.num_steps')."""
  out = copy.deepcopy(config)
  out.unlock()
  for dotted, value in overrides.items():
    section, key = dotted.split(".")
    out[section][key] = value
  return out


_DENSE = {"paths.shape": "1", "paths.num_replicas": 1,
          "paths.private_layers": "", "paths.layers_per_level": "",
          "paths.private_embedding": False, "diloco.inner_steps": 0}


def base_config_of(config):
  """The dense base run that paths (or replicas) fork from."""
  return derive_config(config, **_DENSE, **{
      "train.num_steps": config.base.num_steps,
      "train.batch_size": config.base.batch_size or config.train.batch_size})


def dense_config_of(config):
  """DiPaCo's dense baseline: one path's size, continued from the same
  base for the same steps and batch as each path."""
  return derive_config(config, **_DENSE, **{
      "train.num_steps": config.train.num_steps + max(
          config.routing.discriminative_steps, 0)})


def iid_shards(doc_ids: np.ndarray, num_shards: int, seed: int) -> list:
  """Documents dealt round-robin after a seeded shuffle (DiLoCo i.i.d.)."""
  order = np.random.default_rng([seed, 7]).permutation(doc_ids)
  return [np.sort(order[w::num_shards]) for w in range(num_shards)]


def make_shards(workdir, name, docs, doc_indices_per_shard, hashes):
  """Writes (or reuses) a shard set; returns its directory and manifest.

  Reused only when the same documents go to the same shards: the hashes
  include the document indices, not just where they came from.
  """
  ids = hashlib.sha256()
  for shard in doc_indices_per_shard:
    ids.update(np.asarray(shard, np.int64).tobytes() + b"|")
  hashes = {**hashes, "documents": ids.hexdigest()[:16]}
  directory = epath.Path(workdir) / "shards" / name

  def write_or_reuse():
    manifest = shards_lib.read_manifest(str(directory))
    if manifest is not None and manifest["hashes"] == hashes and (
        manifest["num_shards"] == len(doc_indices_per_shard)):
      return manifest
    return shards_lib.write_shards(str(directory), docs,
                                   doc_indices_per_shard, hashes)
  return directory, multihost.first_on_writer(write_or_reuse,
                                              f"shards {name}")


def _key(*parts) -> str:
  """A short hash of JSON-able parts and numpy arrays, for cache names."""
  h = hashlib.sha256()
  for part in parts:
    if isinstance(part, np.ndarray):
      h.update(np.ascontiguousarray(part).tobytes())
    else:
      h.update(json.dumps(part, sort_keys=True, default=str).encode())
    h.update(b"|")
  return h.hexdigest()[:16]


def _cached_arrays(path, compute) -> dict:
  """`compute()` (a dict of arrays), saved at `path` and loaded from it when
  present; written through a temporary file so a crash leaves no half."""
  path = epath.Path(path)

  def compute_or_load():
    if path.exists():
      with path.open("rb") as f:
        z = np.load(f)
        return {k: z[k] for k in z.files}
    arrays = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = epath.Path(str(path) + ".tmp")
    with tmp.open("wb") as f:
      np.savez(f, **arrays)
    tmp.replace(path)
    return arrays
  return multihost.first_on_writer(compute_or_load, f"arrays {path.name}")


def split_router_docs(num_docs: int, fraction: float, seed: int):
  """Training documents for paths, and a held-out set for the router."""
  order = np.random.default_rng([seed, 11]).permutation(num_docs)
  num_router = int(round(num_docs * fraction))
  return np.sort(order[num_router:]), np.sort(order[:num_router])


class Experiment:
  """One training run: a topology, its shards, its run directory."""

  def __init__(self, config, data: prepare.DataBundle, workdir, name: str,
               shard_dir, manifest: dict):
    self.config, self.data, self.name = config, data, name
    self.run_dir = epath.Path(workdir) / "runs" / name
    self.topology = paths_lib.topology_from_config(config)
    self.shard_dir, self.manifest = shard_dir, manifest
    if manifest["num_shards"] != self.topology.num_workers:
      raise ValueError(f"{name}: {manifest['num_shards']} shards for "
                       f"{self.topology.num_workers} workers.")
    self.weights_W = np.array([s["num_tokens"] for s in manifest["shards"]],
                              np.float64)
    self.dims = layers.dims_from_config(config.model, data.vocab_size)
    self.mesh = mesh_lib.make_mesh(config)
    self.runtime = state_lib.Runtime(config, self.topology, self.dims,
                                     self.mesh, self.weights_W)
    self.hashes = {"config": training_hash(config), **data.hashes,
                   **{f"shards_{k}": v for k, v in manifest["hashes"].items()
                      if k not in data.hashes}}
    # Each run reads its shards in its own order: a run forked from the
    # base must not replay the base's batches.
    self.data_seed = zlib.crc32(f"{config.seed}/{name}".encode())

  @property
  def model(self):
    return self.runtime.model

  def batches(self):
    rows = [batches_lib.pack_rows(
        shards_lib.load_shard(str(self.shard_dir), w),
        self.config.data.seq_len) for w in range(self.topology.num_workers)]
    return batches_lib.StackedBatches(rows, self.data_seed,
                                      self.config.train.batch_size)

  def train(self, init_bank=None, after_outer_step=(),
            init_from=None) -> loop.TrainResult:
    """Trains (or resumes); `init_from` is the experiment `init_bank` came
    from, whose hashes the checkpoints then carry too."""
    if init_from is not None:
      self.hashes["init"] = hashlib.sha256(json.dumps(
          init_from.hashes, sort_keys=True).encode()).hexdigest()[:16]
    print(f"[{self.name}] {self.topology.describe()}\n[{self.name}] mesh "
          f"{mesh_lib.describe(self.mesh)}", flush=True)
    return loop.train(self.runtime, self.batches(), str(self.run_dir),
                      self.hashes, self.name, init_bank=init_bank,
                      after_outer_step=after_outer_step)

  def eval_bank(self, state):
    """The modules to evaluate: the outer bank or, when workers never
    synchronize (dense, H = 0), the single worker's parameters."""
    if self.config.diloco.inner_steps:
      return state["outer_params"]
    return state["inner_params"]

  def host_bank(self, state):
    """`eval_bank` on the host (replicated over the mesh, so every process
    holds all of it): code that only process 0 runs must not index the
    global arrays, which would start a computation over every process."""
    return jax.device_get(self.eval_bank(state))

  def path_params(self, state, path: int = 0):
    return bank_lib.bank_path(self.host_bank(state), self.topology, path)

  def bytes_communicated(self) -> int:
    """Outer syncs x workers x (module deltas up + parameters down), f32."""
    h = self.config.diloco.inner_steps
    if not h or self.topology.num_workers == 1:
      return 0
    path_bytes = sum(int(np.prod(x.shape)) * 4 for x in jax.tree.leaves(
        self.runtime.abstract_state["inner_params"])) // (
            self.topology.num_workers)
    syncs = self.config.train.num_steps // h
    return 2 * syncs * self.topology.num_workers * path_bytes


def _score(layout, model, params, config) -> dict:
  nll = routed.token_nll(model, params, layout, config.train.eval_batch_size)
  return routed.summary(nll.sum(), layout.windows["weights"].sum())


def _prepare(config, workdir):
  workdir = epath.Path(workdir)
  if multihost.is_writer():
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(config.to_json_best_effort(indent=1))
  return workdir, multihost.first_on_writer(
      lambda: prepare.prepare_data(config.data, str(workdir), config.seed),
      "data")


def _train_base(config, data, workdir, doc_ids):
  """Dense pretraining on `doc_ids`; returns (experiment, path params)."""
  base_cfg = base_config_of(config)
  shard_dir, manifest = make_shards(workdir, "base", data.docs["train"],
                                    [doc_ids], {**data.hashes,
                                                "router": "none"})
  exp = Experiment(base_cfg, data, workdir, "base", shard_dir, manifest)
  result = exp.train()
  return exp, exp.path_params(result.state)


def run_single_path(config, workdir) -> dict:
  """Dense training, or DiLoCo over `paths.num_replicas` replicas."""
  t0 = time.time()
  workdir, data = _prepare(config, workdir)
  topology = paths_lib.topology_from_config(config)
  train_ids = np.arange(len(data.docs["train"]))
  init_bank, base_exp, base_params = None, None, None
  if config.base.num_steps > 0:
    base_exp, base_params = _train_base(config, data, workdir, train_ids)
    init_bank = bank_lib.path_params_to_bank(base_params, base_exp.topology,
                                             topology)
  shard_ids, router_hash = _replica_shards(
      config, data, workdir, topology, train_ids, base_exp, base_params)
  shard_dir, manifest = make_shards(workdir, "main", data.docs["train"],
                                    shard_ids, {**data.hashes,
                                                "router": router_hash})
  exp = Experiment(config, data, workdir, "main", shard_dir, manifest)
  result = exp.train(init_bank, init_from=base_exp)
  layout = routed.make_layout(data.docs["validation"], config.data.seq_len,
                              config.data.prefix_len)
  metrics = _score(layout, exp.model, exp.path_params(result.state), config)
  name = "dense" if topology.num_workers == 1 else (
      f"diloco x{topology.num_workers}")
  results = {
      "kind": "single_path",
      "prefix_len": config.data.prefix_len,
      "models": {name: metrics},
      "runs": [_train_summary(exp, result)],
      "data": _data_summary(data),
      "wall_seconds": time.time() - t0,
  }
  _write_results(workdir, results, ["base", "main"] if base_exp else ["main"])
  return results


def _replica_shards(config, data, workdir, topology, train_ids, base_exp,
                    base_params):
  """Shards of the workers of a single path: i.i.d., or k-means clusters
  (DiLoCo's non-i.i.d. setting, computed once and cached)."""
  w = topology.num_workers
  if w == 1 or config.routing.replica_shards == "iid":
    return iid_shards(train_ids, w, config.seed), "iid"

  init = None
  if base_params is None:  # No base model: the initial embedding's prefix
    # means (the initial bank is a global computation: every process).
    init = bank_lib.bank_path(jax.device_get(_fresh_bank(config, data)),
                              topology, 0)

  def cluster():
    docs = data.docs["train"].subset(train_ids)
    if base_params is not None:
      feats = _features(config, docs, base_exp, base_params)
    else:
      feats = features_lib.prefix_features(None, init, docs,
                                           config.data.prefix_len,
                                           "token_embedding")
    router = router_lib.fit_generative(config.seed, feats, (w,), "kmeans",
                                       config.routing.kmeans_iters)
    return {"assign": router.top_k(feats, 1)[:, 0],
            "router_sha256": np.array(router.sha256())}
  z = _cached_arrays(workdir / "router" / "replicas_{}.npz".format(_key(
      data.hashes, _feature_model_key(config, base_exp), config.seed,
      config.routing.features, config.data.prefix_len, w,
      config.routing.kmeans_iters, train_ids)), cluster)
  return ([train_ids[z["assign"] == k] for k in range(w)],
          str(z["router_sha256"]))


def _feature_model_key(config, base_exp):
  """What routing features depend on besides the documents: the base run,
  or (without one) the initial model, which the model config shapes."""
  if base_exp is not None:
    return base_exp.hashes
  return {"init": config.model.to_dict(), "seed": config.seed}


def _features(config, docs, base_exp, base_params, init_params=None):
  """Prefix features from the base model (or token embeddings)."""
  if config.routing.features == "base_hidden":
    return features_lib.prefix_features(
        base_exp.model, base_params, docs, config.data.prefix_len,
        "base_hidden", config.train.eval_batch_size)
  params = base_params if base_params is not None else init_params
  return features_lib.prefix_features(None, params, docs,
                                      config.data.prefix_len,
                                      "token_embedding")


def _path_shards(router, feats, doc_ids, top_k, num_paths, min_fraction):
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


def _holdout(shard_ids: list, fraction: float, seed: int):
  """Splits each shard into (train, held out) for per-path early stopping."""
  train, held = [], []
  for p, ids in enumerate(shard_ids):
    order = np.random.default_rng([seed, 13, p]).permutation(ids)
    n = max(1, int(round(len(ids) * fraction))) if fraction > 0 else 0
    held.append(np.sort(order[:n]))
    train.append(np.sort(order[n:]))
  return train, held


def run_dipaco(config, workdir) -> dict:
  """The DiPaCo pipeline (module docstring)."""
  t0 = time.time()
  workdir, data = _prepare(config, workdir)
  topology = paths_lib.topology_from_config(config)
  num_paths, ks = topology.num_paths, topology.level_sizes
  train_docs = data.docs["train"]
  path_ids, router_ids = split_router_docs(
      len(train_docs), config.routing.router_fraction, config.seed)

  # Base model, then routing features of every document's prefix.
  base_exp, base_params = None, None
  if config.base.num_steps > 0:
    base_exp, base_params = _train_base(config, data, workdir, path_ids)
  init_params = None
  if base_params is None:  # Route on the (shared) initial embedding.
    init_params = bank_lib.bank_path(
        jax.device_get(_fresh_bank(config, data)), topology, 0)
  # Features and the router are cached under keys of everything they
  # depend on (the base run's hashes, the documents, the routing config).
  feats_key = _key(data.hashes, _feature_model_key(config, base_exp),
                   config.seed, config.routing.features,
                   config.data.prefix_len, path_ids, router_ids)
  feats = _cached_arrays(
      workdir / "router" / f"features_{feats_key}.npz",
      lambda: {name: _features(config, docs, base_exp, base_params,
                               init_params)
               for name, docs in (("paths", train_docs.subset(path_ids)),
                                  ("router", train_docs.subset(router_ids)),
                                  ("validation", data.docs["validation"]))})
  def fit_generative():
    router = router_lib.fit_generative(config.seed, feats["paths"], ks,
                                       config.routing.method,
                                       config.routing.kmeans_iters)
    print(f"[router] {router.kind} {'x'.join(map(str, ks))} on "
          f"{len(path_ids):,} prefixes of {config.data.prefix_len} tokens",
          flush=True)
    return router, {}
  router, _ = _cached_router(
      workdir / "router" / "generative_{}.npz".format(_key(
          feats_key, config.routing.method, ks, config.routing.kmeans_iters)),
      fit_generative)

  init_bank = (bank_lib.path_params_to_bank(base_params, base_exp.topology,
                                            topology)
               if base_params is not None else None)
  exp, result, stopper = _train_paths(
      config, data, workdir, "dipaco", router, feats["paths"], path_ids,
      init_bank, base_exp)
  phases = [(exp, result)]

  disc_info = None
  if config.routing.discriminative_steps > 0:
    router, disc_info = _cached_router(
        workdir / "router" / "discriminative_{}.npz".format(_key(
            exp.hashes, router.sha256(), feats_key)),
        functools.partial(_discriminative, config, data, exp, result,
                          stopper, router, feats, router_ids))
    disc_cfg = derive_config(config, **{
        "train.num_steps": config.routing.discriminative_steps})
    exp, result, stopper = _train_paths(
        disc_cfg, data, workdir, "dipaco_discriminative", router,
        feats["paths"], path_ids, jax.device_get(exp.eval_bank(result.state)),
        exp)
    phases.append((exp, result))

  # Dense baseline: the same base, the same steps and batch as one path.
  dense_cfg = dense_config_of(config)
  shard_dir, manifest = make_shards(workdir, "dense", train_docs, [path_ids],
                                    {**data.hashes, "router": "none"})
  dense_exp = Experiment(dense_cfg, data, workdir, "dense", shard_dir,
                         manifest)
  dense_init = (bank_lib.path_params_to_bank(base_params, base_exp.topology,
                                             dense_exp.topology)
                if base_params is not None else None)
  dense_result = dense_exp.train(dense_init, init_from=base_exp)

  feature_source = (base_exp, base_params, init_params)
  window_router, window_info = None, None
  if config.eval.reroute_every > 0 and config.eval.learned_reroute:
    window_router, window_info = _cached_router(
        workdir / "router" / "window_{}.npz".format(_key(
            exp.hashes, router.sha256(), feats_key, config.eval.reroute_every,
            config.eval.window_router_objective, config.eval.early_stopping,
            config.eval.holdout_fraction, "inputs: both contexts",
            # A dump run refits, so that the router data gets written.
            config.eval.dump_reroute_data)),
        functools.partial(_fit_window_router, config, data, exp, result,
                          stopper, router, feats["router"], router_ids,
                          feature_source))

  results = _evaluate_dipaco(config, data, exp, result, stopper, router,
                             feats["validation"], feature_source,
                             window_router, dense_exp, dense_result)
  results.update({
      "kind": "dipaco",
      "prefix_len": config.data.prefix_len,
      "router": {"kind": router.kind, "train_top_k": min(
          config.routing.train_top_k, num_paths),
                 "router_documents": int(len(router_ids)),
                 "discriminative": disc_info,
                 "window_router": window_info},
      "runs": [_train_summary(e, r) for e, r in phases] + [
          _train_summary(dense_exp, dense_result)],
      "data": _data_summary(data),
      "wall_seconds": time.time() - t0,
  })
  results["communication"] = {"bytes_outer_sync": sum(
      e.bytes_communicated() for e, _ in phases)}
  runs = (["base"] if base_exp else []) + [e.name for e, _ in phases] + [
      "dense"]
  _write_results(workdir, results, runs)
  return results


def _cached_router(path, fit):
  """The router (and its info dict) saved at `path`, or `fit()`'s, saved."""
  info_path = epath.Path(str(path).replace(".npz", ".json"))

  def fit_or_load():
    if path.exists() and info_path.exists():
      print(f"[router] reusing {path}", flush=True)
      return router_lib.Router.load(path), json.loads(info_path.read_text())
    router, info = fit()
    router.save(path)
    info_path.write_text(json.dumps(info))
    return router, info
  return multihost.first_on_writer(fit_or_load, f"router {path.name}")


def _fresh_bank(config, data):
  """The initial (random) module bank, for routing without a base."""
  topology = paths_lib.topology_from_config(config)
  runtime = state_lib.Runtime(config, topology, layers.dims_from_config(
      config.model, data.vocab_size), mesh_lib.make_mesh(config),
                              np.ones(topology.num_workers))
  return runtime.init_state(jax.random.key(config.seed))["outer_params"]


def _train_paths(config, data, workdir, name, router, feats, path_ids,
                 init_bank, init_from):
  """Top-k shards by `router`, optional early-stopping holdout, training."""
  topology = paths_lib.topology_from_config(config)
  shard_ids = _path_shards(router, feats, path_ids,
                           config.routing.train_top_k, topology.num_paths,
                           config.routing.min_shard_fraction)
  held = None
  if config.eval.early_stopping:
    shard_ids, held = _holdout(shard_ids, config.eval.holdout_fraction,
                               config.seed)
  empty = [p for p, ids in enumerate(shard_ids) if len(ids) == 0]
  if empty:
    raise ValueError(f"Paths {empty} got no training documents; use fewer "
                     "paths (config.paths.shape), more data, or a higher "
                     "config.routing.train_top_k.")
  shard_dir, manifest = make_shards(workdir, name, data.docs["train"],
                                    shard_ids, {**data.hashes,
                                                "router": router.sha256()})
  exp = Experiment(config, data, workdir, name, shard_dir, manifest)
  stopper, callbacks = None, ()
  if held is not None:
    stopper = early_stopping_lib.EarlyStopping(
        exp.runtime, [data.docs["train"].subset(h) for h in held],
        exp.run_dir / "early_stopping", config.data.seq_len,
        config.data.prefix_len, config.train.eval_batch_size)
    callbacks = (stopper,)
  result = exp.train(init_bank, after_outer_step=callbacks,
                     init_from=init_from)
  return exp, result, stopper


def _path_params_for_eval(exp, bank, stopper, path):
  params = bank_lib.bank_path(bank, exp.topology, path)
  if stopper is not None and str(path) in stopper.best:
    return stopper.best_params(path, params)
  return params


def _score_paths(exp, state, stopper, layout, config, on_path):
  """Scores `layout` under every path, one path at a time, so memory stays
  at one path's [windows, L] NLLs: calls `on_path(p, nll_MxL)`."""
  bank = exp.host_bank(state)
  for p in range(exp.topology.num_paths):
    on_path(p, routed.token_nll(
        exp.model, _path_params_for_eval(exp, bank, stopper, p), layout,
        config.train.eval_batch_size))


def _per_doc_nll(layout, nll_MxL):
  return np.bincount(layout.windows["doc_index"], weights=nll_MxL.sum(1),
                     minlength=layout.num_docs)


def _discriminative(config, data, exp, result, stopper, router, feats,
                    router_ids):
  """Score router documents under every path, fit the linear router."""
  docs = data.docs["train"].subset(router_ids)
  layout = routed.make_layout(docs, config.data.seq_len,
                              config.data.prefix_len)
  nll_NxP = np.zeros((len(docs), exp.topology.num_paths))

  def on_path(p, nll_MxL):
    nll_NxP[:, p] = _per_doc_nll(layout, nll_MxL)

  _score_paths(exp, result.state, stopper, layout, config, on_path)
  doc_M = layout.windows["doc_index"]
  scored = layout.windows["weights"].sum(1)
  keep = np.bincount(doc_M, weights=scored, minlength=len(docs)) > 0
  disc, info = router_lib.fit_discriminative(
      config.seed, feats["router"][keep], nll_NxP[keep],
      exp.topology.level_sizes)
  before = router.top_k(feats["router"][keep], 1)[:, 0]
  info["agreement_with_generative"] = float(np.mean(
      before == disc.top_k(feats["router"][keep], 1)[:, 0]))
  print(f"[router] discriminative: fit on {int(keep.sum())} router docs, "
        f"train accuracy {info['train_accuracy']:.2f}", flush=True)
  return disc, info


def _group_sums_fn(config, layout, feature_source):
  """Routing-feature sums over groups of `layout`'s input positions, from
  the base model (or the initial embedding when there is no base)."""
  base_exp, base_params, init_params = feature_source
  model = base_exp.model if base_exp is not None else None
  params = base_params if base_params is not None else init_params

  def group_sums(group_MxL, num_groups):
    return features_lib.group_feature_sums(
        model, params, layout.windows["inputs"], group_MxL, num_groups,
        config.routing.features, config.train.eval_batch_size)
  return group_sums


def _dump_reroute_data(exp, split, chunks, doc_paths, nll_NxCxP, layout):
  """`eval.dump_reroute_data`: the chunk features and per-path chunk NLLs of
  a split, to study re-routers offline (bench/window_router_study.py)."""
  path = exp.run_dir.parent.parent / "router" / f"reroute_data_{split}.npz"
  if not multihost.is_writer():
    return
  with path.open("wb") as f:
    np.savez(f, sums_NxGxD=chunks.sums_NxGxD, counts_NxG=chunks.counts_NxG,
             prefix_len=chunks.prefix_len, every=chunks.every,
             num_chunks=chunks.num_chunks, doc_paths_N=doc_paths,
             nll_NxCxP=nll_NxCxP, scored_NxC=routed.chunk_nll(
                 layout, chunks, layout.windows["weights"]))
  print(f"[router] wrote {path}", flush=True)


def _fit_window_router(config, data, exp, result, stopper, doc_router,
                       router_feats, router_ids, feature_source):
  """The learned re-router: the paper's test-time router is a transformer
  trained on "the best path over the next window"; ours is the same target
  with a linear router (`routed.window_router_features`: the base feature of
  everything read so far and of the previous chunk), fit on the held-out
  router documents, never on validation."""
  every, num_paths = config.eval.reroute_every, exp.topology.num_paths
  docs = data.docs["train"].subset(router_ids)
  layout = routed.make_layout(docs, config.data.seq_len,
                              config.data.prefix_len)
  chunks = routed.chunk_features(layout, config.data.prefix_len, every,
                                 _group_sums_fn(config, layout,
                                                feature_source))
  doc_paths = doc_router.top_k(router_feats, 1)[:, 0]
  nll_NxCxP = np.zeros((len(docs), chunks.num_chunks, num_paths))

  def on_path(p, nll_MxL):
    nll_NxCxP[:, :, p] = routed.chunk_nll(layout, chunks, nll_MxL)

  _score_paths(exp, result.state, stopper, layout, config, on_path)
  if config.eval.dump_reroute_data:
    _dump_reroute_data(exp, "router", chunks, doc_paths, nll_NxCxP, layout)
  inputs, nll_XxP, tokens_X, prefix_paths, _ = routed.window_router_examples(
      chunks, doc_paths, nll_NxCxP,
      routed.chunk_nll(layout, chunks, layout.windows["weights"]))
  window_router, info = router_lib.fit_window_router(
      config.seed, inputs, nll_XxP, tokens_X, exp.topology.level_sizes,
      config.eval.window_router_objective)
  labels = nll_XxP.argmin(1)
  info.update({"router_documents": len(docs), "chunks": len(labels),
               "every": every,
               "prefix_path_accuracy": float(np.mean(prefix_paths == labels))})
  print(f"[router] window router: fit on {info['chunks']:,} chunks of "
        f"{every} tokens from {len(docs):,} router docs; best path found "
        f"{info['train_accuracy']:.2f} (prefix path "
        f"{info['prefix_path_accuracy']:.2f})", flush=True)
  return window_router, info


def _evaluate_dipaco(config, data, exp, result, stopper, router, val_feats,
                     feature_source, window_router, dense_exp,
                     dense_result) -> dict:
  """Routed perplexity (once per document, re-routed, oracle) and the dense
  baseline, all on exactly the same tokens."""
  val = data.docs["validation"]
  layout = routed.make_layout(val, config.data.seq_len,
                              config.data.prefix_len)
  count = layout.windows["weights"].sum()
  doc_M = layout.windows["doc_index"]
  doc_paths = router.top_k(val_feats, 1)[:, 0]
  # Which path scores each token, per routing scheme; then one pass over
  # the paths adds up the tokens each scheme gave to that path.
  routes = {"dipaco routed once per document":
            routed.route_once(layout, doc_paths)}
  every = config.eval.reroute_every
  if every > 0:
    chunks = routed.chunk_features(layout, config.data.prefix_len, every,
                                   _group_sums_fn(config, layout,
                                                  feature_source))
    route = lambda f: router.top_k(f, 1)[:, 0]
    for context, label in (("previous_chunk", "the previous chunk"),
                           ("cumulative", "all tokens so far")):
      routes[f"dipaco re-routed every {every} tokens ({label})"] = (
          routed.route_by_features(layout, chunks, doc_paths, route,
                                   chunks.features(context)))
    if window_router is not None:
      routes[f"dipaco re-routed every {every} tokens (learned window "
             "router)"] = routed.route_by_features(
                 layout, chunks, doc_paths,
                 lambda f: window_router.top_k(f, 1)[:, 0],
                 routed.window_router_features(chunks, doc_paths,
                                               exp.topology.num_paths))
  totals = routed.RoutedTotals(routes)
  num_paths = exp.topology.num_paths
  per_doc_PxN = np.zeros((num_paths, len(val)))
  own_nll_P = np.zeros(num_paths)
  # Per chunk: the best path's NLL (an oracle bound for re-routing), and
  # every path's when the data is dumped for study.
  best_chunk_NxC = np.full((len(val), chunks.num_chunks), np.inf) if (
      every > 0) else None
  dump = every > 0 and config.eval.dump_reroute_data
  chunk_NxCxP = np.zeros(best_chunk_NxC.shape + (num_paths,)) if dump else None

  def on_path(p, nll_MxL):
    totals.add(p, nll_MxL)
    per_doc_PxN[p] = _per_doc_nll(layout, nll_MxL)
    own_nll_P[p] = per_doc_PxN[p][doc_paths == p].sum()
    if every > 0:
      nll_NxC = routed.chunk_nll(layout, chunks, nll_MxL)
      np.minimum(best_chunk_NxC, nll_NxC, out=best_chunk_NxC)
      if dump:
        chunk_NxCxP[:, :, p] = nll_NxC

  _score_paths(exp, result.state, stopper, layout, config, on_path)
  if dump:
    _dump_reroute_data(exp, "validation", chunks, doc_paths, chunk_NxCxP,
                       layout)
  out = {"models": {name: routed.summary(nll, count)
                    for name, nll in totals.nll.items()}}
  out["models"]["dipaco best path per document (oracle)"] = routed.summary(
      per_doc_PxN.min(0).sum(), count)
  if every > 0:
    out["models"][f"dipaco best path per {every}-token chunk (oracle)"] = (
        routed.summary(best_chunk_NxC.sum(), count))
  dense_nll = routed.token_nll(dense_exp.model,
                               dense_exp.path_params(dense_result.state),
                               layout, config.train.eval_batch_size)
  out["models"]["dense baseline (one path's size)"] = routed.summary(
      dense_nll.sum(), count)
  tokens_N = np.bincount(doc_M, weights=layout.windows["weights"].sum(1),
                         minlength=len(val))
  dense_N = _per_doc_nll(layout, dense_nll)
  out["paths"] = []
  for p in range(exp.topology.num_paths):
    mine = doc_paths == p
    out["paths"].append({
        "path": p, "level_ids": list(exp.topology.path_level_ids(p)),
        "train_documents": exp.manifest["shards"][p]["num_documents"],
        "train_tokens": exp.manifest["shards"][p]["num_tokens"],
        "validation_documents": int(mine.sum()),
        "validation_tokens": int(tokens_N[mine].sum()),
        "validation": routed.summary(own_nll_P[p], tokens_N[mine].sum()),
        "validation_dense": routed.summary(dense_N[mine].sum(),
                                           tokens_N[mine].sum()),
        "early_stopping_step": (stopper.best.get(str(p), {}).get("step")
                                if stopper else None)})
  return out


def _train_summary(exp, result) -> dict:
  return {"name": exp.name, "workers": exp.topology.num_workers,
          "steps": result.steps, "tokens_per_s": result.tokens_per_s,
          "resumed_from": result.resumed_from,
          "bytes_communicated": exp.bytes_communicated(),
          "final_loss": float(np.mean(result.final_losses_W))
          if result.final_losses_W.size else None}


def _data_summary(data) -> dict:
  return {s: {"documents": len(d), "tokens": d.num_tokens}
          for s, d in data.docs.items()}


def _write_results(workdir, results, runs) -> None:
  if not multihost.is_writer():
    return
  (workdir / "results.json").write_text(json.dumps(results, indent=1))
  plots = [report_lib.plot_losses(workdir, runs)]
  if results.get("paths"):
    plots.append(report_lib.plot_paths(workdir, results))
  print(report_lib.final_table(results), flush=True)
  for p in plots:
    if p:
      print(f"plot: {p}")
  print(f"results: {workdir / 'results.json'}", flush=True)
  logging.info("Wrote %s", workdir / "results.json")


def run(config, workdir: str) -> dict:
  """The main job for any config."""
  if paths_lib.topology_from_config(config).num_paths > 1:
    return run_dipaco(config, workdir)
  return run_single_path(config, workdir)


def check_config(config) -> None:
  """Validates the config and the runs derived from it, before compute."""
  devices = jax.device_count()
  config_base.validate(config, devices)
  derived = []
  if config.base.num_steps > 0:
    derived.append(("base", base_config_of(config)))
  if paths_lib.topology_from_config(config).num_paths > 1:
    derived.append(("dense baseline", dense_config_of(config)))
    if config.routing.discriminative_steps > 0:
      if config.routing.router_fraction <= 0:
        raise config_base.ConfigError(
            "config.routing.router_fraction: the discriminative phase needs "
            "held-out router documents; set it > 0 (the paper: 0.005).")
      derived.append(("discriminative phase", derive_config(config, **{
          "train.num_steps": config.routing.discriminative_steps})))
  for name, cfg in derived:
    try:
      config_base.validate(cfg, devices)
    except config_base.ConfigError as e:
      raise config_base.ConfigError(
          f"{e} (in the {name} run derived from this config)") from e
