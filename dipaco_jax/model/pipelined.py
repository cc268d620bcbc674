"""Pipeline stages inside one worker (GPipe, circular): segments over S stages.

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
S-1 to stage 0.

The circular schedule (`config.pipeline.schedule = "circular"`, `circular`
below) runs the G segments as one pipeline that microbatches go around G
times: stage s holds the s-th share of every segment already, so when
microbatch m leaves stage S-1 after segment g it re-enters stage 0 for
segment g+1 while later microbatches still finish segment g. One fill and
one drain per step instead of G: G M + S - 1 ticks, a bubble of
(S-1)/(G M + S-1) (the interleaved schedule of Narayanan et al. 2021,
"Efficient Large-Scale Language Model Training on GPU Clusters", with the
segments as its virtual stages). It needs segments of equal length.

The embedding and the head stay outside the pipeline, their parameters
(and optimizer states) replicated over `stage`. The embedding runs on the
whole batch on every stage's devices (a gather: cheap); the head and the
loss run on the pipeline's output with its rows split over the stages
(`spread_over_stages`), so their FLOPs divide among the stages too.
"""

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from dipaco_jax import config_fields
from dipaco_jax import paths as paths_lib

_fail = config_fields.fail


SCHEDULES = ("gpipe", "circular")


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Static shape of a pipeline schedule (hashable, closed over by jit)."""
  stages: int
  microbatches: int
  kind: str = "gpipe"  # One of SCHEDULES.
  segments: int = 1  # G: the path's layer segments (circular laps).

  @property
  def ticks(self) -> int:
    """Ticks of one pipeline: per segment for GPipe, per step for the
    circular schedule (every segment in one pipeline)."""
    laps = self.segments if self.kind == "circular" else 1
    return laps * self.microbatches + self.stages - 1

  @property
  def bubble_fraction(self) -> float:
    """Share of each stage's ticks spent on fill and drain."""
    return (self.stages - 1) / self.ticks

  def describe(self) -> str:
    laps = (f", circular over {self.segments} segments"
            if self.kind == "circular" else "")
    return (f"pipeline {self.stages} stages x {self.microbatches} "
            f"microbatches{laps}, bubble {self.bubble_fraction:.1%}")


def schedule_of(config) -> Schedule | None:
  """The training step's schedule from `config.pipeline`; None = off."""
  p = config.pipeline
  if p.stages == 1:
    return None
  segments = len(paths_lib.topology_from_config(config).layer_slots)
  return Schedule(p.stages, p.microbatches, p.schedule, segments)


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
  if config.pipeline.schedule not in SCHEDULES:
    _fail("pipeline.schedule", f"{config.pipeline.schedule!r} is not one of "
          f"{', '.join(SCHEDULES)}.")
  lengths = {len(slot.layers) for slot in
             paths_lib.topology_from_config(config).layer_slots}
  if config.pipeline.schedule == "circular" and len(lengths) > 1:
    _fail("pipeline.schedule", "circular needs layer segments of one "
          f"length (here {sorted(lengths)} layers): make "
          "paths.layers_per_level equal, or use gpipe.")
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
_LAPS_AXES = ("layers", None, "batch", "length", "act_embed")


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


def circular(stage_fn, segment_params, x_BxLxD, schedule: Schedule,
             policy=None):
  """Runs the G segments as one circular pipeline (see the module doc).

  Args:
    stage_fn: one stage's layers, (params [n/S, ...], x [b, L, D]) -> x;
      every segment's stage has this form (segments of equal length).
    segment_params: G trees of leaves [S, n/S, ...] (`split_stages`), in
      depth order.
    x_BxLxD: the first segment's input; B divisible by the microbatches.
    schedule: stages and microbatches (M >= S).
    policy: what the backward pass keeps of a tick's stage (a
      `jax.checkpoint` policy; None: only its input, the forward pass is
      recomputed). It must not keep everything (below); `stage_fn` should
      not rematerialize on its own.

  Returns:
    The last segment's output [B, L, D], rows in the input's order: what
    the G GPipe pipelines in turn give, with one fill and one drain.
  """
  S, M, G = schedule.stages, schedule.microbatches, len(segment_params)
  B = x_BxLxD.shape[0]
  if B % M:
    raise ValueError(f"batch {B} does not split into {M} microbatches.")
  if M < S:
    raise ValueError(f"{M} microbatches < {S} stages: a microbatch would "
                     "come back to stage 0 before stage 0 is free.")
  b = B // M
  rest = x_BxLxD.shape[1:]
  x_MxbxLxD = _constrain(x_BxLxD.reshape((b, M) + rest).swapaxes(0, 1),
                         _MICRO_AXES)
  # Leaves [S, G, n/S, ...]: each stage's share of every segment, local to
  # its devices (a copy of the layer parameters per step: the price of
  # indexing the segment per stage and tick).
  params_SxG = jax.tree.map(lambda *p: jnp.stack(p, axis=1),
                            *segment_params)

  # Each tick's stage is rematerialized as a whole, at `policy`: what the
  # backward pass keeps of a tick must not include the slice of the lap's
  # segment, a copy per tick (G M + S - 1 copies of a stage's share of a
  # segment: 124 GiB a GPU for the 3.8B model of docs/pipeline.md), while the
  # stacked parameters themselves are the scan's constants, kept once. A
  # policy that keeps all but that slice does not work: the blocks' scan
  # turns it into per-layer copies, which no name reaches.
  @functools.partial(jax.checkpoint, policy=policy)
  def one_stage(params_G, segment, x_bxLxD):
    mine = jax.tree.map(
        lambda p: jax.lax.dynamic_index_in_dim(p, segment, 0, False),
        params_G)
    return stage_fn(mine, x_bxLxD)

  run_stages = jax.vmap(one_stage, spmd_axis_name=_stage_mesh_axis())
  stage_S = jnp.arange(S)
  first_S = (stage_S == 0).reshape((S,) + (1,) * (1 + len(rest)))

  def tick(carry, t):
    buffer_SxbxLxD, laps_SxMxbxLxD = carry
    rolled_SxbxLxD = jnp.roll(buffer_SxbxLxD, 1, axis=0)
    # Row 0 now holds stage S-1's output of the last tick, microbatch
    # (t - S) mod M after some segment: kept for its next lap (in row 0 of
    # the laps buffer; every stage writes its own row, so nothing moves).
    # Before tick S what arrives is the fill's junk (stage S-1 ran on
    # zeros); it lands in rows M-S .. M-1, each overwritten by its
    # microbatch's real output before stage 0 reads it, since M >= S.
    laps_SxMxbxLxD = jax.lax.dynamic_update_index_in_dim(
        laps_SxMxbxLxD, rolled_SxbxLxD, (t - S) % M, 1)
    # Stage 0 works on microbatch t mod M: fresh in the first lap, else
    # back from stage S-1 (written this tick or M - S ticks ago).
    fresh_bxLxD = jax.lax.dynamic_index_in_dim(x_MxbxLxD, t % M, 0, False)
    lapped_SxbxLxD = jax.lax.dynamic_index_in_dim(laps_SxMxbxLxD, t % M, 1,
                                                  False)
    into_first_SxbxLxD = jnp.where(t < M, fresh_bxLxD[None], lapped_SxbxLxD)
    shifted_SxbxLxD = _constrain(
        jnp.where(first_S, into_first_SxbxLxD, rolled_SxbxLxD), _BUFFER_AXES)
    # Stage s is on lap (t - s) // M: that segment's share of its layers.
    # Outside [0, G) it idles on whatever it holds; the result is dropped.
    segment_S = jnp.clip((t - stage_S) // M, 0, G - 1)
    out_SxbxLxD = _constrain(run_stages(params_SxG, segment_S,
                                        shifted_SxbxLxD), _BUFFER_AXES)
    return (out_SxbxLxD, laps_SxMxbxLxD), out_SxbxLxD[S - 1]

  buffer_SxbxLxD = _constrain(jnp.zeros((S, b) + rest, x_BxLxD.dtype),
                              _BUFFER_AXES)
  laps_SxMxbxLxD = _constrain(jnp.zeros((S, M, b) + rest, x_BxLxD.dtype),
                              _LAPS_AXES)
  ticks = G * M + S - 1
  _, last_TxbxLxD = jax.lax.scan(tick, (buffer_SxbxLxD, laps_SxMxbxLxD),
                                 jnp.arange(ticks))
  # Microbatch m leaves its last lap from stage S-1 at tick (G-1) M + m + S-1.
  out_MxbxLxD = _constrain(last_TxbxLxD[(G - 1) * M + S - 1:], _MICRO_AXES)
  return out_MxbxLxD.swapaxes(0, 1).reshape(x_BxLxD.shape)
