"""GPipe pipeline stages inside one worker: a layer segment split over S stages.

A layer segment (a bank slot's `LayerStack`, parameters stacked [n, ...] on
the logical axis `layers`) runs as S stages of n/S consecutive layers: its
parameters are viewed as [S, n/S, ...], stage s owning layers
[s n/S, (s+1) n/S). The `layers` rule maps that axis onto the `stage` mesh
axis, so each stage's devices hold only their own layers, and the AdamW and
outer optimizer states that are sharded like the parameters come along: the
dual optimizer policy is the sharding, not code.

The schedule is the scan-based GPipe (MaxText's idea, our own code): the
batch is cut into M microbatches and a buffer [S, b, L, D] holds what each
stage works on. Each of the M + S - 1 ticks

  1. shifts the buffer one stage along (stage s takes stage s-1's output,
     a collective-permute once the buffer's stage axis is sharded) and
     feeds microbatch t into stage 0;
  2. runs every stage on its slot at once (`jax.vmap` over the stage axis,
     each stage a nested scan over its n/S layers);
  3. emits stage S-1's output, which is microbatch t - (S-1)'s result.

Slots outside a microbatch's journey (the fill and the drain) compute on
zeros and are dropped, so gradients through them are zero. Autodiff of the
scan is the backward pipeline in reverse, so forward and backward each idle
(S-1)/(M+S-1) of the time: the bubble fraction. Microbatch m is the rows
m, m+M, m+2M, ...: a data-sharded batch splits into microbatches without
moving rows between devices.

A path has G segments (its layer slots); each is pipelined in turn, so
stage s holds the s-th share of every slot, and the pipeline fills and
drains once per segment. That idles no longer than one GPipe over the
whole path would: a segment of n layers idles (S-1) ticks of n/S layers,
(S-1) N/S layer-times over all N layers, the same (S-1)/(M+S-1) of a
step. What it costs is G (M+S-1) shorter ticks instead of M+S-1, each
with its own hand-off, and each segment's output returning from stage
S-1 to stage 0. A circular schedule, which sends microbatch 0 on into the
next segment while later ones finish this one, would cut the bubble to
about (S-1)/(G M + S-1); not built.

The embedding and the head stay outside the pipeline, their parameters
(and optimizer states) replicated over `stage`. The embedding runs on the
whole batch on every stage's devices (a gather: cheap); the head and the
loss run on the pipeline's output with its rows split over the stages
(`spread_over_stages`), so their FLOPs divide among the stages too.
"""

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from dipaco_jax import config_fields
from dipaco_jax import paths as paths_lib

_fail = config_fields.fail


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Static shape of a GPipe schedule (hashable, closed over by jit)."""
  stages: int
  microbatches: int

  @property
  def ticks(self) -> int:
    return self.microbatches + self.stages - 1

  @property
  def bubble_fraction(self) -> float:
    """Share of each stage's ticks spent on fill and drain."""
    return (self.stages - 1) / self.ticks

  def describe(self) -> str:
    return (f"pipeline {self.stages} stages x {self.microbatches} "
            f"microbatches, bubble {self.bubble_fraction:.1%}")


def schedule_of(config) -> Schedule | None:
  """The training step's schedule from `config.pipeline`; None = off."""
  p = config.pipeline
  return Schedule(p.stages, p.microbatches) if p.stages > 1 else None


def bubble_fraction(config) -> float:
  schedule = schedule_of(config)
  return 0.0 if schedule is None else schedule.bubble_fraction


def check_config(config) -> None:
  """Stages split every layer segment evenly and microbatches fill them
  (`config_base.validate`; ConfigError names the field and the fix)."""
  stages, micro = config.pipeline.stages, config.pipeline.microbatches
  if stages == 1:
    return
  if not config.model.scan_layers:
    _fail("model.scan_layers", "the pipeline splits each segment's stacked "
          "layers over the stages: set it True, or pipeline.stages=1.")
  for slot in paths_lib.topology_from_config(config).layer_slots:
    if len(slot.layers) % stages:
      _fail("pipeline.stages", f"{stages} stages do not split the "
            f"{len(slot.layers)} layers of slot {slot.name} evenly; pick a "
            "divisor of every segment's layer count (paths.layers_per_level, "
            "paths.private_layers).")
  if micro < stages:
    _fail("pipeline.microbatches", f"{micro} must be >= pipeline.stages="
          f"{stages}, else no tick keeps every stage busy; use {stages} or more "
          f"(the bubble is (S-1)/(M+S-1)).")


def check_mesh(config, mesh: dict[str, int]) -> None:
  """The stage axis holds the stages (or is 1: all stages on every device,
  the same numbers without the memory saving), and the batch splits into
  microbatches that shard evenly over the data axes."""
  stages, micro = config.pipeline.stages, config.pipeline.microbatches
  if stages == 1:
    if mesh["stage"] != 1:
      _fail("mesh.stage", f"{mesh['stage']} without a pipeline: set "
            f"pipeline.stages={mesh['stage']}, or mesh.stage=0 (auto).")
    return
  if mesh["stage"] not in (1, stages):
    _fail("mesh.stage", f"{mesh['stage']} must be pipeline.stages={stages} "
          "(a stage per device group) or 1 (all stages on every device); "
          "0 = auto picks pipeline.stages.")
  batch, batch_shards = config.train.batch_size, mesh["data"] * mesh["fsdp"]
  if batch % (micro * batch_shards):
    _fail("pipeline.microbatches", f"train.batch_size={batch} must split "
          f"into {micro} microbatches of a multiple of mesh.data x mesh.fsdp "
          f"= {batch_shards} rows; change either.")


def split_stages(params, stages: int):
  """Stacked layer parameters [n, ...] -> [S, n/S, ...], stage-major."""
  def split(x_N):
    n = x_N.shape[0]
    if n % stages:
      raise ValueError(f"{n} layers do not split into {stages} stages "
                       "(config_base.validate checks this).")
    return x_N.reshape((stages, n // stages) + x_N.shape[1:])
  return jax.tree.map(split, params)


def _stage_mesh_axis():
  """The mesh axis the `layers` rule puts the stages on (None if no mesh
  or rules are in context: nothing is constrained then)."""
  mesh = jax.sharding.get_abstract_mesh()
  rules = nn.get_logical_axis_rules()
  if mesh.empty or not rules:
    return None
  axis = nn.logical_to_mesh_axes(("layers",), rules)[0]
  return axis if isinstance(axis, str) and axis in mesh.axis_names else None


def _constrain(x, logical):
  """Pins `x` to the logical axes in context (no-op without a mesh)."""
  mesh = jax.sharding.get_abstract_mesh()
  rules = nn.get_logical_axis_rules()
  if mesh.empty or not rules:
    return x
  return jax.lax.with_sharding_constraint(
      x, nn.logical_to_mesh_axes(logical, rules))


def spread_over_stages(x_BxLxD):
  """The pipeline's final output with its rows split over the stages too
  (each device keeps a slice of the rows it holds: no traffic), so that the
  head and the loss after it divide their FLOPs among the stages instead of
  repeating them on each. Unchanged unless the rows divide evenly."""
  stage = _stage_mesh_axis()
  if stage is None:
    return x_BxLxD
  rules = nn.get_logical_axis_rules()
  batch = nn.logical_to_mesh_axes(("batch",), rules)[0]
  batch = () if batch is None else (batch,) if isinstance(batch, str) else (
      tuple(batch))
  shape = jax.sharding.get_abstract_mesh().shape
  if x_BxLxD.shape[0] % math.prod(shape[a] for a in batch + (stage,)):
    return x_BxLxD
  # Stage last: a data shard's rows split among its stages in place.
  spec = jax.sharding.PartitionSpec(batch + (stage,),
                                    *([None] * (x_BxLxD.ndim - 1)))
  return jax.lax.with_sharding_constraint(x_BxLxD, spec)


# The buffer's stage axis shares the parameters' `layers` rule, so each
# stage's activations sit on the devices that hold its layers.
_BUFFER_AXES = ("layers", "batch", "length", "act_embed")
_MICRO_AXES = (None, "batch", "length", "act_embed")


def gpipe(stage_fn, stage_params, x_BxLxD, schedule: Schedule):
  """Runs `stage_fn(params_of_one_stage, x_bxLxD)` as a GPipe pipeline.

  Args:
    stage_fn: one stage's layers, (params [n/S, ...], x [b, L, D]) -> x.
    stage_params: leaves [S, n/S, ...] (`split_stages`).
    x_BxLxD: the segment's input; B divisible by the microbatches.
    schedule: stages and microbatches.

  Returns:
    The segment's output [B, L, D], rows in the input's order.
  """
  S, M = schedule.stages, schedule.microbatches
  B = x_BxLxD.shape[0]
  if B % M:
    raise ValueError(f"batch {B} does not split into {M} microbatches.")
  b = B // M
  rest = x_BxLxD.shape[1:]
  # Row j*M + m -> microbatch m, row j: every microbatch keeps the batch's
  # sharding over the data axes (contiguous blocks of j).
  x_MxbxLxD = _constrain(x_BxLxD.reshape((b, M) + rest).swapaxes(0, 1),
                         _MICRO_AXES)
  # Stage 0's feed: the microbatches, then zeros while the pipeline drains.
  feed_TxbxLxD = jnp.concatenate(
      [x_MxbxLxD, jnp.zeros((S - 1, b) + rest, x_BxLxD.dtype)])
  stage_axis = _stage_mesh_axis()
  run_stages = jax.vmap(stage_fn, spmd_axis_name=stage_axis)
  first_S = (jnp.arange(S) == 0).reshape((S,) + (1,) * (1 + len(rest)))

  def tick(buffer_SxbxLxD, feed_bxLxD):
    # Stage s takes stage s-1's last output (a roll, i.e. a collective-
    # permute over `stage`); stage 0 takes the next microbatch instead.
    shifted_SxbxLxD = jnp.where(first_S, feed_bxLxD[None],
                                jnp.roll(buffer_SxbxLxD, 1, axis=0))
    shifted_SxbxLxD = _constrain(shifted_SxbxLxD, _BUFFER_AXES)
    out_SxbxLxD = _constrain(run_stages(stage_params, shifted_SxbxLxD),
                             _BUFFER_AXES)
    return out_SxbxLxD, out_SxbxLxD[S - 1]

  buffer_SxbxLxD = _constrain(jnp.zeros((S, b) + rest, x_BxLxD.dtype),
                              _BUFFER_AXES)
  _, last_TxbxLxD = jax.lax.scan(tick, buffer_SxbxLxD, feed_TxbxLxD)
  # Stage S-1 finishes microbatch m at tick m + S - 1.
  out_MxbxLxD = _constrain(last_TxbxLxD[S - 1:], _MICRO_AXES)
  return out_MxbxLxD.swapaxes(0, 1).reshape(x_BxLxD.shape)
