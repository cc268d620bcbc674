"""The FP8 option (`config.model.fp8`): refused where the devices
have no FP8 (these CPU tests), and its matmul, run through XLA's float8
emulation on CPU, is close to the bfloat16 one.

Tolerance. float8_e4m3fn keeps 3 mantissa bits (a rounding error up to
2^-4 of each operand), float8_e5m2 2 bits for gradients (2^-3); over a
contraction of K random terms the errors average out, so a product's error
is a few percent of its typical size. The tests allow 10% of the reference's
RMS, forward and backward: an FP8 matmul with a wrong scale (a factor of 2
anywhere) or a transposed gradient fails it by far.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dipaco_jax import testing
from dipaco_jax.model import fp8
from dipaco_jax.model import layers

_TOLERANCE = 0.1  # Of the reference's RMS (module docstring).


def test_fp8_is_refused_on_cpu_with_the_fix():
  config = testing.tiny_config()
  config.model.fp8 = True
  with pytest.raises(ValueError, match=r"^config\.model\.fp8: needs an NVIDIA "
                     r"Hopper-class GPU \(compute capability >= 8\.9\).*"
                     r"set model\.fp8=False"):
    testing.tiny_runtime(config)


def test_fp8_off_builds_no_float8():
  """The default config's model has no FP8 in its program."""
  config = testing.tiny_config()
  dims = layers.dims_from_config(config.model, testing.TINY_VOCAB)
  assert not dims.fp8
  text = str(jax.make_jaxpr(layers.GatedMlp(dims).init)(
      jax.random.key(0), jnp.ones((2, 4, 32), jnp.bfloat16)))
  assert "f8" not in text


def _relative_rms_error(x, reference):
  x, reference = (np.asarray(a, np.float32) for a in (x, reference))
  return np.sqrt(np.mean((x - reference) ** 2) / np.mean(reference ** 2))


@pytest.mark.parametrize("spec,lhs_shape,rhs_shape", [
    ("bld,dtf->bltf", (2, 16, 64), (64, 2, 48)),  # The MLP's gate/up.
    ("blhk,hkd->bld", (2, 16, 4, 16), (4, 16, 64)),  # Attention's out.
])
def test_fp8_matmul_is_close_to_bfloat16(spec, lhs_shape, rhs_shape):
  k_lhs, k_rhs, k_out = jax.random.split(jax.random.key(0), 3)
  lhs = jax.random.normal(k_lhs, lhs_shape, jnp.bfloat16)
  rhs = (0.05 * jax.random.normal(k_rhs, rhs_shape)).astype(jnp.bfloat16)
  out_shape = jax.eval_shape(lambda a, b: jnp.einsum(spec, a, b), lhs, rhs)
  cotangent = jax.random.normal(k_out, out_shape.shape, jnp.float32)

  def loss(dot_general, lhs, rhs):
    out = jnp.einsum(spec, lhs, rhs, _dot_general=dot_general)
    return jnp.sum(out.astype(jnp.float32) * cotangent), out

  def run(dot_general):
    grad_fn = jax.grad(loss, argnums=(1, 2), has_aux=True)
    return jax.jit(grad_fn, static_argnums=0)(dot_general, lhs, rhs)

  (ref_dlhs, ref_drhs), ref_out = run(jax.lax.dot_general)
  (dlhs, drhs), out = run(fp8.dot_general)
  assert out.dtype == jnp.bfloat16 and dlhs.dtype == drhs.dtype == jnp.bfloat16
  assert _relative_rms_error(out, ref_out) < _TOLERANCE
  assert _relative_rms_error(dlhs, ref_dlhs) < _TOLERANCE
  assert _relative_rms_error(drhs, ref_drhs) < _TOLERANCE


def test_fp8_scale_follows_the_tensor():
  """Current scaling: a tensor 1000x larger (past e4m3's max, 448) or
  smaller (below its smallest normal) gives the same relative result, and
  all zeros give zeros, not NaN."""
  lhs = jax.random.normal(jax.random.key(1), (8, 32), jnp.float32)
  rhs = jax.random.normal(jax.random.key(2), (32, 16), jnp.float32)
  dims = (((1,), (0,)), ((), ()))
  base = fp8.dot_general(lhs, rhs, dims)
  for factor in (1e3, 1e-3):
    np.testing.assert_allclose(fp8.dot_general(lhs * factor, rhs, dims),
                               base * factor, rtol=1e-5, atol=1e-5 * factor)
  zeros = fp8.dot_general(jnp.zeros_like(lhs), rhs, dims)
  np.testing.assert_array_equal(zeros, np.zeros((8, 16), np.float32))
