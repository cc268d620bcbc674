"""The hand-written cross-entropy backward (model/cross_entropy.py) equals
autodiff of optax's loss: the loss to 1e-6 relative, the logits' gradient
to 1e-7 in float32 and within one bfloat16 rounding step (2^-8 of the
largest entry) in bfloat16, where both are rounded to bfloat16 at the same
point; padded vocabulary entries (logit -1e9) get no gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dipaco_jax.model import cross_entropy

VOCAB, REAL = 97, 90  # The last 7 entries are padding.


def _logits_and_targets(dtype):
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(0, 3, (4, 7, VOCAB)), dtype)
  logits = jnp.where(jnp.arange(VOCAB) < REAL, logits,
                     jnp.asarray(-1e9, dtype))
  return logits, jnp.asarray(rng.integers(0, REAL, (4, 7)))


@pytest.mark.parametrize("dtype,grad_atol", [(jnp.float32, 1e-7),
                                             (jnp.bfloat16, 2 ** -8 * 0.04)])
def test_loss_and_gradient_equal_autodiff_of_optax(dtype, grad_atol):
  logits, targets = _logits_and_targets(dtype)

  def optax_loss(z):
    return optax.softmax_cross_entropy_with_integer_labels(
        z.astype(jnp.float32), targets).mean()

  def ours(z):
    return cross_entropy.mean_cross_entropy(z, targets)

  want, want_grad = jax.jit(jax.value_and_grad(optax_loss))(logits)
  got, got_grad = jax.jit(jax.value_and_grad(ours))(logits)
  np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
  assert got_grad.dtype == dtype
  np.testing.assert_allclose(np.asarray(got_grad, np.float32),
                             np.asarray(want_grad, np.float32),
                             rtol=0, atol=grad_atol)
  assert not np.asarray(got_grad[..., REAL:], np.float32).any()


def test_summed_is_the_mean_times_the_tokens():
  logits, targets = _logits_and_targets(jnp.float32)
  np.testing.assert_allclose(
      float(cross_entropy.summed_cross_entropy(logits, targets)),
      float(cross_entropy.mean_cross_entropy(logits, targets)) * 28,
      rtol=1e-6)
