"""`train.merge_layer_slots`: K steps on a path's layer slots merged into
one stacked leaf train as K steps on the slots apart."""

import jax
import numpy as np
import pytest

from dipaco_jax import config_base
from dipaco_jax import testing
from dipaco_jax.errors import UserError
from dipaco_jax.stages import run_configs
from dipaco_jax.train import merged_slots


def _k_steps(merge: bool, clip: float):
  config = testing.tiny_config("2x2", inner_steps=4, num_steps=8)
  config.train.steps_per_dispatch = 3
  config.train.merge_layer_slots = merge
  config.inner_opt.grad_clip = clip
  runtime = testing.tiny_runtime(config)
  state = runtime.init_state(jax.random.key(0))
  w, b, l = runtime.global_batch_shape
  batches = testing.RandomBatches(w, b, l - 1)
  for first in (0, 3):  # Two dispatches of 3 steps.
    batch = runtime.worker_rows(np.stack([batches.batch(first + i)
                                          for i in range(3)]))
    state, metrics = runtime.inner_k_steps(state, batch)
  return runtime, jax.device_get(state), jax.device_get(metrics)


def test_merged_layer_slots_train_as_the_slots_apart():
  for clip in (0.0, 1.0):
    runtime, plain, plain_m = _k_steps(False, clip)
    merged_runtime, merged, merged_m = _k_steps(True, clip)
    assert merged_slots.layer_group(merged_runtime.topology,
                                    merged_runtime.config) == (
                                        "layers_00_01", "layers_02_03")
    assert merged_slots.layer_group(runtime.topology, runtime.config) == ()
    # The same tree (the slots cut apart again), the same numbers: AdamW
    # is elementwise; with clipping the norm sums in another order.
    assert jax.tree.structure(plain) == jax.tree.structure(merged)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(merged)):
      np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    np.testing.assert_allclose(plain_m["loss"], merged_m["loss"], atol=1e-6)


def test_merge_and_split_are_inverse_on_the_layer_axis():
  tree = {"embed": np.zeros((2, 3)),
          "a": {"blocks": {"w": np.arange(2 * 2 * 3).reshape(2, 2, 3)}},
          "b": {"blocks": {"w": 100 + np.arange(2 * 4 * 3).reshape(2, 4, 3)}}}
  merged = merged_slots.merge(tree, ("a", "b"), axis=1)
  assert merged[merged_slots.MERGED]["blocks"]["w"].shape == (2, 6, 3)
  back = merged_slots.split(merged, ("a", "b"), (2, 4), axis=1)
  for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(back)):
    np.testing.assert_array_equal(x, y)
  # Off by default, and in a run's hash only when on.
  config = testing.tiny_config("2x2", inner_steps=4, num_steps=8)
  before = run_configs.training_hash(config)
  config.train.merge_layer_slots = True
  assert run_configs.training_hash(config) != before


def test_merging_needs_several_steps_per_dispatch():
  config = testing.tiny_config("2x2", inner_steps=4, num_steps=8)
  config.train.merge_layer_slots = True
  with pytest.raises(UserError, match=r"config.train.merge_layer_slots: "
                     r"merges once per dispatch: set train.steps_per_dispatch"):
    config_base.validate(config, 8)
  config.train.steps_per_dispatch = 2
  config_base.validate(config, 8)


def test_island_workers_merge_too_and_equal_the_spmd_runtime(tmp_path):
  # A worker's rounds run the same K-step program (islands/program.py):
  # with the setting on, both runtimes merge, and end on the same modules.
  import test_islands  # pylint: disable=g-import-not-at-top
  exp = test_islands._experiment(tmp_path / "spmd", num_steps=4)  # pylint: disable=protected-access
  exp.config.train.steps_per_dispatch = 2
  exp.config.train.merge_layer_slots = True
  spmd = jax.device_get(exp.train().state["outer"]["params"])
  bank = test_islands._islands_in_process(  # pylint: disable=protected-access
      exp, tmp_path / "islands", 4, steps_per_dispatch=2)
  assert test_islands._max_abs_diff(spmd, bank) < 1e-6  # pylint: disable=protected-access


def _optimizer_instructions(merge: bool) -> int:
  """Fusions, adds and multiplies scoped `optimizer` in the compiled
  3-step program of a tiny DiPaCo 2x2 (XLA:CPU)."""
  import re  # pylint: disable=g-import-not-at-top
  config = testing.tiny_config("2x2", inner_steps=4, num_steps=8)
  config.train.steps_per_dispatch = 3
  config.train.merge_layer_slots = merge
  runtime = testing.tiny_runtime(config)
  state = runtime.init_state(jax.random.key(0))
  w, b, l = runtime.global_batch_shape
  batch = runtime.worker_rows(np.zeros((3, w, b, l), np.int32))
  text = runtime.inner_k_steps.jitted.lower(state, batch).compile().as_text()
  return sum(1 for line in text.splitlines() if "optimizer" in line and
             re.search(r"= \S+ (fusion|add|multiply)\(", line))


def test_merging_cuts_the_optimizers_instructions():
  # What the setting is for: AdamW over one merged leaf per layer
  # parameter instead of one per slot (measured 487 -> 295 here).
  plain, merged = _optimizer_instructions(False), _optimizer_instructions(True)
  assert merged < 0.75 * plain, (plain, merged)
