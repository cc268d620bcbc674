"""A finished workdir, read for inference without rerunning any stage.

What is read, all of it written by the main job (`pipeline.py`):

  config.json                    the settings the runs were trained with
  tokenizer/spm.model            the tokenizer (or config.data.tokenizer_model)
  runs/NAME/checkpoints/         a run's newest intact checkpoint; its
                                 modules as evaluation scores them
                                 (`Experiment.eval_bank`)
  runs/NAME/early_stopping/      with eval.early_stopping: each path's best
                                 snapshot, which evaluation scores instead
  runs/base/checkpoints/         the base model of the routing features
  shards/NAME/manifest.json      the hash of the document router NAME was
                                 sharded with, which evaluation routes with
  results.json, router/window_*  the learned window router whose fit
                                 results.json reports

NAME is the main run: `dipaco_discriminative` after a discriminative
phase, else `dipaco`; `main` for a one-path config (dense or DiLoCo).

A run is restored through `train.checkpoint.Checkpointer`, as a resumed
run is: onto this process's devices whatever mesh trained it, its digests
checked, a damaged step reported, moved to checkpoints/damaged/ and the
next older one used. It reads the whole checkpoint, every worker's AdamW
state too, though only the modules are kept.
"""

import dataclasses
import json
import types

from etils import epath
import jax
import numpy as np

from dipaco_jax import config_base
from dipaco_jax import errors
from dipaco_jax import paths as paths_lib
from dipaco_jax.data import shards as shards_lib
from dipaco_jax.data import tokenizer as tokenizer_lib
from dipaco_jax.eval import early_stopping as early_stopping_lib
from dipaco_jax.model import bank as bank_lib
from dipaco_jax.model import layers
from dipaco_jax.model import transformer
from dipaco_jax.parallel import mesh as mesh_lib
from dipaco_jax.routing import router as router_lib
from dipaco_jax.stages import experiment as experiment_lib
from dipaco_jax.stages import feature_source as feature_source_lib
from dipaco_jax.stages import run_configs
from dipaco_jax.train import checkpoint as ckpt_lib
from dipaco_jax.train import shared_runtime

# The run whose modules are "the trained model", first found wins.
_MAIN_RUNS = ("dipaco_discriminative", "dipaco", "main")


@dataclasses.dataclass(frozen=True)
class RestoredRun:
  """A run's modules as evaluation scores them, on the host."""
  name: str
  topology: paths_lib.Topology
  bank: dict  # {slot: leaves [K, ...]}
  step: int


def _on_local_devices(config):
  """`config` with an automatic mesh over this process's devices: the
  restore places arrays by the target's mesh, never the writer's (a
  pipelined run's layers on one stage: decoding is not pipelined)."""
  return run_configs.derive_config(config, **{
      "mesh.path": 0, "mesh.stage": 1, "mesh.data": -1, "mesh.fsdp": 1,
      "mesh.tensor": 1})


def _read_config(workdir: epath.Path):
  config = experiment_lib.stored_config(config_base.base_config(), workdir)
  if config is None:
    raise errors.UserError(
        f"--workdir={workdir} has no readable config.json: give the "
        "--workdir of a finished `python -m dipaco_jax.main` job.")
  return config


def _read_tokenizer(config, workdir: epath.Path):
  path = epath.Path(config.data.tokenizer_model or
                    workdir / "tokenizer" / "spm.model")
  if not path.exists():
    raise errors.UserError(
        f"--workdir={workdir}: no tokenizer at {path}; run the main job's "
        "data stage (python -m dipaco_jax.main) in this workdir first.")
  return tokenizer_lib.Tokenizer.load(path)


class TrainedWorkdir:
  """The trained model of a workdir: paths, dense baseline, routers."""

  def __init__(self, workdir):
    self.workdir = epath.Path(workdir)
    self.config = _read_config(self.workdir)
    self.runs = run_configs.planned_runs(self.config)
    self.main_run = next(n for n in _MAIN_RUNS if n in self.runs)
    self.topology = paths_lib.topology_from_config(self.config)
    self.tokenizer = _read_tokenizer(self.config, self.workdir)
    # Decoding and export run in bf16 whatever the run trained in: FP8
    # (`model.fp8`) changes how matmuls compute, not the parameters, and
    # decoding must work where FP8 does not (a CPU, an older GPU).
    self.dims = layers.dims_from_config(
        run_configs.derive_config(self.config, **{"model.fp8": False}).model,
        self.tokenizer.vocab_size)
    self._restored = {}

  @property
  def num_paths(self) -> int:
    return self.topology.num_paths

  @property
  def model(self) -> transformer.PathTransformer:
    """The model of one path of the main run (all paths share it)."""
    return transformer.build_model(self.dims, self.topology)

  def describe_path(self, path: int) -> str:
    ids = self.topology.path_level_ids(path)
    return f"path {path} (experts {'/'.join(map(str, ids))})"

  # --- Runs -----------------------------------------------------------------

  def run(self, name: str) -> RestoredRun:
    """The modules of `runs/NAME` after its last step (cached)."""
    if name not in self._restored:
      self._restored[name] = self._restore(name)
    return self._restored[name]

  def _restore(self, name: str) -> RestoredRun:
    run_config = self.runs[name]
    run_dir = self.workdir / "runs" / name
    where = f"--workdir={self.workdir}: runs/{name}"
    if not experiment_lib.has_checkpoints(run_dir) and (
        self.workdir / "islands" / name).exists():
      raise errors.UserError(
          f"{where} was trained on islands, whose modules stay in "
          f"islands/{name}/ (no runs/{name}/checkpoints); reading those is "
          "not supported yet: train with python -m dipaco_jax.main.")
    if not experiment_lib.has_checkpoints(run_dir):
      raise errors.UserError(
          f"{where} has no checkpoint; run the main job (python -m "
          "dipaco_jax.main --config=... --workdir=...) to the end first.")
    local = _on_local_devices(run_config)
    topology = paths_lib.topology_from_config(run_config)
    runtime = shared_runtime.runtime_for(local, topology, self.dims,
                                         mesh_lib.make_mesh(local),
                                         np.ones(topology.num_workers))
    ckpt = ckpt_lib.Checkpointer(str(run_dir / "checkpoints"), every=0,
                                 keep=run_config.ckpt.keep, async_save=False)
    try:
      # No expected hashes: this is not a resume; they are checked below.
      state, meta, step = ckpt.restore_latest(runtime.abstract_state, {})
    finally:
      ckpt.close()
    self._check_meta(name, run_config, meta.get("hashes", {}), where)
    if step < run_config.train.num_steps:
      raise errors.UserError(
          f"{where} has trained {step} of {run_config.train.num_steps} "
          "steps; run the main job again to finish it.")
    # As `Experiment.eval_bank`: the outer bank, or the single worker's
    # parameters of a run that never synchronizes (H = 0).
    part = "outer" if run_config.diloco.inner_steps else "inner"
    return RestoredRun(name, topology,
                       jax.device_get(state[part]["params"]), step)

  def _check_meta(self, name, run_config, hashes: dict, where: str) -> None:
    if hashes.get("config") not in (
        run_configs.training_hash(run_config),
        run_configs.legacy_training_hash(run_config)):
      raise errors.UserError(
          f"{where}'s checkpoint was trained with other settings than "
          "config.json says; rerun the main job with this workdir's config "
          f"(python -m dipaco_jax.main) so that {name} is retrained.")
    if hashes.get("tokenizer") != self.tokenizer.sha256[:16]:
      raise errors.UserError(
          f"{where}'s checkpoint was trained with another tokenizer than "
          f"{self.workdir / 'tokenizer'}; rerun the main job in this workdir.")

  def path_params(self, path: int) -> dict:
    """The parameters evaluation scores for `path` of the main run: its
    modules gathered from the bank, or its early-stopping snapshot."""
    run = self.run(self.main_run)
    params = bank_lib.bank_path(run.bank, run.topology, path)
    if self.early_stopping_step(path) is None:
      return params
    return self._stopper().best_params(path, params)

  def early_stopping_step(self, path: int) -> int | None:
    """The step of `path`'s early-stopping snapshot, if evaluation uses
    one."""
    stopper = self._stopper()
    return None if stopper is None else stopper.best.get(str(path), {}).get(
        "step")

  def _stopper(self) -> early_stopping_lib.EarlyStopping | None:
    """The main run's snapshots as `eval/early_stopping.py` keeps them
    (only committed ones count), read-only: the run may still be training
    and writing them."""
    if not self.config.eval.early_stopping or self.num_paths == 1:
      return None
    if "stopper" not in self._restored:
      self._restored["stopper"] = early_stopping_lib.EarlyStopping(
          None, [], self.workdir / "runs" / self.main_run / "early_stopping",
          self.config.data.seq_len, self.config.data.prefix_len,
          self.config.train.eval_batch_size, topology=self.topology,
          read_only=True)
    return self._restored["stopper"]

  def dense(self) -> tuple[transformer.PathTransformer, dict]:
    """DiPaCo's dense baseline (the model itself for a one-path config)."""
    name = "dense" if "dense" in self.runs else self.main_run
    run = self.run(name)
    return (transformer.build_model(self.dims, run.topology),
            bank_lib.bank_path(run.bank, run.topology, 0))

  # --- Routing ----------------------------------------------------------------

  def feature_model(self) -> tuple[transformer.PathTransformer, dict]:
    """What routing features are computed with: the base model, or (with
    no base) the initial model, of which features read the embedding."""
    if self.config.base.num_steps > 0:
      run = self.run("base")
      return (transformer.build_model(self.dims, run.topology),
              bank_lib.bank_path(run.bank, run.topology, 0))
    # The same initial parameters the pipeline routed with.
    vocab_only = types.SimpleNamespace(vocab_size=self.tokenizer.vocab_size)
    source = feature_source_lib.FeatureSource.of(
        _on_local_devices(self.config), vocab_only, None, None)
    return self.model, source.init_params

  def document_router(self) -> router_lib.Router:
    """The router the main run's shards were made with; evaluation routes
    validation documents with it."""
    manifest = shards_lib.read_manifest(
        str(self.workdir / "shards" / self.main_run))
    if manifest is None:
      raise errors.UserError(
          f"--workdir={self.workdir}: shards/{self.main_run} has no "
          "manifest; run the main job to the end first.")
    wanted = manifest["hashes"]["router"]
    for path in sorted((self.workdir / "router").glob("*.npz")):
      if path.name.startswith(("generative_", "discriminative_")) and (
          router_lib.Router.load(path).sha256() == wanted):
        return router_lib.Router.load(path)
    raise errors.UserError(
        f"--workdir={self.workdir}: no router/*.npz has the hash {wanted} "
        f"that shards/{self.main_run} was made with; rerun the main job.")

  def window_router(self) -> tuple[router_lib.Router | None, dict | None]:
    """The learned window router evaluation used and its fit info, or
    (None, None) when the job fit none."""
    results = self.workdir / "results.json"
    if not results.exists():
      raise errors.UserError(
          f"--workdir={self.workdir} has no results.json: the main job did "
          "not finish; run it again.")
    info = (json.loads(results.read_text()).get("router") or {}).get(
        "window_router")
    if not info:
      return None, None
    for path in sorted((self.workdir / "router").glob("window_*.json")):
      if json.loads(path.read_text()) == info:
        return router_lib.Router.load(path.with_suffix(".npz")), info
    raise errors.UserError(
        f"--workdir={self.workdir}: no router/window_*.json matches the "
        "window router of results.json; rerun the main job.")
