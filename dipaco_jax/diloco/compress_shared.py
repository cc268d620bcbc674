"""Low rank on one subspace per module, shared by its users:
`compression=lowrank_shared` (PowerSGD, Vogels et al. 2019, Algorithm 1
with error feedback), next to `lowrank`'s subspace per worker.

Why: with a subspace per worker each one spends its rank on its own noise,
and the module's mean of W rank-r pieces is a rank-Wr sum of directions
nobody agreed on. PowerSGD's users first agree on one basis P from their
mixed projections, then send their coordinates in it, so the mean is
exactly the rank-r approximation of the users' mean in that basis.

For one leaf (a matrix [m, n] in `compress_lowrank.matrix_shape`'s view),
module k, its users w with mixing weights a[w, k] (`outer.mix`'s), each
holding the module's warm start Q_k [n, r] and its error feedback e_w:

  M_w  = c_w + decay * e_w
  P_w  = M_w Q_k                     sent (exchange 1): m x r
  P_k  = sum_w a[w, k] P_w           every user receives it
  B_k  = orth(P_k)                   computed by every user alike
  Q_w  = M_w^T B_k                   sent (exchange 2): n x r
  s_w  = B_k Q_w^T                   worker w's contribution as sent
  e_w <- M_w - s_w
  Q_k <- sum_w a[w, k] Q_w           every user receives it: the next
                                     round's warm start

so outer.mix of the s_w is B_k (sum_w a[w, k] Q_w)^T, PowerSGD's decoded
mean. A worker sends (m + n) r values a round, as `lowrank` does at rank
r, and reads (m + n) r float32 values inside the round (P_k, then Q_k:
`compress_tree`'s read_W, counted in `inner.recv_bytes_W` beside the
modules read back). The rank is fixed (`compression_rank_max`): a shared basis has no
worker of its own to choose it (rank_min and energy are `lowrank`'s only).
With `compression_factor_bits` each factor column goes through the int8 /
int4 block codec before it is sent (P_w before the mix, Q_w before the
decode), and the error feedback keeps what their rounding lost.

A leaf of ndim < 2 is sent as float32 (a vector has no low rank). With
`spec.layer_axis` (a slot of stacked layers, `diloco.compression_matrix=
per_layer`) each layer of a leaf [L, ...] is a leaf of its own: a basis,
a warm start and a residual per layer.

Only the SPMD runtime applies it: the island runtime would need the two
exchanges as two store hops inside a round, and refuses it
(`islands/units.check_codecs`).
"""

import dataclasses
import math

import jax
import jax.numpy as jnp

from dipaco_jax.diloco import compress
from dipaco_jax.diloco import compress_lowrank as lowrank

_HIGHEST = jax.lax.Precision.HIGHEST


def _factor_codec(spec: compress.CompressionSpec):
  """The int codec of the factors' columns, or None for float32."""
  if not spec.factor_bits:
    return None
  return compress.make_codec(compress.CompressionSpec(
      name={8: "int8", 4: "int4"}[spec.factor_bits],
      block_size=spec.block_size))


def _as_sent(f_WxLxR, int_codec):
  """The factors as the receivers decode them: each column [L] through the
  int codec and back, per worker; float32 factors as they are."""
  if int_codec is None:
    return f_WxLxR
  def column(x_L):
    payload, _ = int_codec.encode(x_L, {})
    return int_codec.decode(payload, x_L.shape)
  return jax.vmap(jax.vmap(column, in_axes=1, out_axes=1))(f_WxLxR)


def factor_bytes(shape, rank: int, int_codec) -> float:
  """What one worker sends of a leaf in a round: both factors."""
  mn = lowrank.matrix_shape(shape)
  if mn is None:
    return 4.0 * math.prod(shape)
  if int_codec is None:
    return 4.0 * (mn[0] + mn[1]) * rank
  block, bits = int_codec.spec.block_size, int_codec.bits
  return float(sum(math.ceil(rank * length * bits / 8)
                   + 4 * rank * -(-length // block) for length in mn))


def mean_bytes(shape, rank: int) -> float:
  """What one worker reads of a leaf inside a round: its module's mean
  P_k and mean Q_k, float32 (a mean of integer codes is no longer one);
  nothing for a vector, whose mean comes with the modules read back."""
  mn = lowrank.matrix_shape(shape)
  return 0.0 if mn is None else 4.0 * (mn[0] + mn[1]) * rank


def init_state(shape, rank_max: int) -> dict:
  """A worker's copy of the module's warm start: {"q": [n, r]} (the same
  fixed-seed matrix for every worker, as `lowrank`'s), {} for a vector."""
  return lowrank.init_state(shape, rank_max)


def compress_leaf(spec: compress.CompressionSpec, c_W, residual_W, q_W,
                  a_WxK, experts_W):
  """One leaf [W, ...] of a slot: (sent [W, ...], residual, warm start
  q [W, n, r], bytes_W). `residual_W` None = zeros; `q_W` the workers'
  copies of their module's warm start; `a_WxK` the slot's mixing weights,
  `experts_W` each worker's module."""
  c_W = jnp.asarray(c_W, jnp.float32)
  if spec.layer_axis and c_W.ndim >= 3:
    # [W, L, ...]: each layer's matrix on a basis of its own, as PowerSGD
    # codes each weight alone; bytes summed over the layers.
    one_layer = dataclasses.replace(spec, layer_axis=False)
    sent, residual, q, bytes_LxW = jax.vmap(
        lambda c, r, q: compress_leaf(one_layer, c, r, q, a_WxK, experts_W),
        in_axes=1, out_axes=(1, 1, 1, 0))(c_W, residual_W, q_W)
    return sent, residual, q, bytes_LxW.sum(0)
  num_workers = c_W.shape[0]
  y_W = (c_W + spec.feedback_decay * residual_W
         if spec.error_feedback and residual_W is not None else c_W)
  mn = lowrank.matrix_shape(c_W.shape[1:])
  int_codec = _factor_codec(spec)
  if mn is None:  # Sent whole: nothing lost, nothing kept.
    nbytes = factor_bytes(c_W.shape[1:], 0, None)
    residual = jnp.zeros_like(y_W) if spec.error_feedback else residual_W
    return y_W, residual, q_W, jnp.full((num_workers,), nbytes, jnp.float32)
  m_WxMxN = y_W.reshape((num_workers,) + mn)
  a_WxK = jnp.asarray(a_WxK, jnp.float32)
  p_WxMxR = _as_sent(jnp.einsum("wmn,wnr->wmr", m_WxMxN, q_W,
                                precision=_HIGHEST), int_codec)
  p_KxMxR = jnp.einsum("wk,wmr->kmr", a_WxK, p_WxMxR, precision=_HIGHEST)
  basis_WxMxR = jax.vmap(lowrank.orthonormalize)(p_KxMxR)[experts_W]
  q_sent_WxNxR = _as_sent(jnp.einsum("wmn,wmr->wnr", m_WxMxN, basis_WxMxR,
                                     precision=_HIGHEST), int_codec)
  sent_WxMxN = jnp.einsum("wmr,wnr->wmn", basis_WxMxR, q_sent_WxNxR,
                          precision=_HIGHEST)
  sent_W = sent_WxMxN.reshape(c_W.shape)
  residual = y_W - sent_W if spec.error_feedback else residual_W
  # The module's mean Q is every user's next warm start; a column that came
  # out zero (a module without contributions this round) keeps its last
  # direction, as `lowrank.power_step` does.
  q_mean_WxNxR = jnp.einsum("wk,wnr->knr", a_WxK, q_sent_WxNxR,
                            precision=_HIGHEST)[experts_W]
  alive_Wx1xR = (jnp.square(q_mean_WxNxR).sum(1) > 0)[:, None, :]
  q_next_W = jnp.where(alive_Wx1xR, q_mean_WxNxR, q_W)
  nbytes = factor_bytes(c_W.shape[1:], q_W.shape[-1], int_codec)
  return (sent_W, residual, q_next_W,
          jnp.full((num_workers,), nbytes, jnp.float32))


def compress_tree(spec: compress.CompressionSpec, contribs: dict, residuals,
                  states, a_WxK, experts_W):
  """compress_leaf for every leaf of a slot's tree [W, ...]; `states` has
  the tree's structure with {"q": ...} (or {}) per leaf. Returns (sent,
  residuals, states, bytes sent [W], bytes read inside the round [W]:
  `mean_bytes`), as `compress_apply.compress_together` does."""
  leaves, treedef = jax.tree.flatten(contribs)
  res_in = ([None] * len(leaves) if residuals is None
            else treedef.flatten_up_to(residuals))
  st_in = treedef.flatten_up_to(states)
  sent, res_out, st_out = [], [], []
  num_workers = leaves[0].shape[0]
  bytes_W = jnp.zeros((num_workers,), jnp.float32)
  read = 0.0
  for c_W, res_W, st in zip(leaves, res_in, st_in):
    s, r, q, b = compress_leaf(spec, c_W, res_W, st.get("q"), a_WxK,
                               experts_W)
    sent.append(s)
    res_out.append(r)
    st_out.append({"q": q} if "q" in st else {})
    bytes_W = bytes_W + b
    if q is not None:
      layers, shape = ((c_W.shape[1], c_W.shape[2:]) if spec.layer_axis
                       and c_W.ndim >= 3 else (1, c_W.shape[1:]))
      read += layers * mean_bytes(shape, q.shape[-1])
  return (treedef.unflatten(sent),
          treedef.unflatten(res_out) if spec.error_feedback else residuals,
          treedef.unflatten(st_out), bytes_W,
          jnp.full((num_workers,), read, jnp.float32))
