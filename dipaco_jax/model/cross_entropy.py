"""Summed next-token cross-entropy whose backward pass is one elementwise
pass over the logits.

Autodiff of `optax.softmax_cross_entropy_with_integer_labels` on float32
logits made from bfloat16 ones costs, at the paper's path shape, separate
passes over the [16384, 32000] float32 cotangent: a multiply (1.07 ms on an
H100), a conversion to bfloat16 for the head's matmul (1.02 ms) and a
reduction (docs/performance.md, the inner step). Here the
backward is written out: the cotangent of the logits is

  g (softmax(z) - onehot(target)) = g (exp(z - logsumexp(z)) - onehot)

from the logits as the head made them (compute dtype, kept for the
backward, where autodiff kept their float32 copy) and the per-token
logsumexp (float32, [N]), emitted in the logits' dtype: one read and one
write of the logits' size. Measured on an H100 it took the loss's part of
the step from 6.9 to 5.5 ms, but the step as a whole did not get faster
(docs/performance.md). The forward is optax's formula in float32. Numerics: the
loss is the same float32 math up to the order of operations (1e-6
relative); the gradient is rounded to the compute dtype at the same point as before (the
head's matmul takes it in that dtype either way), so in bfloat16 it may
differ from autodiff's by one rounding step (tests/test_cross_entropy.py).
"""

import jax
import jax.numpy as jnp


@jax.custom_vjp
def summed_cross_entropy(logits_NxV, targets_N):
  """Sum over tokens of -log softmax(logits)[target], in float32.

  Args:
    logits_NxV: logits of any leading shape [..., V], any float dtype.
    targets_N: integer targets of the leading shape.
  """
  loss, _ = _forward(logits_NxV, targets_N)
  return loss


def _logsumexp_and_target(logits_NxV, targets_N):
  z_NxV = logits_NxV.astype(jnp.float32)
  lse_N = jax.nn.logsumexp(z_NxV, axis=-1)
  target_N = jnp.take_along_axis(z_NxV, targets_N[..., None], axis=-1)[..., 0]
  return lse_N, target_N


def _forward(logits_NxV, targets_N):
  lse_N, target_N = _logsumexp_and_target(logits_NxV, targets_N)
  return jnp.sum(lse_N - target_N), (logits_NxV, targets_N, lse_N)


def _backward(residuals, g):
  logits_NxV, targets_N, lse_N = residuals
  vocab_1xV = jnp.arange(logits_NxV.shape[-1]).reshape(
      (1,) * targets_N.ndim + (-1,))
  softmax_NxV = jnp.exp(logits_NxV.astype(jnp.float32) - lse_N[..., None])
  onehot_NxV = (vocab_1xV == targets_N[..., None]).astype(jnp.float32)
  d_NxV = (g * (softmax_NxV - onehot_NxV)).astype(logits_NxV.dtype)
  return d_NxV, None  # Integer targets have no cotangent.


summed_cross_entropy.defvjp(_forward, _backward)


def mean_cross_entropy(logits_NxV, targets_N):
  """`summed_cross_entropy` over the number of tokens."""
  return summed_cross_entropy(logits_NxV, targets_N) / targets_N.size
