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

This module runs the stages in order; their parts live in `stages/`.
"""

import functools
import time

from etils import epath
import jax
import numpy as np

from dipaco_jax import config_base
from dipaco_jax import paths as paths_lib
from dipaco_jax import report as report_lib
from dipaco_jax.data import prepare
from dipaco_jax.diloco import presets
from dipaco_jax.eval import early_stopping as early_stopping_lib
from dipaco_jax.model import bank as bank_lib
from dipaco_jax.parallel import multihost
from dipaco_jax.routing import router as router_lib
from dipaco_jax.routing import window_cv
from dipaco_jax.stages import assignment
from dipaco_jax.stages import cache
from dipaco_jax.stages import dense_scaling
from dipaco_jax.stages import evaluation
from dipaco_jax.stages import experiment as experiment_lib
from dipaco_jax.stages import feature_source as feature_source_lib
from dipaco_jax.stages import router_fit
from dipaco_jax.store import atomic
from dipaco_jax.store import lock as lock_lib
from dipaco_jax.train import checkpoint as ckpt_lib
from dipaco_jax.train import memory_estimate

# Used by main.py, tests and scripts under these names.
make_shards = cache.make_shards
training_hash = experiment_lib.training_hash
base_config_of = experiment_lib.base_config_of


def run(config, workdir: str, islands=None) -> dict:
  """The main job for any config, as the only job in `workdir`: process 0
  holds the workdir's lock throughout (store.lock), and the wall time of
  every invocation adds up in `{workdir}/wall_time.json`. With `islands`
  (`islands.launcher.IslandOptions`) its multi-worker runs train as
  separate processes exchanging modules through a store."""
  presets.apply(config)  # A no-op after check_config, which announced it.
  check_memory(config, islands)  # ConfigError: one line, before data.
  if islands is not None:
    from dipaco_jax.islands import launcher  # pylint: disable=g-import-not-at-top
    launcher.check_config(config, islands)
  lock = lock_lib.WorkdirLock(workdir)
  # The other processes wait for process 0's lock, and stop with it when
  # another job holds the workdir.
  multihost.first_on_writer(
      lambda: lock.acquire() if multihost.is_writer() else None,
      "workdir lock")
  t0, worked = time.time(), True
  try:
    if paths_lib.topology_from_config(config).num_paths > 1:
      return run_dipaco(config, workdir, islands)
    return run_single_path(config, workdir, islands)
  except ckpt_lib.CheckpointMismatchError:
    worked = False  # Refused: "Nothing was written" stays true.
    raise
  finally:
    if worked:  # A failed invocation worked on the workdir too.
      report_lib.add_wall_seconds(workdir, time.time() - t0)
    lock.release()


def check_config(config) -> None:
  """Validates the config and the runs derived from it, before compute;
  applies its `diloco.preset` and prints what it set and any warning."""
  presets.announce(config)
  devices = jax.device_count()
  config_base.validate(config, devices)
  derived = _derived_runs(config)
  if paths_lib.topology_from_config(config).num_paths == 1 and (
      config.eval.dense_scales.strip() or config.eval.dense_same_flops):
    field = ("dense_scales" if config.eval.dense_scales.strip()
             else "dense_same_flops")
    raise config_base.ConfigError(
        f"config.eval.{field}: the extra dense baselines are DiPaCo's (more "
        "than one path); leave eval.dense_scales and dense_same_flops off.")
  for name, cfg in derived:
    try:
      config_base.validate(cfg, devices)
    except config_base.ConfigError as e:
      raise config_base.ConfigError(
          f"{e} (in the {name} run derived from this config)") from e
  presets.warn(config)  # Once valid: the rules read the topology.


def _derived_runs(config) -> list:
  """(name, config) of the runs the job trains besides `config`'s own."""
  derived = []
  if config.base.num_steps > 0:
    derived.append(("base", experiment_lib.base_config_of(config)))
  if paths_lib.topology_from_config(config).num_paths > 1:
    derived.append(("dense baseline", experiment_lib.dense_config_of(config)))
    derived += [(s.name, s.config) for s in dense_scaling.specs(config)]
    if config.routing.discriminative_steps > 0:
      derived.append(("discriminative phase", experiment_lib.derive_config(
          config, **{"train.num_steps": config.routing.discriminative_steps})))
  return derived


def check_memory(config, islands=None) -> None:
  """Refuses a job whose training step surely does not fit this machine's
  memory (`train/memory_estimate.py`), before its data stage; `run` calls
  it. Apart from `check_config`, which validates a config anywhere (the
  GPU experiments on a CPU too).

  With `islands` its runs of several workers train as tasks of
  `paths_per_task` workers, in the `num_workers` local worker processes
  (each worker checks its own task at start, `islands/worker.py`); with
  none here they are not checked here."""
  runs = []
  for name, run_config in [("", config)] + _derived_runs(config):
    workers = paths_lib.topology_from_config(run_config).num_workers
    if islands is None or workers == 1:
      runs.append((name, run_config))
    elif islands.num_workers > 0:
      runs.append((name, run_config, islands.num_workers *
                   min(workers, islands.paths_per_task)))
  memory_estimate.check(runs)


def _prepare(config, workdir):
  """Checks, then the data stage, then config.json: a job refused (runs
  with checkpoints under other settings, a corpus without text) writes
  nothing, and config.json keeps naming the settings the runs have."""
  workdir = epath.Path(workdir)

  def check_then_prepare():
    experiment_lib.check_workdir(config, workdir)  # Reads only.
    data = prepare.prepare_data(config.data, str(workdir), config.seed)
    if multihost.is_writer():
      atomic.write_text(workdir / "config.json",
                        config.to_json_best_effort(indent=1))
    return data
  return workdir, multihost.first_on_writer(check_then_prepare, "data")


def _train_base(config, data, workdir, doc_ids):
  """Dense pretraining on `doc_ids`; returns (experiment, path params)."""
  base_cfg = experiment_lib.base_config_of(config)
  shard_dir, manifest = cache.make_shards(
      workdir, "base", data.docs["train"], [doc_ids],
      {**data.hashes, "router": "none"})
  exp = experiment_lib.Experiment(base_cfg, data, workdir, "base", shard_dir,
                                  manifest)
  result = exp.train()
  return exp, exp.path_params(result.state)


def _init_bank(base_exp, base_params, topology):
  """The base's parameters as the initial bank of `topology`, or None."""
  if base_params is None:
    return None
  return bank_lib.path_params_to_bank(base_params, base_exp.topology,
                                      topology)


def run_single_path(config, workdir, islands=None) -> dict:
  """Dense training, or DiLoCo over `paths.num_replicas` replicas."""
  t0 = time.time()
  workdir, data = _prepare(config, workdir)
  topology = paths_lib.topology_from_config(config)
  train_ids = np.arange(len(data.docs["train"]))
  base_exp, base_params = None, None
  if config.base.num_steps > 0:
    base_exp, base_params = _train_base(config, data, workdir, train_ids)
  shard_ids, router_hash = assignment.replica_shards(
      config, data, workdir, topology, train_ids, base_exp, base_params)
  shard_dir, manifest = cache.make_shards(
      workdir, "main", data.docs["train"], shard_ids,
      {**data.hashes, "router": router_hash})
  exp = experiment_lib.Experiment(config, data, workdir, "main", shard_dir,
                                  manifest)
  exp.islands = islands
  trained = experiment_lib.TrainedRun(exp, exp.train(
      _init_bank(base_exp, base_params, topology), init_from=base_exp))
  metrics = evaluation.score(data.docs["validation"], exp.model,
                             trained.path_params(), config)
  name = "dense" if topology.num_workers == 1 else (
      f"diloco x{topology.num_workers}")
  results = {
      "kind": "single_path",
      "prefix_len": config.data.prefix_len,
      "models": {name: metrics},
      "runs": [report_lib.train_summary(trained)],
      "data": report_lib.data_summary(data),
      "wall_seconds": report_lib.wall_seconds_before(workdir) + (
          time.time() - t0),
  }
  report_lib.write_results(workdir, results,
                           ["base", "main"] if base_exp else ["main"])
  return results


def _train_paths(config, data, workdir, name, router, feats, path_ids,
                 init_bank, init_from, holdout=None, islands=None
                 ) -> experiment_lib.TrainedPaths:
  """Top-k shards by `router`, training, and per-path early stopping on
  `holdout` = (document ids, their features), routed by the same router."""
  topology = paths_lib.topology_from_config(config)
  shard_ids = assignment.path_shards(
      router, feats, path_ids, config.routing.train_top_k,
      topology.num_paths, config.routing.min_shard_fraction)
  held = None
  if config.eval.early_stopping:
    held = assignment.holdout_per_path(
        router, holdout[1], holdout[0], topology.num_paths,
        config.routing.min_shard_fraction)
  empty = [p for p, ids in enumerate(shard_ids) if len(ids) == 0]
  if empty:
    raise ValueError(f"Paths {empty} got no training documents; use fewer "
                     "paths (config.paths.shape), more data, or a higher "
                     "config.routing.train_top_k.")
  shard_dir, manifest = cache.make_shards(
      workdir, name, data.docs["train"], shard_ids,
      {**data.hashes, "router": router.sha256()})
  exp = experiment_lib.Experiment(config, data, workdir, name, shard_dir,
                                  manifest)
  exp.islands = islands
  stopper, callbacks = None, ()
  if held is not None:
    if multihost.is_writer():  # Which documents each path stops on.
      atomic.write_json(shard_dir / "holdout.json", {
          "documents": holdout[0].tolist(),
          "per_path": [ids.tolist() for ids in held]}, indent=None)
    stopper = early_stopping_lib.EarlyStopping(
        exp.runtime, [data.docs["train"].subset(h) for h in held],
        exp.run_dir / "early_stopping", config.data.seq_len,
        config.data.prefix_len, config.train.eval_batch_size,
        every_rounds=config.eval.early_stopping_every,
        inner_steps=config.diloco.inner_steps,
        last_step=config.train.num_steps)
    callbacks = (stopper,)
  result = exp.train(init_bank, after_outer_step=callbacks,
                     init_from=init_from)
  return experiment_lib.TrainedPaths(exp, result, stopper)


def run_dipaco(config, workdir, islands=None) -> dict:
  """The DiPaCo pipeline (module docstring)."""
  t0 = time.time()
  workdir, data = _prepare(config, workdir)
  topology = paths_lib.topology_from_config(config)
  num_paths, ks = topology.num_paths, topology.level_sizes
  train_docs = data.docs["train"]
  # Router and early-stopping documents are held out by file, before any
  # path assignment; nothing below trains on them.
  split = assignment.split_documents(
      data.units["train"], config.routing.router_fraction,
      config.eval.holdout_fraction if config.eval.early_stopping else 0.0,
      config.seed)
  path_ids, router_ids = split.train_ids, split.router_ids
  if multihost.is_writer():
    atomic.write_json(workdir / "splits.json", split.to_json(), indent=None)

  # Base model, then routing features of every document's prefix (on the
  # shared initial embedding when there is no base).
  base_exp, base_params = None, None
  if config.base.num_steps > 0:
    base_exp, base_params = _train_base(config, data, workdir, path_ids)
  source = feature_source_lib.FeatureSource.of(config, data, base_exp,
                                               base_params)
  # Features and the router are cached under keys of everything they
  # depend on (the base run's hashes, the documents, the routing config).
  feats_key = cache.key(data.hashes, source.cache_key(config), config.seed,
                        config.routing.features, config.data.prefix_len,
                        path_ids, router_ids, split.holdout_ids)

  def compute_features():
    docs = {"paths": train_docs.subset(path_ids),
            "router": train_docs.subset(router_ids),
            "holdout": train_docs.subset(split.holdout_ids),
            "validation": data.docs["validation"]}
    return {name: feature_source_lib.features(config, d, source)
            for name, d in docs.items() if len(d)}
  feats = cache.cached_arrays(
      workdir / "router" / f"features_{feats_key}.npz", compute_features)
  holdout = (split.holdout_ids, feats.get("holdout"))
  def fit_generative():
    router = router_lib.fit_generative(config.seed, feats["paths"], ks,
                                       config.routing.method,
                                       config.routing.kmeans_iters,
                                       config.routing.kmeans_max_points)
    print(f"[router] {router.kind} {'x'.join(map(str, ks))} on "
          f"{len(path_ids):,} prefixes of {config.data.prefix_len} tokens",
          flush=True)
    return router, {}
  router, _ = cache.cached_router(
      workdir / "router" / "generative_{}.npz".format(cache.key(
          feats_key, config.routing.method, ks, config.routing.kmeans_iters,
          router_lib.fit_size(len(path_ids),
                              config.routing.kmeans_max_points))),
      fit_generative)

  trained = _train_paths(
      config, data, workdir, "dipaco", router, feats["paths"], path_ids,
      _init_bank(base_exp, base_params, topology), base_exp, holdout,
      islands)
  phases = [trained]

  disc_info = None
  if config.routing.discriminative_steps > 0:
    router, disc_info = cache.cached_router(
        workdir / "router" / "discriminative_{}.npz".format(cache.key(
            trained.experiment.hashes, router.sha256(), feats_key)),
        functools.partial(router_fit.discriminative, config, data, trained,
                          router, feats, router_ids))
    disc_cfg = experiment_lib.derive_config(config, **{
        "train.num_steps": config.routing.discriminative_steps})
    trained = _train_paths(
        disc_cfg, data, workdir, "dipaco_discriminative", router,
        feats["paths"], path_ids, jax.device_get(
            trained.experiment.eval_bank(trained.result.state)),
        trained.experiment, holdout, islands)
    phases.append(trained)

  # Dense baseline: the same base, the same steps and batch as one path.
  dense_cfg = experiment_lib.dense_config_of(config)
  shard_dir, manifest = cache.make_shards(workdir, "dense", train_docs,
                                          [path_ids], {**data.hashes,
                                                       "router": "none"})
  dense_exp = experiment_lib.Experiment(dense_cfg, data, workdir, "dense",
                                        shard_dir, manifest)
  dense_init = _init_bank(base_exp, base_params, dense_exp.topology)
  dense = experiment_lib.TrainedRun(dense_exp, dense_exp.train(
      dense_init, init_from=base_exp))
  # Optional larger / same-FLOPs dense models (config.eval.dense_*).
  extra = dense_scaling.train(config, data, workdir, dense, dense_init,
                              base_exp)

  window_router, window_info = None, None
  if config.eval.reroute_every > 0 and config.eval.learned_reroute:
    window_router, window_info = cache.cached_router(
        workdir / "router" / "window_{}.npz".format(cache.key(
            trained.experiment.hashes, router.sha256(), feats_key,
            config.eval.reroute_every, config.eval.window_router_objective,
            config.eval.early_stopping, config.eval.holdout_fraction,
            "inputs: both contexts",
            f"cv decision at {window_cv.MARGIN_STANDARD_ERRORS} SE",
            # A dump run refits, so that the router data gets written.
            config.eval.dump_reroute_data)),
        functools.partial(router_fit.fit_window_router, config, data,
                          trained, router, feats["router"], router_ids,
                          source))

  results = evaluation.evaluate_dipaco(config, data, trained, router,
                                       feats["validation"], source,
                                       window_router, dense)
  results["models"].update(dense_scaling.score(config, data, extra))
  results["compute"] = dense_scaling.compute(config, data, results["models"],
                                             trained, extra)
  results.update({
      "kind": "dipaco",
      "prefix_len": config.data.prefix_len,
      "router": {"kind": router.kind, "train_top_k": min(
          config.routing.train_top_k, num_paths),
                 "router_documents": int(len(router_ids)),
                 "discriminative": disc_info,
                 "window_router": window_info},
      "runs": [report_lib.train_summary(t)
               for t in phases + [dense] + extra],
      "data": report_lib.data_summary(data),
      "wall_seconds": report_lib.wall_seconds_before(workdir) + (
          time.time() - t0),
  })
  results["communication"] = {"bytes_outer_sync": sum(
      t.experiment.bytes_communicated() for t in phases)}
  runs = (["base"] if base_exp else []) + [
      t.experiment.name for t in phases] + ["dense"] + [
          r.experiment.name for r in extra]
  report_lib.write_results(workdir, results, runs, from_scratch=[
      r.experiment.name for r in extra if r.spec.role == "scaled"])
  return results
