"""The configs of the runs a job makes, and the hashes of their settings:
the base and dense runs derived from a config (the extra dense baselines
of `eval.dense_scales` included), the list of runs
`pipeline.run` trains for it, and what of a config determines a run's
numbers (`training_fields`, `training_hash`)."""

import copy
import dataclasses
import hashlib
import json

import ml_collections

from dipaco_jax import config_base
from dipaco_jax import config_fields
from dipaco_jax import paths as paths_lib
from dipaco_jax.data import prepare


# Data fields that reach training by another hash: the data stage's through
# the corpus and tokenizer hashes (`DataBundle.hashes`), prefix_len through
# routing (the shards' hashes); prefetch not at all.
_DATA_NOT_HASHED = (*prepare.DATA_STAGE_FIELDS, "prefix_len", "prefetch")


def training_fields(config, data_not_hashed=_DATA_NOT_HASHED) -> dict:
  """What determines a run's training numbers beyond its inputs (data,
  shards, initial model), whose own hashes the checkpoints carry too; as
  JSON values (tuples become lists)."""
  keep = config.to_dict()
  # Routing and evaluation reach training only through the shards, whose
  # own hashes are checked; `base` only through the base run's own config.
  for section in ("ckpt", "eval", "routing", "base"):
    keep.pop(section, None)
  keep["train"] = {k: v for k, v in keep["train"].items()
                   if k not in ("log_every", "eval_batch_size",
                                "metrics_lag", "profile_steps",
                                "profile_python")}
  # Enters only when set (a scan of K steps may round differently), so
  # runs from before it keep their hash.
  if keep["train"].get("steps_per_dispatch") == 1:
    del keep["train"]["steps_per_dispatch"]
  if keep["train"].get("grad_dtype") == "float32":
    del keep["train"]["grad_dtype"]
  if not keep["train"].get("merge_layer_slots", False):
    keep["train"].pop("merge_layer_slots", None)
  keep["data"] = {k: v for k, v in keep["data"].items()
                  if k not in data_not_hashed
                  and not (k == "selection_split" and not v)}
  # DiLoCoX's fields enter only when set: a plain DiLoCo/DiPaCo run keeps
  # the hash (and the checkpoints) it had before they existed.
  defaults = config_base.base_config().diloco
  keep["diloco"] = {k: v for k, v in keep["diloco"].items()
                    if k not in _COMM_FIELDS or v != defaults[k]}
  # How top-k's indices are coded changes the bytes, not the numbers.
  keep["diloco"].pop("compression_index_code", None)
  _hash_aggregate_as_applied(keep["diloco"], config.diloco)
  _hash_matrix_as_applied(keep["diloco"], config)
  # The speed options (loss_chunk, fp8) enter only when set too: they change
  # the numbers a little (rounding with chunks, FP8's precision).
  model_defaults = config_base.base_config().model
  keep["model"] = {k: v for k, v in keep["model"].items()
                   if k not in _SPEED_FIELDS or v != model_defaults[k]}
  _drop_unused_stage_axis(keep, config)
  return json.loads(json.dumps(keep, sort_keys=True, default=str))


def _hash_aggregate_as_applied(keep_diloco: dict, diloco) -> None:
  """`sparse_aggregate` enters only where it changes the numbers: with a
  top-k slot, and then unless it is `mean`, which was its default until
  2026-11-29 (so those top-k runs keep their hash, and a run of today's
  default `senders` never resumes one of theirs)."""
  uses_topk = (diloco.compression == "topk" or "compression:topk" in
               diloco.per_slot.replace(" ", ""))
  keep_diloco.pop("sparse_aggregate", None)
  if uses_topk and diloco.sparse_aggregate != "mean":
    keep_diloco["sparse_aggregate"] = diloco.sparse_aggregate


def _drop_unused_stage_axis(keep: dict, config) -> None:
  """Without a pipeline and a stage mesh axis of size 1, the pipeline's
  fields and the rules onto that axis change nothing: they are hashed as
  before they existed, so earlier runs keep their hash (and checkpoints)."""
  stage_axis = config.mesh.stage or config.pipeline.stages
  if config.pipeline.stages == 1:
    keep.pop("pipeline", None)
  elif config.pipeline.schedule == "gpipe":  # Hashed as before it existed.
    keep["pipeline"] = {k: v for k, v in keep["pipeline"].items()
                        if k != "schedule"}
  if stage_axis != 1:
    return
  keep["mesh"] = {k: v for k, v in keep["mesh"].items() if k != "stage"}
  keep["sharding_rules"] = [
      (name, None if axes == "stage" else axes)
      for name, axes in keep["sharding_rules"]]


def _hash_matrix_as_applied(keep_diloco: dict, config) -> None:
  """`compression_matrix` enters only where it changes the numbers: as
  `per_layer`, with a low-rank slot of stacked layers (`comm.py`'s
  `layer_axis`). `stacked` is how every low-rank run before the field
  ran, so those keep their hash, whatever the default."""
  from dipaco_jax.diloco import comm as comm_lib  # pylint: disable=g-import-not-at-top
  keep_diloco.pop("compression_matrix", None)
  comms = comm_lib.comm_by_slot(
      config, paths_lib.topology_from_config(config).slots)
  if any(c.spec.layer_axis for c in comms.values()):
    keep_diloco["compression_matrix"] = "per_layer"


_SPEED_FIELDS = ("loss_chunk", "fp8")
_COMM_FIELDS = ("delay", "compression", "error_feedback",
                "download_compression", "download_topk_fraction",
                "compression_block_size", "compression_rank_min",
                "compression_rank_max", "compression_energy",
                "compression_factor_bits", "compression_matrix",
                "compression_topk_fraction", "compression_topk_chunk",
                "compression_stride",
                "sparse_aggregate",
                "error_feedback_decay", "per_slot", "overlap_steps",
                "preset")


def _hash(fields: dict) -> str:
  return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()
                        ).hexdigest()[:16]


def training_hash(config) -> str:
  """Hash of `training_fields` (not logging, checkpoints or inputs)."""
  return _hash(training_fields(config))


def legacy_training_hash(config) -> str:
  """`training_hash` as it was before the data stage's fields were left
  out (they are in the data hashes): checkpoints made then carry it."""
  return _hash(training_fields(config, data_not_hashed=("prefetch",)))


def derive_config(config, **overrides):
  """A copy of `config` with dotted-path overrides ('train.num_steps')."""
  out = copy.deepcopy(config)
  out.unlock()
  for dotted, value in overrides.items():
    section, key = dotted.split(".")
    out[section][key] = value
  return out


# A run with one worker and no outer step (H = 0) never reads the outer
# optimizer's settings: they are set to the defaults, so that changing them
# for the DiPaCo/DiLoCo runs leaves the base and dense runs' hashes and
# checkpoints alone. Reset in the config, not only left out of the hash:
# the checkpoint holds the outer optimizer's (unused) state, whose shape
# depends on the optimizer.
_NO_OUTER_STEP = {f"diloco.{k}": v
                  for k, v in config_base.base_config().diloco.items()
                  if k != "inner_steps"}
_DENSE = {"paths.shape": "1", "paths.num_replicas": 1,
          "paths.private_layers": "", "paths.layers_per_level": "",
          "paths.private_embedding": False, "diloco.inner_steps": 0,
          **_NO_OUTER_STEP}


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


def discriminative_config_of(config):
  """The discriminative phase: the paths trained again on new shards."""
  return derive_config(config, **{
      "train.num_steps": config.routing.discriminative_steps})


@dataclasses.dataclass(frozen=True)
class DenseSpec:
  """One extra dense run, derived from the DiPaCo config."""
  name: str  # Its run directory, runs/NAME.
  config: ml_collections.ConfigDict
  role: str  # scaled | same_flops
  scale: float  # Multiple of one path's non-embedding parameters.
  steps: int  # Steps the model takes in all, a base's included.


def dense_specs(config) -> list[DenseSpec]:
  """The extra dense runs that `config.eval` asks for (maybe none;
  stages/dense_scaling.py trains them)."""
  dense = dense_config_of(config)
  out = []
  # Larger models get more layers of the path's own shape: m x the layers
  # is exactly m x the non-embedding parameters (every block is the same
  # size; only the final norm's d_model scales stay fixed), with no
  # rounding of widths to whole heads, and head_dim, num_heads, d_model,
  # the embedding and every mesh divisibility stay those of a path. At
  # fixed parameters the loss depends little on depth vs width (Kaplan et
  # al. 2020, fig. 5), and deeper-thinner models do slightly better below
  # a billion parameters (Liu et al. 2024, MobileLLM).
  total = config.base.num_steps + path_steps(config)
  for scale in config_fields.parse_scales(config.eval.dense_scales):
    out.append(DenseSpec(
        f"dense_{scale:g}x", _without_extras(derive_config(
            dense, **{"model.num_layers": round(config.model.num_layers *
                                                scale),
                      "train.num_steps": total})),
        "scaled", scale, total))
  if config.eval.dense_same_flops:
    num_paths = paths_lib.topology_from_config(config).num_paths
    steps = num_paths * path_steps(config)
    out.append(DenseSpec(
        "dense_same_flops", _without_extras(derive_config(
            dense, **{"train.num_steps": steps})),
        "same_flops", 1.0, config.base.num_steps + steps))
  return out


def _without_extras(config):
  """A derived run trains no extra runs of its own."""
  return derive_config(
      config, **{"eval.dense_scales": "", "eval.dense_same_flops": False})


def plan(config) -> list[tuple[str, object, str | None]]:
  """(run name, config, the run it starts from or None) of every training
  run that `pipeline.run` makes for `config` (kept in step with it)."""
  base = "base" if config.base.num_steps > 0 else None
  runs = [("base", base_config_of(config), None)] if base else []
  if paths_lib.topology_from_config(config).num_paths == 1:
    return runs + [("main", config, base)]
  runs.append(("dipaco", config, base))
  if config.routing.discriminative_steps > 0:
    runs.append(("dipaco_discriminative", discriminative_config_of(config),
                 "dipaco"))
  runs.append(("dense", dense_config_of(config), base))
  runs += [(spec.name, spec.config, base if spec.role == "same_flops"
            else None) for spec in dense_specs(config)]
  return runs


def planned_runs(config) -> dict:
  """Run name (`runs/NAME`) -> config of every training run of `config`."""
  return {name: cfg for name, cfg, _ in plan(config)}
