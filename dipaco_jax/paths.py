"""The module bank's topology: levels, experts, paths, workers and slots.

A *slot* is a group of parameters that is exchanged as one unit: the
embedding+head, or a run of consecutive transformer layers that share the same
owner. Each slot has K experts (module copies):
  * shared slot: K = 1, every worker uses expert 0;
  * level slot:  K = K_l, a worker on path p uses expert ids(p)[l];
  * private slot: K = P (one per path), a worker on path p uses expert p.
A *worker* is one (path, replica) pair: DiLoCo is K_l = 1 with R replicas,
DiPaCo is R = 1 with prod(K_l) paths, dense training is one worker.

Everything the outer step needs is the integer table `assignment_WxS` (worker
w uses expert assignment[w, s] of slot s), so sharing is by index, never by
Python aliasing.
"""

import dataclasses
import math

import numpy as np

from dipaco_jax import config_fields

EMBED_SLOT = "embed_head"


@dataclasses.dataclass(frozen=True)
class Slot:
  """One exchangeable group of parameters and its experts."""
  name: str  # Key in the parameter tree.
  kind: str  # shared | level | private
  level: int | None  # Routing level, for kind == 'level'.
  layers: tuple[int, ...]  # Transformer layers it holds (empty for embed).
  num_experts: int


@dataclasses.dataclass(frozen=True)
class Topology:
  """Paths, workers and slots of a module bank."""
  level_sizes: tuple[int, ...]
  num_replicas: int
  slots: tuple[Slot, ...]
  assignment_WxS: np.ndarray  # int32: expert of slot s used by worker w.

  @property
  def num_paths(self) -> int:
    return math.prod(self.level_sizes)

  @property
  def num_workers(self) -> int:
    return self.num_paths * self.num_replicas

  @property
  def layer_slots(self) -> tuple[Slot, ...]:
    return tuple(s for s in self.slots if s.layers)

  def path_level_ids(self, path: int) -> tuple[int, ...]:
    return tuple(int(i) for i in np.unravel_index(path, self.level_sizes))

  def path_assignment_PxS(self) -> np.ndarray:
    """Expert per slot for each path (replica 0's row)."""
    return self.assignment_WxS[::self.num_replicas]

  def describe(self) -> str:
    rows = [f"{self.num_paths} paths x {self.num_replicas} replicas = "
            f"{self.num_workers} workers; levels {self.level_sizes}"]
    for s in self.slots:
      layers = f"layers {s.layers[0]}-{s.layers[-1]}" if s.layers else (
          "embedding + final norm + head")
      rows.append(f"  {s.name:<14} {s.kind:<8} {s.num_experts:>4} experts, "
                  f"{layers}")
    return "\n".join(rows)


def _layer_owner(layer, level_of_layer, private_layers):
  return ("private", None) if layer in private_layers else (
      "level", level_of_layer[layer])


def build_topology(num_layers: int,
                   level_sizes: tuple[int, ...],
                   layers_per_level: tuple[int, ...] = (),
                   private_layers: tuple[int, ...] = (),
                   private_embedding: bool = False,
                   num_replicas: int = 1) -> Topology:
  """Builds the slot table; see the module docstring."""
  num_levels = len(level_sizes)
  if not layers_per_level:
    layers_per_level = (num_layers // num_levels,) * num_levels
  level_of_layer = np.repeat(np.arange(num_levels), layers_per_level)
  num_paths = math.prod(level_sizes)
  paths = np.arange(num_paths)
  level_ids_PxLv = np.stack(np.unravel_index(paths, level_sizes), axis=1)
  private = set(private_layers)

  slots, columns = [], []

  def add(name, kind, level, layers, experts_P):
    num_experts = {"shared": 1, "private": num_paths}.get(
        kind, level_sizes[level] if level is not None else 1)
    if kind == "level" and num_experts == 1:
      kind = "shared"
    slots.append(Slot(name, kind, level, tuple(layers), num_experts))
    columns.append(experts_P)

  if private_embedding and num_paths > 1:
    add(EMBED_SLOT, "private", None, (), paths)
  else:
    add(EMBED_SLOT, "shared", None, (), np.zeros(num_paths, np.int64))

  # Consecutive layers with the same owner form one slot.
  start = 0
  for layer in range(1, num_layers + 1):
    if layer < num_layers and (_layer_owner(layer, level_of_layer, private)
                               == _layer_owner(start, level_of_layer,
                                               private)):
      continue
    kind, level = _layer_owner(start, level_of_layer, private)
    layers = range(start, layer)
    name = f"layers_{start:02d}_{layer - 1:02d}"
    if kind == "private" and num_paths > 1:
      add(name, "private", None, layers, paths)
    elif kind == "private":
      add(name, "shared", None, layers, np.zeros(num_paths, np.int64))
    else:
      add(name, "level", level, layers, level_ids_PxLv[:, level])
    start = layer

  assignment_PxS = np.stack(columns, axis=1).astype(np.int32)
  assignment_WxS = np.repeat(assignment_PxS, num_replicas, axis=0)
  return Topology(tuple(level_sizes), num_replicas, tuple(slots),
                  assignment_WxS)


def topology_from_config(config) -> Topology:
  p = config.paths
  return build_topology(
      num_layers=config.model.num_layers,
      level_sizes=config_fields.parse_shape(p.shape),
      layers_per_level=config_fields.parse_int_list(
          "paths.layers_per_level", p.layers_per_level),
      private_layers=config_fields.parse_int_list("paths.private_layers",
                                                  p.private_layers),
      private_embedding=p.private_embedding,
      num_replicas=p.num_replicas)
