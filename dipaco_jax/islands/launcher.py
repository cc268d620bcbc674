"""Runs one multi-worker training run of the main job through islands.

For an `Experiment` (its config, shards, hashes), the launcher writes the
run's spec and version 0 of every module into the store
(`{workdir}/islands/{run}`), starts the roles on this machine as OS
processes whose command lines name them (one coordinator, N workers, the
executors; `islands/roles.py`), restarts any that dies before the run is
done (a killed worker is back under its own id; the coordinator re-queues
its task if it stays away), and, once `DONE.json` is committed, reads the
final modules back as the run's result. Run again on the same store, it
finds what is committed and carries on.
"""

import dataclasses
import json
import time

from etils import epath
import flax.linen as nn
import jax
import numpy as np

from dipaco_jax import code_version as code_lib
from dipaco_jax import paths as paths_lib
from dipaco_jax.diloco import comm as comm_lib
from dipaco_jax.diloco import outer as outer_lib
from dipaco_jax.errors import UserError
from dipaco_jax.islands import eager as eager_lib
from dipaco_jax.islands import executor as executor_lib
from dipaco_jax.islands import layout
from dipaco_jax.islands import repair
from dipaco_jax.islands import replay
from dipaco_jax.islands import roles as roles_lib
from dipaco_jax.islands import run_stats
from dipaco_jax.islands import timeline
from dipaco_jax.islands import units as units_lib
from dipaco_jax.store import atomic
from dipaco_jax.store import integrity
from dipaco_jax.store import items
from dipaco_jax.train import loop


@dataclasses.dataclass(frozen=True)
class IslandOptions:
  num_workers: int = 2
  paths_per_task: int = 1
  num_executors: int = 0  # 0 = one per unit (units step in parallel), <= 8.
  fake_devices: int = 0  # Per worker process (CPU only).
  # Worker i sees only accelerator i % n (CUDA_VISIBLE_DEVICES; the i % n-th
  # of the launcher's own list when it has one) of n GPUs on this machine;
  # 0 = every worker sees every device.
  gpus_per_machine: int = 0
  heartbeat_s: float = 1.0
  lease_timeout_s: float = 20.0
  max_restarts: int = 20  # Per role, before the run is given up.
  slowdown_s: dict = dataclasses.field(default_factory=dict)  # id -> s
  link_mbps: float = 0.0  # Emulated link of every role (store/link.py).
  link_latency_ms: float = 0.0
  store_fsync: bool = False  # Sync local store writes (store/atomic.py).
  inner_state_every: int = 1  # Commit AdamW states every K rounds.
  # Each local worker's --download_cache_mb; None: the worker's default.
  download_cache_mb: float | None = None
  # The roles' output files; "": {store}/logs, or for a gs:// store a local
  # directory named after it (roles.log_dir).
  log_dir: str = ""


def write_version_zero(run, runtime, init_bank, seed: int) -> None:
  """Every unit at version 0 (the initial bank and a fresh outer
  optimizer state), unless already committed."""
  if init_bank is None:
    init_bank = runtime.init_bank(jax.random.key(seed))
  bank = jax.device_get(init_bank)
  outer = {"params": bank, "opt_state": jax.device_get(
      outer_lib.init_outer_opt_state(runtime.outer_tx, bank))}
  stages = units_lib.num_stages(runtime.config)
  for slot in runtime.topology.slots:
    keys = units_lib.keys_of_slot(slot, stages)
    for e in range(slot.num_experts):
      module = items.module_of(outer, slot.name, e)
      meta = {"round": -1, "users": []}
      for stage, key in enumerate(keys):
        items.save_tree(layout.outer_state_dir(run, key, e, 0),
                        units_lib.share(module["opt_state"], stage,
                                        len(keys)), meta)
        items.save_tree(layout.module_dir(run, key, e, 0),
                        units_lib.share(module["params"], stage, len(keys)),
                        meta)


def read_final_bank(run, runtime, version: int) -> dict:
  """The bank {slot: [K, ...]} of every module at `version`."""
  path = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                      nn.unbox(runtime.boxed_path_params()))
  bank = {}
  stages = units_lib.num_stages(runtime.config)
  for slot in runtime.topology.slots:
    keys = units_lib.keys_of_slot(slot, stages)
    like = units_lib.share_like(path[slot.name], len(keys))
    rows = [units_lib.join([
        items.load_tree(layout.module_dir(run, key, e, version), like)[0]
        for key in keys]) for e in range(slot.num_experts)]
    bank[slot.name] = jax.tree.map(lambda *x: np.stack(x), *rows)
  return bank


def read_verified_bank(run, spec: layout.RunSpec, runtime, log) -> dict:
  """The final bank, verified; a damaged final version is rebuilt here
  (`islands/repair.py`: the executors have stopped), or refused."""
  for _ in range(sum(s.num_experts for s in runtime.topology.slots) * 4):
    try:
      return read_final_bank(run, runtime, spec.num_rounds)
    except integrity.DamagedKeyError as e:
      repair.report(run, e, "launcher", log)
    repair.rebuild_versions(executor_lib.Executor(
        run, spec, executor_lib.all_units(spec), "executor-launcher", log),
                            executor_lib.module_likes(spec), "launcher")
    failed = layout.control_files(layout.control(run, "failed"))
    if failed:
      raise roles_lib.IslandError(layout.read_json(failed[0])["error"])
  raise roles_lib.IslandError(f"the final modules in {run} stay damaged; "
                              "use a fresh --workdir")


def check_spec(run, spec: layout.RunSpec) -> None:
  """A store made for other numbers, or committing inner states at
  another interval, is never continued."""
  old = layout.read_json(epath.Path(run) / "spec.json")
  layout.check_code((old or {}).get("code"), run)
  if old is not None and old["hashes"] != spec.hashes:
    raise roles_lib.IslandError(
        f"the island store {run} belongs to a different run (hashes "
        f"{old['hashes']} != {spec.hashes}); remove it or use a fresh "
        "--workdir")
  # Replays and garbage collection follow K: a store holds the inner
  # states and module versions its own K's replays need, no others.
  every = (old or {}).get("inner_state_every", 1)
  if old is not None and every != spec.inner_state_every:
    raise UserError(
        f"the island store {run} commits inner states every {every} "
        f"round(s); continue it with --inner_state_every={every}, or use a "
        "fresh --workdir")


def _write_metrics(run_dir, spec: layout.RunSpec, stats: dict
                   ) -> np.ndarray:
  """The per-round training loss (mean over workers, from the workers' task
  records) into the run's metrics.jsonl; returns the last round's losses
  [W]."""
  loss_RxW = np.full((spec.num_rounds, len(spec.weights_W)), np.nan)
  for t in stats["tasks"]:
    loss_RxW[t["round"], t["group"]] = t["losses"]
  rows = [{"step": (r + 1) * spec.inner_steps, "loss": float(np.mean(l_W))}
          for r, l_W in enumerate(loss_RxW)]
  path = epath.Path(run_dir) / "logs" / "train" / "metrics.jsonl"
  path.parent.mkdir(parents=True, exist_ok=True)
  atomic.write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
  return loss_RxW[-1]


def check_config(config, options: IslandOptions | None = None) -> None:
  """What islands cannot run yet, refused before any stage runs."""
  slots = paths_lib.topology_from_config(config).slots
  comms = comm_lib.comm_by_slot(config, slots).values()
  delays = {c.delay for c in comms}
  if delays & {"lookahead", "naive"} or len(delays) > 1:
    raise UserError(
        "config.diloco.delay/per_slot: islands apply one delay to every "
        "slot, none, one_round, overlap or eager; lookahead, naive and "
        "per-slot delays are simulated by dipaco_jax.main only.")
  eager_lib.check_config(config, delays)
  if any(c.spec.name == "lowrank_shared" for c in comms):
    raise UserError(
        "config.diloco.compression: lowrank_shared needs two exchanges "
        "inside a round, which islands do not make; use lowrank or topk, "
        "or run it with dipaco_jax.main.")
  if (getattr(config.diloco, "download_compression", "none") != "none"
      and units_lib.num_stages(config) > 1):
    raise UserError("config.diloco.download_compression: islands with "
                    "pipeline stages (config.pipeline.stages > 1) read "
                    "module versions in float32; set it to none or the "
                    "stages to 1.")
  units_lib.check_codecs(config)
  replay.check_options(options and options.inner_state_every)


def train_experiment(exp, options: IslandOptions, init_bank=None,
                     after_outer_step=()) -> loop.TrainResult:
  """Trains `exp` (a multi-worker `stages.experiment.Experiment`) through
  islands; returns what the SPMD loop would."""
  check_config(exp.config, options)
  if after_outer_step:
    raise roles_lib.IslandError(
        "config.eval.early_stopping: per-path early stopping is not "
        "available on islands yet; turn it off or use dipaco_jax.main")
  c = exp.config
  h = c.diloco.inner_steps
  if not h or c.train.num_steps % h:
    raise roles_lib.IslandError(
        f"config.train.num_steps ({c.train.num_steps}) must be a multiple "
        f"of config.diloco.inner_steps ({h}) on islands")
  run = epath.Path(exp.run_dir).parent.parent / "islands" / exp.name
  spec = layout.RunSpec(
      name=exp.name, config=layout.config_to_json_dict(c),
      vocab_size=exp.data.vocab_size, shard_dir=str(exp.shard_dir),
      data_seed=exp.data_seed, hashes=exp.hashes,
      weights_W=[float(w) for w in exp.runtime.outer_weights_W],
      paths_per_task=options.paths_per_task,
      heartbeat_s=options.heartbeat_s,
      lease_timeout_s=options.lease_timeout_s,
      link_mbps=options.link_mbps,
      link_latency_ms=options.link_latency_ms,
      inner_state_every=options.inner_state_every,
      store_fsync=options.store_fsync, code=code_lib.code_version())
  check_spec(run, spec)
  spec.use_store()  # Version zero is a store write too.
  log = lambda msg: print(f"[{exp.name}] islands: {msg}", flush=True)
  trained_path = run / "TRAINED.json"
  if not trained_path.exists():
    t0 = time.time()
    first = exp.topology.slots[0].name
    if repair.on_relaunch(run) or (
        layout.latest_module_version(run, first, 0) or 0) == 0:
      # Before any outer step (later, version 0 may be collected), or one
      # set aside as damaged: writes version 0's missing modules.
      write_version_zero(run, exp.runtime, init_bank, c.seed)
    spec.save(run)
    log(f"{len(spec.groups())} tasks per round x {spec.num_rounds} rounds, "
        f"{options.num_workers} workers; store {run}, role logs in "
        f"{roles_lib.log_dir(run, options)}")
    if not layout.is_done(run):
      num_units = sum(s.num_experts * units_lib.slot_stages(
          s, units_lib.num_stages(c)) for s in exp.topology.slots)
      roles_lib.supervise(run, roles_lib.make_roles(run, options, num_units),
                         options, log)
    atomic.write_json(trained_path, {"wall_s": time.time() - t0})
  else:
    log(f"already trained in {run}; reusing")
  wall_s = layout.read_json(trained_path)["wall_s"]
  done = layout.read_json(layout.done_path(run)) or {}
  log(f"tasks per worker: {done.get('tasks_done')}, "
      f"{done.get('requeued', 0)} re-queued")
  stats = run_stats.task_stats(run, spec)
  stats["mean_phases_s"] = timeline.mean_phases(run)
  stats["loop_store_ops"] = timeline.loop_ops(run)
  atomic.write_json(run / "stats.json", stats)
  plot_path = exp.run_dir.parent.parent / "plots" / f"islands_{exp.name}.png"
  timeline.plot(run, plot_path)
  if stats["mean_phases_s"]:
    log("mean task phases after round 0: " + ", ".join(
        f"{k} {v:.2f} s" for k, v in stats["mean_phases_s"].items())
        + f"; timeline {plot_path}")
  if stats["mean_outer_step_phases_s"]:
    log("mean outer step phases (per unit): " + ", ".join(
        f"{k} {v:.3f} s"
        for k, v in stats["mean_outer_step_phases_s"].items()))
  for what, key in (("a task after round 0", "mean_task_store_ops"),
                    ("an outer step", "mean_outer_step_store_ops")):
    if stats[key]:
      log(f"store operations of {what}: {sum(stats[key].values()):.1f} ("
          + ", ".join(f"{k} {v:.1f}" for k, v in stats[key].items()) + ")")
  if stats["loop_store_ops"]:
    log("store operations per polling iteration: " + ", ".join(
        f"{k} {v:.1f}" for k, v in stats["loop_store_ops"].items()))
  for worker, info in stats["workers"].items():
    peak = info["peak_device_bytes"]
    log(f"worker {worker}: {info['tasks']} tasks" + (
        f", peak device memory {peak / 2**30:.2f} GiB" if peak else ""))
  exp.store_bytes = run_stats.store_bytes(run)
  log(f"store traffic {exp.store_bytes['total'] / 1e6:,.1f} MB (written + "
      "read, all roles)")
  bank = read_verified_bank(run, spec, exp.runtime, log)
  losses_W = _write_metrics(exp.run_dir, spec, stats)
  tokens = (c.train.num_steps * exp.topology.num_workers
            * c.train.batch_size * c.data.seq_len)
  state = {"step": np.int32(c.train.num_steps),
           "outer": {"params": bank}, "inner": None}
  result = loop.TrainResult(state, c.train.num_steps, None,
                            tokens / max(wall_s, 1e-9), losses_W)
  return result
