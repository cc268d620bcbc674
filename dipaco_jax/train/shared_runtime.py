"""A process's Runtimes shared by what they are built from.

A Runtime jits its programs on their first call, so every new one traces,
lowers and compiles its steps again, even for a run it has built before:
a stage resumed in the same process, a run's evaluation after its
training, an island worker's group program rebuilt for the same spec, a
test's resumed run and its uninterrupted twin. `runtime_for` returns the
Runtime built last for equal inputs instead (the same config, topology,
model shape, mesh and worker weights), whose programs are traced already;
a Runtime holds no state, so a run sees the same programs either way.

Only the last few are kept (`_KEEP`): a process builds its runs one after
another, and an old Runtime keeps its compiled programs alive. Code that
changes a Runtime after building it (a test replacing a method) builds
its own with `state_lib.Runtime` directly.
"""

import collections
import threading

import jax
import ml_collections
import numpy as np

from dipaco_jax import paths as paths_lib
from dipaco_jax.model import layers
from dipaco_jax.train import state as state_lib

_KEEP = 4
_recent: collections.OrderedDict = collections.OrderedDict()
_lock = threading.Lock()


def _key(config: ml_collections.ConfigDict, topology: paths_lib.Topology,
         dims: layers.ModelDims, mesh: jax.sharding.Mesh,
         worker_weights_W: np.ndarray) -> tuple:
  """Everything a Runtime's programs depend on, comparable and hashable.
  The config by its JSON, as it is now: a config edited after its Runtime
  was built no longer matches it."""
  weights_W = np.asarray(worker_weights_W)
  return (config.to_json_best_effort(sort_keys=True),
          topology.level_sizes, topology.num_replicas, repr(topology.slots),
          topology.assignment_WxS.tobytes(), topology.assignment_WxS.shape,
          dims, mesh, weights_W.dtype.str, weights_W.shape,
          weights_W.tobytes())


def runtime_for(config: ml_collections.ConfigDict,
                topology: paths_lib.Topology, dims: layers.ModelDims,
                mesh: jax.sharding.Mesh,
                worker_weights_W: np.ndarray) -> state_lib.Runtime:
  """`state_lib.Runtime(config, topology, dims, mesh, worker_weights_W)`,
  or the one built last for equal arguments."""
  key = _key(config, topology, dims, mesh, worker_weights_W)
  with _lock:
    runtime = _recent.get(key)
    if runtime is not None and key == _key(
        runtime.config, runtime.topology, runtime.dims, runtime.mesh,
        runtime.worker_weights_W):
      _recent.move_to_end(key)
      return runtime
    runtime = state_lib.Runtime(config, topology, dims, mesh,
                                worker_weights_W)
    _recent[key] = runtime
    while len(_recent) > _KEEP:
      _recent.popitem(last=False)
    return runtime
