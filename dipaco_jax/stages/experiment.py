"""What one training run is: its config (and the runs derived from it),
its shards and run directory, the hashes its checkpoints carry, and what
it returns once trained."""

import copy
import dataclasses
import hashlib
import json
import zlib

from etils import epath
import jax
import numpy as np

from dipaco_jax import paths as paths_lib
from dipaco_jax.data import batches as batches_lib
from dipaco_jax.data import prepare
from dipaco_jax.data import shards as shards_lib
from dipaco_jax.eval import early_stopping as early_stopping_lib
from dipaco_jax.model import bank as bank_lib
from dipaco_jax.model import layers
from dipaco_jax.parallel import mesh as mesh_lib
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


def path_steps(config) -> int:
  """Steps each path trains after the base (both phases)."""
  return config.train.num_steps + max(config.routing.discriminative_steps, 0)


def dense_config_of(config):
  """DiPaCo's dense baseline: one path's size, continued from the same
  base for the same steps and batch as each path."""
  return derive_config(config, **_DENSE, **{
      "train.num_steps": path_steps(config)})


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
    """Outer syncs x workers x (module deltas up + parameters down), f32."""
    h = self.config.diloco.inner_steps
    if not h or self.topology.num_workers == 1:
      return 0
    # Every worker holds one whole path: the model's parameters.
    path_bytes = sum(int(np.prod(x.shape)) * 4 for x in jax.tree.leaves(
        self.runtime.boxed_path_params()))
    syncs = self.config.train.num_steps // h
    return 2 * syncs * self.topology.num_workers * path_bytes


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
