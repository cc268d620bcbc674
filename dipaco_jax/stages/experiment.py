"""What one training run is: its config (and the runs derived from it),
its shards and run directory, the hashes its checkpoints carry, and what
it returns once trained.

When a run directory already has checkpoints (the rule, for a user who
runs the same workdir again):

* Same training settings and same inputs: training resumes (or the
  finished run is reused).
* An input changed (the corpus, the tokenizer, the documents or router of
  its shards, the run it starts from): the run is recomputed, as every
  cached stage is. Its old directory is moved aside to
  `runs/NAME.stale-<hash>` (not deleted: it may have cost hours; delete it
  when not needed) and the run trains from the start.
* A training setting of the run changed (`training_fields`: the model,
  optimizers, steps, batch, seed, ...; not logging, checkpointing, routing
  or evaluation, and for the 1-worker base and dense runs not the outer
  optimizer they never use): the job is refused by `check_workdir` before
  it writes anything (config.json, data/, shards/), naming the fields that
  changed. Continuing a run under other settings would mix two runs, and
  retraining silently would discard what the user may have meant to
  extend; a fresh --workdir, the old values, or deleting the run dir are
  each one step away.

The settings a workdir's runs were trained with are those of its
`config.json`, written by the last job that passed the check.
"""

import dataclasses
import hashlib
import json
import zlib

from etils import epath
import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from dipaco_jax import paths as paths_lib
from dipaco_jax.data import batches as batches_lib
from dipaco_jax.data import prepare
from dipaco_jax.data import shards as shards_lib
from dipaco_jax.eval import early_stopping as early_stopping_lib
from dipaco_jax.model import bank as bank_lib
from dipaco_jax.model import layers
from dipaco_jax.parallel import mesh as mesh_lib
from dipaco_jax.parallel import multihost
from dipaco_jax.stages import run_configs
from dipaco_jax.store import atomic
from dipaco_jax.train import checkpoint as ckpt_lib
from dipaco_jax.train import metrics as metrics_lib
from dipaco_jax.train import loop
from dipaco_jax.train import shared_runtime


# The runs' configs and hashes (`stages/run_configs.py`), under the names
# the pipeline, the tests and the scripts use.
training_fields = run_configs.training_fields
training_hash = run_configs.training_hash
legacy_training_hash = run_configs.legacy_training_hash
derive_config = run_configs.derive_config
base_config_of = run_configs.base_config_of
path_steps = run_configs.path_steps
dense_config_of = run_configs.dense_config_of
discriminative_config_of = run_configs.discriminative_config_of
planned_runs = run_configs.planned_runs


def config_hash_of_run(run_dir, config) -> str:
  """The config hash a run's checkpoints must carry: `training_hash`, or
  the legacy one where the checkpoints have it. The legacy hash covers the
  same fields and more, so a match means the same settings: the run is
  resumed or reused, not retrained, and the runs that start from it keep
  their `init` hash."""
  new, legacy = training_hash(config), legacy_training_hash(config)
  stored = checkpoint_hashes(run_dir) or {}
  return legacy if stored.get("config") == legacy != new else new


# --- Run directories that already have checkpoints --------------------------


def has_checkpoints(run_dir) -> bool:
  """Whether `run_dir` holds a committed checkpoint step (orbax names a
  step's directory by its number once committed)."""
  directory = epath.Path(run_dir) / "checkpoints"
  return directory.is_dir() and any(p.name.isdigit()
                                    for p in directory.iterdir())


def checkpoint_hashes(run_dir) -> dict | None:
  """The hashes in the newest readable checkpoint of `run_dir` (None if
  none): its meta item alone, without the state."""
  if not has_checkpoints(run_dir):
    return None
  manager = ocp.CheckpointManager(
      atomic.absolute(run_dir) / "checkpoints",
      options=ocp.CheckpointManagerOptions(create=False),
      item_names=("meta",))
  try:
    for step in sorted(manager.all_steps(), reverse=True):
      try:
        meta = manager.restore(step, args=ocp.args.Composite(
            meta=ocp.args.JsonRestore()))["meta"]
      except Exception:  # pylint: disable=broad-exception-caught
        continue  # Damaged: the training loop reports it and falls back.
      return dict(meta.get("hashes", {}))
  finally:
    manager.close()
  return None


def _flat(tree: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def _overlay(current: dict, stored: dict) -> dict:
  """`current` with the values `stored` has for the same fields: fields
  added to the code since use today's value, removed ones are dropped."""
  out = {}
  for k, v in current.items():
    if k not in stored:
      out[k] = v
    elif isinstance(v, dict) and isinstance(stored[k], dict):
      out[k] = _overlay(v, stored[k])
    else:
      out[k] = stored[k]
  return out


def stored_config(config, workdir):
  """The config the workdir's runs were trained with (its config.json,
  read onto `config`'s fields), or None if there is none."""
  path = epath.Path(workdir) / "config.json"
  if not path.exists():
    return None
  try:
    stored = json.loads(path.read_text())
  except (OSError, ValueError):
    return None
  return ml_collections.ConfigDict(_overlay(config.to_dict(), stored))


def changed_fields(before, after) -> list[str]:
  """'inner_opt.learning_rate: 0.003 -> 0.001' for each training field of
  a run that differs between two configs."""
  old, new = _flat(training_fields(before)), _flat(training_fields(after))
  return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}"
          for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)]


def _made_with(run_dir, config) -> bool:
  """Whether the run's checkpoints carry `config`'s hash: then they are
  this config's, whatever config.json says (a job before this check wrote
  config.json, then refused)."""
  stored = (checkpoint_hashes(run_dir) or {}).get("config")
  return stored in (training_hash(config), legacy_training_hash(config))


def check_workdir(config, workdir) -> None:
  """Refuses a job whose runs already have checkpoints trained under other
  settings (module docstring); reads only, so call it before any write.

  Raises:
    ckpt_lib.CheckpointMismatchError: naming each such run, the fields
      that changed and the ways out.
  """
  before = stored_config(config, workdir)
  if before is None:
    return  # Nothing to compare with: stale checkpoints are moved aside.
  try:
    runs_before = planned_runs(before)
  except Exception:  # pylint: disable=broad-exception-caught
    return  # A config.json this code cannot read as a config: as above.
  runs_dir = epath.Path(workdir) / "runs"
  plan = run_configs.plan(config)
  planned = {name: cfg for name, cfg, _ in plan}
  trained = [n for n in planned if has_checkpoints(runs_dir / n)]
  changed = {}
  for name in trained:
    if name not in runs_before or _made_with(runs_dir / name, planned[name]):
      continue
    diff = changed_fields(runs_before[name], planned[name])
    if diff:
      changed[name] = diff
  if changed:
    # The runs that start from a changed one are retrained with it.
    retrained = set(changed)
    for name, _, parent in plan:  # In order: a parent comes first.
      if parent in retrained:
        retrained.add(name)
    delete = [n for n in trained if n in retrained]
    raise ckpt_lib.CheckpointMismatchError(
        f"{workdir} has checkpoints trained with other settings (those of "
        "its config.json):\n" + "\n".join(
            f"runs/{n}: " + "; ".join(d) + "." for n, d in changed.items())
        + "\nNothing was written. Use a fresh --workdir, put the old values "
        "back, or delete " + ", ".join(f"runs/{n}" for n in delete)
        + " to train again with the new values.")


_INPUT_NAMES = {"config": "settings", "corpus": "corpus",
                "tokenizer": "tokenizer", "init": "initial model"}


def retire_if_stale(run_dir, hashes: dict, ignore=()) -> epath.Path | None:
  """Moves `run_dir` aside to `NAME.stale-<hash>` when its checkpoints were
  made under other `hashes` (keys in `ignore` not compared); returns the
  new place, or None if nothing moved. On process 0 alone."""
  run_dir = epath.Path(run_dir)

  def retire():
    stored = checkpoint_hashes(run_dir)
    if stored is None:
      return None
    changed = sorted(k for k, v in hashes.items()
                     if k not in ignore and stored.get(k) != v)
    if not changed:
      return None
    tag = hashlib.sha256(json.dumps(stored, sort_keys=True).encode()
                         ).hexdigest()[:8]
    target = run_dir.parent / f"{run_dir.name}.stale-{tag}"
    n = 1
    while target.exists():
      n += 1
      target = run_dir.parent / f"{run_dir.name}.stale-{tag}-{n}"
    if multihost.is_writer():
      run_dir.rename(target)
    what = ", ".join(_INPUT_NAMES.get(k, k.replace("shards_", "shard "))
                     for k in changed)
    print(f"[{run_dir.name}] its inputs changed since its checkpoints "
          f"({what}): moved it to {target}; training it again.", flush=True)
    return target
  return multihost.first_on_writer(retire, f"stale {run_dir.name}")


class Experiment:
  """One training run: a topology, its shards, its run directory."""

  def __init__(self, config, data: prepare.DataBundle, workdir, name: str,
               shard_dir, manifest: dict, init_from=None):
    """`init_from`: the experiment the initial bank comes from, if known
    now (else given to `train`)."""
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
    self.runtime = shared_runtime.runtime_for(config, self.topology,
                                              self.dims, self.mesh,
                                              self.weights_W)
    self.hashes = {"config": config_hash_of_run(self.run_dir, config),
                   **data.hashes,
                   **{f"shards_{k}": v for k, v in manifest["hashes"].items()
                      if k not in data.hashes}}
    # Checkpoints of other inputs are moved aside now, before anything
    # (early stopping) reads the run directory. The initial model is known
    # here only if given; else `train` checks it.
    self._set_init(init_from)
    retire_if_stale(self.run_dir, self.hashes,
                    ignore=() if init_from is not None else ("init",))
    # Each run reads its shards in its own order: a run forked from the
    # base must not replay the base's batches.
    self.data_seed = zlib.crc32(f"{config.seed}/{name}".encode())
    # `islands.launcher.IslandOptions`: train a multi-worker run as separate
    # worker / executor / coordinator processes instead of one program.
    self.islands = None
    # Bytes the island roles wrote to and read from the store (measured),
    # set by the island launcher: {"per_role", "per_round", "total"}.
    self.store_bytes = None

  def _set_init(self, init_from) -> None:
    if init_from is not None:
      self.hashes["init"] = hashlib.sha256(json.dumps(
          init_from.hashes, sort_keys=True).encode()).hexdigest()[:16]

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
    if init_from is not None and "init" not in self.hashes:
      self._set_init(init_from)
      if not after_outer_step:
        # A callback (early stopping) may have read the run directory
        # already; then the loop refuses the checkpoint instead.
        retire_if_stale(self.run_dir, self.hashes)
    print(f"[{self.name}] {self.topology.describe()}", flush=True)
    if self.islands is not None and self.topology.num_workers > 1:
      # Imported here: the island runtime builds on this module.
      from dipaco_jax.islands import launcher  # pylint: disable=g-import-not-at-top
      return launcher.train_experiment(self, self.islands, init_bank,
                                       after_outer_step)
    pipeline = self.runtime.pipeline
    print(f"[{self.name}] mesh {mesh_lib.describe(self.mesh)}"
          f"{'; ' + pipeline.describe() if pipeline else ''}", flush=True)
    return loop.train(self.runtime, self.batches(), str(self.run_dir),
                      self.hashes, self.name, init_bank=init_bank,
                      after_outer_step=after_outer_step)

  def eval_bank(self, state):
    """The modules to evaluate: the outer bank or, when workers never
    synchronize (dense, H = 0), the single worker's parameters."""
    if self.config.diloco.inner_steps:
      return state["outer"]["params"]
    return state["inner"]["params"]

  def host_bank(self, state):
    """`eval_bank` on the host (replicated over the mesh, so every process
    holds all of it): code that only process 0 runs must not index the
    global arrays, which would start a computation over every process."""
    return jax.device_get(self.eval_bank(state))

  def path_params(self, state, path: int = 0):
    return bank_lib.bank_path(self.host_bank(state), self.topology, path)

  def bytes_communicated(self) -> int:
    """Outer syncs x workers x (module deltas up + parameters down), f32
    (each direction as measured when it is compressed); on islands, what
    the roles wrote to and read from the store."""
    if self.store_bytes is not None:
      return int(self.store_bytes["total"])
    h = self.config.diloco.inner_steps
    if not h or self.topology.num_workers == 1:
      return 0
    syncs = self.config.train.num_steps // h
    down = syncs * self.topology.num_workers * self._path_bytes()
    sent = self.bytes_sent()
    if sent is None:
      return 2 * down
    return sent["total"] + sent.get("received_total", down)

  def _path_bytes(self) -> int:
    """Every worker holds one whole path: the model's parameters, f32."""
    return sum(int(np.prod(x.shape)) * 4 for x in jax.tree.leaves(
        self.runtime.boxed_path_params()))

  def bytes_sent(self) -> dict | None:
    """The workers' contributions as sent (DiLoCoX compression), measured
    per outer step: {"total", "per_worker_round", "float32_per_worker_round",
    "rounds"}, and with compressed downloads what they read back
    ("received_total", "received_per_worker_round"); None for a run that
    sends them uncompressed."""
    rows = metrics_lib.read_jsonl(
        self.run_dir / "logs" / "train" / metrics_lib.COMM_LOG)
    if not rows:
      return None
    sent_RxW = np.array([r["sent_bytes_W"] for r in rows], np.float64)
    out = {"total": int(sent_RxW.sum()), "rounds": len(rows),
           "per_worker_round": float(sent_RxW.mean()),
           "float32_per_worker_round": self._path_bytes()}
    if all("recv_bytes_W" in r for r in rows):  # Compressed downloads.
      recv_RxW = np.array([r["recv_bytes_W"] for r in rows], np.float64)
      out["received_total"] = int(recv_RxW.sum())
      out["received_per_worker_round"] = float(recv_RxW.mean())
    return out


@dataclasses.dataclass(frozen=True)
class TrainedRun:
  """A run and what its training (or the reuse of its checkpoint) gave."""
  experiment: Experiment
  result: loop.TrainResult

  def path_params(self, path: int = 0):
    """The trained parameters of `path`, on the host."""
    return self.experiment.path_params(self.result.state, path)


@dataclasses.dataclass(frozen=True)
class TrainedPaths(TrainedRun):
  """Trained DiPaCo paths and their per-path early stopping (or None)."""
  stopper: early_stopping_lib.EarlyStopping | None
