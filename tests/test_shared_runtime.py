"""A process builds one Runtime per config: equal inputs share it (and its
traced programs), anything that changes a program does not."""

import jax
import numpy as np

from dipaco_jax import paths as paths_lib
from dipaco_jax import testing
from dipaco_jax.model import layers
from dipaco_jax.parallel import mesh as mesh_lib
from dipaco_jax.train import shared_runtime


def _inputs(config, weights_W=None):
  topology = paths_lib.topology_from_config(config)
  return (config, topology,
          layers.dims_from_config(config.model, testing.TINY_VOCAB),
          mesh_lib.make_mesh(config),
          np.ones(topology.num_workers) if weights_W is None else weights_W)


def test_equal_inputs_share_one_runtime_and_its_traced_programs():
  first = shared_runtime.runtime_for(*_inputs(testing.tiny_config("2x2")))
  state = first.init_state(jax.random.key(0))
  batch_WxBxLp1 = np.zeros((4, 8, 41), np.int32)
  state, _ = first.inner_step(state, batch_WxBxLp1)
  jitted = first.inner_step.jitted
  assert jitted._cache_size() == 1  # pylint: disable=protected-access
  # A config built anew, equal field by field: the same Runtime, whose
  # step runs without tracing again.
  again = shared_runtime.runtime_for(*_inputs(testing.tiny_config("2x2")))
  assert again is first
  again.inner_step(state, batch_WxBxLp1)
  assert again.inner_step.jitted is jitted
  assert jitted._cache_size() == 1  # pylint: disable=protected-access


def test_whatever_changes_a_program_builds_another():
  config = testing.tiny_config("2x2")
  first = shared_runtime.runtime_for(*_inputs(config))
  changed = testing.tiny_config("2x2")
  changed.inner_opt.learning_rate = 2 * config.inner_opt.learning_rate
  assert shared_runtime.runtime_for(*_inputs(changed)) is not first
  weighted = shared_runtime.runtime_for(*_inputs(
      config, np.array([1.0, 2.0, 3.0, 4.0])))
  assert weighted is not first
  assert weighted.worker_weights_W.tolist() == [1.0, 2.0, 3.0, 4.0]


def test_a_config_edited_after_its_runtime_was_built_is_not_reused():
  # 3 steps: a config no other test of this process built a Runtime for.
  config = testing.tiny_config("2x2", num_steps=3)
  first = shared_runtime.runtime_for(*_inputs(config))
  assert first.config is config
  config.inner_opt.learning_rate *= 2
  unedited = testing.tiny_config("2x2", num_steps=3)
  fresh = shared_runtime.runtime_for(*_inputs(unedited))
  assert fresh is not first
  assert fresh.config is unedited


def test_only_the_last_few_are_kept():
  keep = shared_runtime._KEEP  # pylint: disable=protected-access
  configs = [testing.tiny_config("1x1", num_steps=steps)
             for steps in range(8, 8 + keep + 1)]
  built = [shared_runtime.runtime_for(*_inputs(c)) for c in configs]
  # The newest are kept; the oldest was let go, so it is built anew.
  assert shared_runtime.runtime_for(*_inputs(configs[-1])) is built[-1]
  assert shared_runtime.runtime_for(*_inputs(configs[0])) is not built[0]
