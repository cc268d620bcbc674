"""FP8 matmuls for the decoder blocks (`config.model.fp8`, Hopper GPUs).

Recipe: per-tensor *current* (just-in-time) scaling. Each operand of a
matmul is divided by its own scale, amax / fp8_max, computed from the tensor
being multiplied, and cast to float8_e4m3fn; the product of the two FP8
tensors is taken with `jax.lax.dot_general` (XLA lowers an FP8 dot to a
cuBLASLt FP8 GEMM on Hopper) and multiplied back by both scales. In the
backward pass the incoming gradient is scaled the same way into
float8_e5m2 (more range, less precision: gradients span more decades), and
both operand gradients are FP8 GEMMs of it with the saved FP8 operands,
which also halves what the forward pass keeps for the backward.

Why not flax's delayed scaling (`nn.Fp8DirectDotGeneralOp`, `nn.Fp8Einsum`):
its scales and amax histories live in a separate variable collection
(`_overwrite_with_gradient`) that the training step must thread through
`value_and_grad` and write back every step. In this framework that state
would have to sit beside every worker's parameters without being one: kept
out of AdamW, out of the module bank and the outer (DiLoCo) step's
pseudo-gradients and averaging, out of DiLoCoX compression, with its own
shardings and checkpoint entries, and reset or carried across outer steps
by a rule of its own. Current scaling needs no state: the parameter tree,
the bank, outer steps and checkpoints are exactly those of a bf16 run, and
an FP8 run can be resumed in bf16 and back. Its cost is one extra
reduction (the amax) over each operand per matmul, small next to the
matmul itself. The quantize/dequantize arithmetic and the transposed dots
of the backward pass are flax's (`flax.linen.fp8_ops`); only the scale's
source differs.

`check_supported` is called when a model is built from a config
(`layers.dims_from_config`), not here, so that the math runs anywhere XLA
emulates float8 (the CPU tests).
"""

import functools

from flax.linen import fp8_ops
import jax
import jax.numpy as jnp

from dipaco_jax import config_fields

_FORWARD_DTYPE = jnp.float8_e4m3fn
_GRADIENT_DTYPE = jnp.float8_e5m2
# cuBLASLt's FP8 GEMMs (and XLA's rewrite to them) start at SM 8.9 (Ada);
# Hopper (9.0) is what this option is built for.
_MIN_CAPABILITY = (8, 9)


def _capability(device) -> tuple[int, ...]:
  try:
    return tuple(int(x) for x in device.compute_capability.split("."))
  except (AttributeError, ValueError):  # CPU, TPU, ROCm: no CUDA SM.
    return ()


def supported() -> bool:
  """Whether every device of the default backend has FP8 tensor cores."""
  return all(d.platform == "gpu" and _capability(d) >= _MIN_CAPABILITY
             for d in jax.devices())


def check_supported(enabled: bool) -> None:
  """Raises the config error of `model.fp8=True` on a device without FP8."""
  if enabled and not supported():
    device = jax.devices()[0]
    config_fields.fail(
        "model.fp8", "needs an NVIDIA Hopper-class GPU (compute capability "
        f">= 8.9), but the default backend is {jax.default_backend()} "
        f"({device.device_kind}); set model.fp8=False.")


def _quantize(x, q_dtype):
  """x / scale in `q_dtype`, and the float32 scale (amax maps to the FP8
  maximum; an all-zero or non-finite tensor keeps scale 1)."""
  amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
  fp8_max = fp8_ops.get_fp8_max(q_dtype, jnp.float32)
  scale = fp8_ops.compute_scale(amax, jnp.ones((), jnp.float32), fp8_max)
  scale = jax.lax.stop_gradient(scale)
  return fp8_ops.quantize(x, q_dtype, scale, x.dtype), scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _scaled_dot(lhs, rhs, dimension_numbers, out_dtype, lhs_dtype,
                rhs_dtype):
  return _scaled_dot_fwd(lhs, rhs, dimension_numbers, out_dtype, lhs_dtype,
                         rhs_dtype)[0]


def _scaled_dot_fwd(lhs, rhs, dimension_numbers, out_dtype, lhs_dtype,
                    rhs_dtype):
  del lhs_dtype, rhs_dtype  # For the backward pass.
  q_lhs, lhs_scale = _quantize(lhs, _FORWARD_DTYPE)
  q_rhs, rhs_scale = _quantize(rhs, _FORWARD_DTYPE)
  out = jax.lax.dot_general(q_lhs, q_rhs, dimension_numbers,
                            preferred_element_type=out_dtype)
  out = fp8_ops.dequantize(out, out_dtype, lhs_scale * rhs_scale)
  return out, (q_lhs, lhs_scale, q_rhs, rhs_scale)


def _scaled_dot_bwd(dimension_numbers, out_dtype, lhs_dtype, rhs_dtype,
                    saved, g):
  del out_dtype
  q_lhs, lhs_scale, q_rhs, rhs_scale = saved
  q_g, g_scale = _quantize(g, _GRADIENT_DTYPE)
  # The FP8 operands stand in for the originals: the transposes read only
  # their shapes, and the products are what the GEMMs multiply.
  grad_lhs = fp8_ops.dot_general_transpose_lhs(
      q_g, q_lhs, q_rhs, dimension_numbers=dimension_numbers,
      precision=None, preferred_element_type=lhs_dtype)
  grad_rhs = fp8_ops.dot_general_transpose_rhs(
      q_g, q_lhs, q_rhs, dimension_numbers=dimension_numbers,
      precision=None, preferred_element_type=rhs_dtype)
  return (fp8_ops.dequantize(grad_lhs, lhs_dtype, rhs_scale * g_scale),
          fp8_ops.dequantize(grad_rhs, rhs_dtype, lhs_scale * g_scale))


_scaled_dot.defvjp(_scaled_dot_fwd, _scaled_dot_bwd)


def dot_general(lhs, rhs, dimension_numbers, precision=None,
                preferred_element_type=None):
  """`jax.lax.dot_general` in FP8 with current scaling (module docstring).

  A drop-in `_dot_general` for `jnp.einsum`; `precision` is ignored (the
  GEMM's precision is FP8's).
  """
  del precision
  out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs, rhs))
  # Hashable (a static argument of the custom VJP), whatever einsum gives.
  dimension_numbers = tuple(tuple(tuple(int(i) for i in d) for d in pair)
                            for pair in dimension_numbers)
  return _scaled_dot(lhs, rhs, dimension_numbers, out_dtype,
                     jnp.dtype(lhs.dtype), jnp.dtype(rhs.dtype))
