"""`config.train.grad_dtype` (a lever for data-parallel steps):
bfloat16 gradients train like float32 ones, AdamW still keeps float32
state, float32 is today's step, and the field enters a run's hash only when
set.

Tolerance: the tiny model computes in float32, so the bfloat16 arm differs
by the rounding of its parameters in the forward pass and of the gradient
(2^-8 relative): three AdamW steps' losses agree to 1e-2 relative, and the
parameters to 5e-3 (AdamW's step is 1e-3 a step here, whatever the
gradient's scale).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dipaco_jax import config_base
from dipaco_jax import testing
from dipaco_jax.stages import run_configs


def _three_steps(grad_dtype, initial=None):
  config = testing.tiny_config(num_steps=3)
  config.model.num_layers = 2
  config.train.grad_dtype = grad_dtype
  runtime = testing.tiny_runtime(config)
  if initial is None:
    initial = runtime.init_state(jax.random.key(0))
  state = jax.tree.map(jnp.copy, initial)  # The step donates its state.
  batches = testing.RandomBatches(1, config.train.batch_size,
                                  config.data.seq_len)
  losses = []
  for step in range(3):
    state, metrics = runtime.inner_step(
        state, runtime.worker_rows(batches.batch(step)))
    losses.append(np.asarray(metrics["loss"]))
  return initial, state, np.stack(losses)


def test_bfloat16_gradients_track_float32_and_keep_float32_state():
  initial, want, want_losses = _three_steps("float32")
  _, got, got_losses = _three_steps("bfloat16", initial)
  np.testing.assert_allclose(got_losses, want_losses, rtol=1e-2)
  assert not np.array_equal(got_losses, want_losses)  # It did round.
  for a, b in zip(jax.tree.leaves(want["inner"]),
                  jax.tree.leaves(got["inner"])):
    assert a.dtype == b.dtype  # AdamW's moments and parameters stay f32.
  for a, b in zip(jax.tree.leaves(want["inner"]["params"]),
                  jax.tree.leaves(got["inner"]["params"])):
    np.testing.assert_allclose(b, a, rtol=0, atol=5e-3)


def test_grad_dtype_enters_the_hash_only_when_set():
  config = testing.tiny_config()
  before = run_configs.training_hash(config)
  assert "grad_dtype" not in run_configs.training_fields(config)["train"]
  config.train.grad_dtype = "bfloat16"
  assert run_configs.training_hash(config) != before


def test_unknown_grad_dtype_names_the_field():
  config = testing.tiny_config()
  config.train.grad_dtype = "float16"
  with pytest.raises(config_base.ConfigError, match="config.train.grad_dtype"):
    config_base.validate(config, num_devices=8)
