"""Transformer layers: RMSNorm, rotary attention, gated MLP, decoder block.

Parameters are float32 and carry logical axis names (see
`config_base.DEFAULT_SHARDING_RULES`); compute runs in `config.dtype`
(bfloat16 by default). Attention goes through `jax.nn.dot_product_attention`
so that GPUs get the fused cuDNN kernel. With `ModelDims.fp8` the blocks'
dense matmuls run in FP8 (model/fp8.py).

Shape suffixes (the legend for the whole package is in docs/DESIGN.md): B
batch, L sequence length, D model width, H heads, Dh head width, R rotary
frequencies (Dh / 2), F MLP width, V vocabulary.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from dipaco_jax.model import fp8 as fp8_lib
from dipaco_jax.model import kv_cache


@dataclasses.dataclass(frozen=True)
class ModelDims:
  """The static shape of a path model (hashable, so jit can close over it)."""
  vocab_size: int
  num_layers: int
  d_model: int
  num_heads: int
  head_dim: int
  mlp_dim: int
  rope_base: float = 10_000.0
  dtype: str = "bfloat16"
  attention: str = "xla"  # xla | cudnn (resolved, never 'auto')
  remat: str = "none"
  scan_layers: bool = True
  scan_unroll: int = 0  # Layers per loop iteration; 0 = fully unrolled.
  tie_embeddings: bool = False
  init_std: float = 0.02
  fp8: bool = False  # The blocks' matmuls in FP8 (model/fp8.py).

  @property
  def padded_vocab(self) -> int:
    """Vocabulary rounded up to a multiple of 128, so that the embedding and
    head split evenly over `tensor` shards and map well onto MXUs/tensor
    cores; the padding logits are masked out."""
    return -(-self.vocab_size // 128) * 128

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)


def dims_from_config(model_config, vocab_size: int) -> ModelDims:
  attention = model_config.attention
  if attention == "auto":
    # cuDNN's fused attention takes float16/bfloat16 only (a float32 model
    # on a GPU raised NotImplementedError in it).
    fused = jnp.dtype(model_config.dtype) in (jnp.bfloat16, jnp.float16)
    attention = ("cudnn" if jax.default_backend() == "gpu" and fused
                 else "xla")
  fp8_lib.check_supported(model_config.fp8)
  return ModelDims(
      vocab_size=vocab_size,
      num_layers=model_config.num_layers,
      d_model=model_config.d_model,
      num_heads=model_config.num_heads,
      head_dim=model_config.head_dim,
      mlp_dim=model_config.mlp_dim,
      rope_base=model_config.rope_base,
      dtype=model_config.dtype,
      attention=attention,
      remat=model_config.remat,
      scan_layers=model_config.scan_layers,
      scan_unroll=model_config.scan_unroll,
      tie_embeddings=model_config.tie_embeddings,
      init_std=model_config.init_std,
      fp8=model_config.fp8)


def _matmul(spec, x, w, dims: ModelDims):
  """`jnp.einsum` of activations and a weight, in FP8 with `dims.fp8`."""
  if dims.fp8:
    return jnp.einsum(spec, x, w, _dot_general=fp8_lib.dot_general)
  return jnp.einsum(spec, x, w)


def _param_init(std, names):
  return nn.with_logical_partitioning(nn.initializers.normal(std), names)


class RMSNorm(nn.Module):
  dims: ModelDims

  @nn.compact
  def __call__(self, x_BxLxD):
    scale_D = self.param("scale", nn.with_logical_partitioning(
        nn.initializers.ones, ("embed",)), (x_BxLxD.shape[-1],), jnp.float32)
    x32 = x_BxLxD.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)
    scale = scale_D.reshape((1,) * (x32.ndim - 1) + scale_D.shape)
    return (x32 * scale).astype(self.dims.compute_dtype)


def rotary(x_BxLxHxDh, base: float, positions_BxL=None):
  """Rotary position embedding over the last axis (split in halves).

  Positions are 0 .. L - 1 unless `positions_BxL` gives each row's own
  (decoding with a KV cache: the new tokens sit after the cached ones).
  """
  length, half = x_BxLxHxDh.shape[1], x_BxLxHxDh.shape[-1] // 2
  inv_freq_R = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
  if positions_BxL is None:
    position_Lx1 = jnp.arange(length, dtype=jnp.float32)[:, None]
    angle_LxR = position_Lx1 * inv_freq_R[None, :]
    # [1, L, 1, R]: broadcast over batch and heads.
    sin = jnp.sin(angle_LxR)[None, :, None, :]
    cos = jnp.cos(angle_LxR)[None, :, None, :]
  else:
    angle_BxLxR = (positions_BxL.astype(jnp.float32)[:, :, None]
                   * inv_freq_R[None, None, :])
    # [B, L, 1, R]: broadcast over heads.
    sin = jnp.sin(angle_BxLxR)[:, :, None, :]
    cos = jnp.cos(angle_BxLxR)[:, :, None, :]
  x1, x2 = jnp.split(x_BxLxHxDh.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
  return out.astype(x_BxLxHxDh.dtype)


class Attention(nn.Module):
  """Causal multi-head attention with one fused QKV projection.

  With a `kv_cache.LayerCache` the new tokens attend to the cached keys
  and values as well (decoding); it returns `(out, updated cache)` then.
  Without one (training, evaluation) it is plain causal attention over the
  tokens given.
  """
  dims: ModelDims

  @nn.compact
  def __call__(self, x_BxLxD, cache=None):
    d = self.dims
    dtype = d.compute_dtype
    w_Dx3xHxDh = self.param(
        "qkv", _param_init(d.init_std, ("embed", None, "heads", "kv")),
        (d.d_model, 3, d.num_heads, d.head_dim), jnp.float32)
    qkv_BxLx3xHxDh = _matmul("bld,dthk->blthk", x_BxLxD,
                             w_Dx3xHxDh.astype(dtype), d)
    q_BxLxHxDh, k_BxLxHxDh, v_BxLxHxDh = (qkv_BxLx3xHxDh[:, :, i]
                                          for i in range(3))
    if cache is None:
      q_BxLxHxDh = rotary(q_BxLxHxDh, d.rope_base)
      k_BxLxHxDh = rotary(k_BxLxHxDh, d.rope_base)
      # The scope names the attention core's ops in profiles (the XLA
      # implementation's are plain einsums otherwise).
      with jax.named_scope("dot_product_attention"):
        out_BxLxHxDh = jax.nn.dot_product_attention(
            q_BxLxHxDh, k_BxLxHxDh, v_BxLxHxDh, is_causal=True,
            implementation=d.attention)
    else:
      positions_BxL = kv_cache.positions(cache, x_BxLxD.shape[1])
      q_BxLxHxDh = rotary(q_BxLxHxDh, d.rope_base, positions_BxL)
      k_BxLxHxDh = rotary(k_BxLxHxDh, d.rope_base, positions_BxL)
      out_BxLxHxDh, cache = kv_cache.attend(q_BxLxHxDh, k_BxLxHxDh,
                                            v_BxLxHxDh, cache)
    # Residual branches are scaled down with depth (GPT-2 style) so that
    # the residual stream's variance does not grow with the number of layers.
    w_HxDhxD = self.param(
        "out", _param_init(d.init_std / (2 * d.num_layers) ** 0.5,
                           ("heads", "kv", "embed")),
        (d.num_heads, d.head_dim, d.d_model), jnp.float32)
    out_BxLxD = _matmul("blhk,hkd->bld", out_BxLxHxDh,
                        w_HxDhxD.astype(dtype), d)
    return out_BxLxD if cache is None else (out_BxLxD, cache)


class GatedMlp(nn.Module):
  """SwiGLU MLP with the gate and up projections fused in one matmul."""
  dims: ModelDims

  @nn.compact
  def __call__(self, x_BxLxD):
    d = self.dims
    dtype = d.compute_dtype
    w_Dx2xF = self.param("gate_up",
                         _param_init(d.init_std, ("embed", None, "mlp")),
                         (d.d_model, 2, d.mlp_dim), jnp.float32)
    h_BxLx2xF = _matmul("bld,dtf->bltf", x_BxLxD, w_Dx2xF.astype(dtype), d)
    # A split, not two indexings: the backward pass then concatenates the
    # two halves' cotangents (fusable into the SwiGLU backward) instead of
    # padding each to [B, L, 2, F] and adding them, a separate pass over
    # HBM per layer (0.27 ms at the path shape on an H100,
    # docs/performance.md). The same numbers.
    gate_BxLx1xF, up_BxLx1xF = jnp.split(h_BxLx2xF, 2, axis=2)
    h_BxLxF = nn.silu(gate_BxLx1xF[:, :, 0]) * up_BxLx1xF[:, :, 0]
    w_FxD = self.param(
        "down", _param_init(d.init_std / (2 * d.num_layers) ** 0.5,
                            ("mlp", "embed")),
        (d.mlp_dim, d.d_model), jnp.float32)
    return _matmul("blf,fd->bld", h_BxLxF, w_FxD.astype(dtype), d)


def constrain_activations(x_BxLxD):
  """Pins activations at block boundaries to the logical rules in context.

  A no-op unless a mesh is set (`jax.set_mesh`) while tracing; under
  `jax.vmap(..., spmd_axis_name='path')` the path axis is prepended.
  """
  mesh = jax.sharding.get_abstract_mesh()
  rules = nn.get_logical_axis_rules()
  if mesh.empty or not rules:
    return x_BxLxD
  spec = nn.logical_to_mesh_axes(("batch", "length", "act_embed"), rules)
  return jax.lax.with_sharding_constraint(x_BxLxD, spec)


class DecoderBlock(nn.Module):
  """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)).

  The second argument and result are the scan's per-layer input and
  output (`transformer.LayerStack`): None in training, the layer's
  `kv_cache.LayerCache` when decoding.
  """
  dims: ModelDims

  @nn.compact
  def __call__(self, x_BxLxD, cache=None):
    x_BxLxD = constrain_activations(x_BxLxD)
    attention = Attention(self.dims, name="attention")
    normed_BxLxD = RMSNorm(self.dims, name="attention_norm")(x_BxLxD)
    if cache is None:
      x_BxLxD = x_BxLxD + attention(normed_BxLxD)
    else:
      attended_BxLxD, cache = attention(normed_BxLxD, cache)
      x_BxLxD = x_BxLxD + attended_BxLxD
    x_BxLxD = x_BxLxD + GatedMlp(self.dims, name="mlp")(
        RMSNorm(self.dims, name="mlp_norm")(x_BxLxD))
    return constrain_activations(x_BxLxD), cache
