"""Several inner steps per dispatch (`train.steps_per_dispatch`)."""

import jax
import numpy as np
import pytest

from dipaco_jax import config_base
from dipaco_jax import testing
from dipaco_jax.train import dispatch
from dipaco_jax.train import loop
from dipaco_jax.train import metrics as metrics_lib


def test_plan_never_steps_over_an_outer_step_or_checkpoint():
  # Outer steps after 6 and 12 done steps, a checkpoint after 12 (the end).
  acts = lambda done: done % 6 == 0
  assert dispatch.plan(0, 12, 4, acts) == [
      (0, 4), (4, 1), (5, 1), (6, 4), (10, 1), (11, 1)]
  # A resumed run restarting mid-way falls back in step.
  assert dispatch.plan(3, 12, 4, acts) == [
      (3, 1), (4, 1), (5, 1), (6, 4), (10, 1), (11, 1)]
  assert dispatch.plan(0, 5, 1, acts) == [(s, 1) for s in range(5)]
  assert dispatch.plan(0, 8, 4, lambda done: done % 4 == 0) == [(0, 4),
                                                                (4, 4)]
  with pytest.raises(ValueError, match="steps per dispatch"):
    dispatch.plan(0, 4, 0, acts)


def test_steps_per_dispatch_is_validated():
  config = testing.tiny_config()
  config.train.steps_per_dispatch = 0
  with pytest.raises(config_base.ConfigError,
                     match="train.steps_per_dispatch"):
    config_base.validate(config, 8)


def test_a_stack_of_batches_lands_as_each_step_would():
  """[K, W, B, L+1] rows on the devices: step k's slice is exactly the
  batch `worker_rows` places for that step alone, sharded the same way."""
  config = testing.tiny_config("2x2", inner_steps=4, num_steps=8)
  runtime = testing.tiny_runtime(config)
  data = testing.RandomBatches(4, 8, config.data.seq_len)
  stack = np.stack([data.batch(s, runtime.local_workers) for s in range(3)])
  placed = runtime.worker_rows(stack)
  assert placed.shape == (3,) + runtime.global_batch_shape
  assert tuple(placed.sharding.spec) == (None,) + tuple(
      runtime.batch_sharding.spec)
  for k in range(3):
    one = runtime.worker_rows(stack[k])
    np.testing.assert_array_equal(np.asarray(placed[k]), np.asarray(one))


def _losses(run_dir):
  rows = metrics_lib.read_jsonl(run_dir / "logs" / "train" / "metrics.jsonl")
  return {r["step"]: r["last_loss"] for r in rows}


def _train(tmp_path, name, k, hooks=()):
  # Rounds end at 4, 8, 12; a checkpoint at 6 (mid-round) and 12.
  # DiLoCo x2 (2 workers, each data-parallel over 4 of the 8 devices).
  config = testing.tiny_config("1", replicas=2, inner_steps=4, num_steps=12)
  config.train.log_every = 1
  config.ckpt.every = 6
  config.train.steps_per_dispatch = k
  return loop.train(testing.tiny_runtime(config),
                    testing.RandomBatches(2, 8, config.data.seq_len),
                    str(tmp_path / name), {}, name, hooks=hooks)


class Preempted(Exception):
  pass


def _die_at_9(step, state, losses):
  del state, losses
  if step == 9:
    raise Preempted()


def test_k_steps_per_dispatch_train_as_one_step_at_a_time(tmp_path):
  """The same losses for every step, hooks for every step in order, and
  the same final state (outer steps and a mid-round checkpoint included),
  on 8 CPU devices: the scan runs the very same step K times. And a run of
  K = 4 killed after step 9 resumes from step 6 to the same state, bit
  for bit."""
  seen = {1: [], 4: []}
  results = {k: _train(tmp_path, f"k{k}", k,
                       hooks=[lambda step, s, l, k=k: seen[k].append(step)])
             for k in (1, 4)}
  assert seen[1] == seen[4] == list(range(1, 13))
  want, got = _losses(tmp_path / "k1"), _losses(tmp_path / "k4")
  assert sorted(got) == list(range(1, 13))
  # The scan's body is compiled on its own and may round differently: bit
  # for bit under XLA:CPU's default code generation (2026-12-01), a float32
  # rounding step or two apart under the tests' older loop emitter
  # (tests/conftest.py); the run hash counts K, so no resume mixes them.
  assert got == pytest.approx(want, rel=1e-6)
  for a, b in zip(jax.tree.leaves(jax.device_get(results[1].state)),
                  jax.tree.leaves(jax.device_get(results[4].state))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

  with pytest.raises(Preempted):
    _train(tmp_path, "resumed", 4, hooks=[_die_at_9])
  resumed = _train(tmp_path, "resumed", 4)
  assert resumed.resumed_from == 6
  for a, b in zip(jax.tree.leaves(jax.device_get(results[4].state)),
                  jax.tree.leaves(jax.device_get(resumed.state))):
    np.testing.assert_array_equal(a, b)
