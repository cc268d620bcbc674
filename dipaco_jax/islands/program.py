"""The compiled inner step a worker runs for a group of G workers.

Every task of the same group size runs one program: its module bank has G
rows per slot whatever experts the group uses, so tasks of other paths
reuse the compiled step (`task_runner.TaskRunner.program` keeps one per size).
"""

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import numpy as np

from dipaco_jax.diloco import outer as outer_lib
from dipaco_jax.islands import layout
from dipaco_jax.model import layers
from dipaco_jax.parallel import mesh as mesh_lib
from dipaco_jax.train import shared_runtime


def _abstract(tree):
  """Host-array restore targets (no sharding) of `tree`'s leaves."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


class GroupProgram:
  """The SPMD program of one group size: a Runtime over G workers whose
  module bank has G rows per slot, so every group of that size (whatever
  experts it uses) runs the same compiled inner step."""

  def __init__(self, spec: layout.RunSpec, group_size: int):
    config = spec.config_dict()
    full = spec.topology()
    num_devices = jax.device_count()
    config.unlock()
    # Pipeline stages (config.pipeline) take their share of the devices.
    stages = config.mesh.stage or config.pipeline.stages
    config.mesh.path = math.gcd(config.mesh.path or group_size, group_size,
                                max(num_devices // stages, 1))
    # The program runs inner steps only; the delay and the compression are
    # the task's business (islands/delayed.py, islands/wire.py,
    # islands/downloads.py), so its state is the plain one.
    config.diloco.delay = "none"
    config.diloco.compression = "none"
    config.diloco.error_feedback = False
    config.diloco.per_slot = ""
    config.diloco.download_compression = "none"  # islands/downloads.py's.
    config.diloco.download_topk_fraction = 0.0
    slots = tuple(dataclasses.replace(s, num_experts=group_size)
                  for s in full.slots)
    topology = dataclasses.replace(
        full, level_sizes=(group_size,), num_replicas=1, slots=slots,
        assignment_WxS=np.tile(np.arange(group_size, dtype=np.int32)[:, None],
                               (1, len(slots))))
    dims = layers.dims_from_config(config.model, spec.vocab_size)
    self.runtime = shared_runtime.runtime_for(config, topology, dims,
                                              mesh_lib.make_mesh(config),
                                              np.ones(group_size))
    boxed = self.runtime.boxed_path_params()
    path = _abstract(nn.unbox(boxed))
    self.module_like = {s.name: path[s.name] for s in full.slots}
    worker_opt = self.runtime.abstract_state["inner"]["opt_state"]
    self.worker_opt_like = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), worker_opt)
    runtime = self.runtime
    # A task's small steps around the inner loop, one program each (as
    # eager operations they would compile one kernel per leaf shape at a
    # worker's start and dispatch one per leaf every round).
    self.init_inner_opt = jax.jit(jax.vmap(runtime.inner_tx.init))
    # The inner step passes the bank's outer state through untouched.
    self.init_outer_opt = jax.jit(functools.partial(
        outer_lib.init_outer_opt_state, runtime.outer_tx))
    self.gather_workers = jax.jit(functools.partial(
        outer_lib.gather_workers, slot_names=runtime.slot_names))
    self.contributions = jax.jit(functools.partial(
        outer_lib.contributions, slot_names=runtime.slot_names))
