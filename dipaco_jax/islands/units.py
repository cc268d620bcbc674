"""Units: what the island store exchanges as one key.

A unit is a module (slot, expert), or, with pipeline stages
(`config.pipeline.stages` = S > 1), one stage's share of a *layer* slot's
module: stage s holds layers [s n/S, (s+1) n/S) of every stacked leaf
[n, ...] (`model/pipelined.split_stages`'s split), the embedding/head slot
stays one unit. Its key is the slot's with a `stage{s}` level below
(`layout.unit_key`), so with S = 1 every key is the module's, as before.

DiLoCoX's dual optimizer policy on islands: the outer step is elementwise
over parameters (`diloco/outer.py`'s mix and optimizer), so a stage's share
steps alone to the same numbers, and the S stages of an island upload,
step and download in parallel, each with 1/S of the bytes. Scalar leaves
(an outer Adam's step count) are not split: every unit keeps its own copy,
which steps the same.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dipaco_jax import paths as paths_lib
from dipaco_jax.diloco import comm as comm_lib
from dipaco_jax.errors import UserError
from dipaco_jax.model import layers
from dipaco_jax.model import pipelined
from dipaco_jax.model import transformer


def num_stages(config) -> int:
  """S of a run's config (a ConfigDict or its JSON dict); 1 = no pipeline
  (also for a spec written before `config.pipeline` existed)."""
  pipeline = (config.get("pipeline") if isinstance(config, dict)
              else getattr(config, "pipeline", None)) or {}
  stages = (pipeline.get("stages") if isinstance(pipeline, dict)
            else getattr(pipeline, "stages", None))
  return int(stages or 1)


def slot_stages(slot, stages: int) -> int:
  """How many units each module of `slot` is stored as."""
  return stages if slot.layers and stages > 1 else 1


def unit_key(slot_name: str, stage: int, num_units: int) -> str:
  """The slot part of a unit's store keys: the slot's own name when it is
  one unit (so S = 1 keeps the old keys), else `{slot}/stage{s}`."""
  return slot_name if num_units == 1 else f"{slot_name}/stage{stage}"


def keys_of_slot(slot, stages: int) -> list[str]:
  n = slot_stages(slot, stages)
  return [unit_key(slot.name, s, n) for s in range(n)]


def share(tree, stage: int, num_units: int):
  """Stage `stage`'s share of a module tree (leaves [n, ...]; scalars kept
  whole), host or device arrays."""
  if num_units == 1:
    return tree
  return jax.tree.map(
      lambda x: x if np.ndim(x) == 0 else pipelined.split_stages(
          x, num_units)[stage], tree)


def split(tree, num_units: int) -> list:
  return [share(tree, s, num_units) for s in range(num_units)]


def join(shares: list):
  """The module tree from its stages' shares (inverse of `split`)."""
  if len(shares) == 1:
    return shares[0]
  return jax.tree.map(
      lambda *x: x[0] if np.ndim(x[0]) == 0 else np.concatenate(x, axis=0),
      *shares)


def share_like(like, num_units: int):
  """Restore targets of one share, from the module's."""
  return jax.tree.map(
      lambda x: x if len(x.shape) == 0 else jax.ShapeDtypeStruct(
          (x.shape[0] // num_units,) + tuple(x.shape[1:]), x.dtype),
      like)


def host_share(x, stage: int, num_units: int, axis: int):
  """Rows [stage k, (stage + 1) k) of `axis` (k = n / num_units) as a host
  array; of a jax array, copied only from the device shards that hold them
  (with the stage axis sharded: that stage's devices alone)."""
  if not isinstance(x, jax.Array):
    x = np.asarray(x)
    if num_units == 1:
      return x
    k = x.shape[axis] // num_units
    return x[(slice(None),) * axis + (slice(stage * k, (stage + 1) * k),)]
  if num_units == 1:
    return np.asarray(jax.device_get(x))
  if not x.is_fully_addressable:
    raise ValueError("a contribution spans other processes; a worker's "
                     "group lives on this process's devices")
  n = x.shape[axis]
  k = n // num_units
  lo, hi = stage * k, (stage + 1) * k
  out = np.empty(x.shape[:axis] + (k,) + x.shape[axis + 1:], x.dtype)
  copied = set()
  for shard in x.addressable_shards:
    bounds = tuple(s.indices(d)[:2] for s, d in zip(shard.index, x.shape))
    start, stop = bounds[axis]
    if stop <= lo or start >= hi or bounds in copied:
      continue  # Another stage's rows, or a replica of rows copied.
    copied.add(bounds)
    cut = slice(max(start, lo) - start, min(stop, hi) - start)
    src = (slice(None),) * axis + (cut,)
    dst = list(slice(a, b) for a, b in bounds)
    dst[axis] = slice(max(start, lo) - lo, min(stop, hi) - lo)
    out[tuple(dst)] = np.asarray(shard.data)[src]
  return out


def host_share_tree(tree, stage: int, num_units: int, axis: int):
  return jax.tree.map(lambda x: host_share(x, stage, num_units, axis), tree)


def _layer_leaf_sizes(config) -> dict[str, dict[str, int]]:
  """{layer slot: {leaf: values in one module}}, from the model's shapes
  (a layer's shapes do not depend on the vocabulary)."""
  topology = paths_lib.topology_from_config(config)
  model = transformer.build_model(layers.dims_from_config(config.model, 8),
                                  topology)
  path = nn.unbox(jax.eval_shape(model.init, jax.random.key(0),
                                 jnp.zeros((1, 8), jnp.int32))["params"])
  return {s.name: {jax.tree_util.keystr(k): int(np.prod(x.shape))
                   for k, x in jax.tree_util.tree_leaves_with_path(
                       path[s.name])}
          for s in topology.layer_slots}


def check_codecs(config) -> None:
  """With pipeline stages a layer slot's contribution is compressed stage
  by stage (`Wire.encode_units`); refuses a codec for which that is not
  the SPMD runtime's whole-leaf encoding, naming the fields. Refuses
  leader_topk at any stage count."""
  topology = paths_lib.topology_from_config(config)
  comms = comm_lib.comm_by_slot(config, topology.slots)
  if any(c.spec.name == "leader_topk" for c in comms.values()):
    # Its users send on the leader's indices: a store hop inside a round.
    raise UserError(
        "config.diloco.compression: leader_topk needs the leader's indices "
        "inside a round, which islands do not exchange; use topk, or run "
        "it with dipaco_jax.main.")
  stages = num_stages(config)
  if stages == 1:
    return
  sizes = None
  for slot in topology.layer_slots:
    spec = comms[slot.name].spec
    if spec.name == "none":
      continue  # Elementwise (error feedback included).
    if spec.name in ("lowrank", "strided") or (spec.name == "topk"
                                               and not spec.topk_chunk):
      what = (f"{spec.name} without compression_topk_chunk"
              if spec.name == "topk" else spec.name)
      raise UserError(
          f"config.diloco.compression/pipeline.stages: islands compress "
          f"each of the {stages} stages' share of slot {slot.name} alone, "
          f"and {what} needs the whole leaf; use int8/int4/e3m0, chunked "
          "topk, or pipeline.stages=1.")
    unit, field = ((spec.topk_chunk, "compression_topk_chunk")
                   if spec.name == "topk" else
                   (spec.block_size, "compression_block_size"))
    sizes = sizes or _layer_leaf_sizes(config)
    for leaf, size in sizes[slot.name].items():
      if (size // stages) % unit:
        raise UserError(
            f"config.diloco.{field}/pipeline.stages: each stage's share of "
            f"{slot.name}{leaf} has {size // stages} values, not a multiple "
            f"of {field}={unit}, so a block would span two stages' keys; "
            "pick a divisor of every share, or pipeline.stages=1.")
