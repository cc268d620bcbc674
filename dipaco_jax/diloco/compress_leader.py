"""Chunked top-k on one support per module: `compression=leader_topk`
(ScaleCom's cyclic local top-k, Chen et al., NeurIPS 2020).

Why: with top-k on every worker each one keeps its own coordinates, so a
module's change covers its users' supports together, up to `users` times
one worker's, and a download carrying it must be that much denser than an
upload. Here a module's users send on ONE support a round, the leader's:

  leader of module k in round r: its (r mod n_k)-th user, by worker order
                                 (users: workers with a[w, k] > 0)
  y_w   = c_w + decay * e_w      (error feedback, as every codec's)
  I_k   = the leader's top-k indices of |y| per chunk (`compress_topk`'s)
  s_w   = Q(y_w at I_k)          every user: its own values there, with
                                 topk's 2-bit rule (`compress_topk.quantize`)
  e_w  <- y_w - s_w

so a module's change this round has one worker's support, and the leader's
payload is chunked topk's, bit for bit. The aggregate is the dense mean
over users (`comm.py` gives every codec but topk the mean; on one shared
support `senders` would differ only where a value is coded as 0).

Bytes a round, per leaf of M chunks keeping k each: the leader sends
indices, codes and scales (topk's: ceil(M k b / 8) + ceil(M k 2 / 8) + 8 M
for b = ceil(log2(chunk)) index bits); every other worker sends codes and
scales only and reads the leader's indices, ceil(M k b / 8), counted as
bytes read (`inner.recv_bytes_W`).

A worker of weight 0 is never a leader; it still encodes on its module's
leader's support (its values are weighted 0). A module without users has
no leader: its workers keep their own top-k. The round is the codec state
(as `strided`'s), per leaf and worker; only the SPMD runtime applies the
codec: islands would need the leader's indices as a store hop inside a
round, and refuse it (`islands/units.check_codecs`).
"""

import jax
import jax.numpy as jnp

from dipaco_jax.diloco import compress_spec
from dipaco_jax.diloco import compress_topk


def leaders(round_W, a_WxK, experts_W):
  """Each worker's module's leader this round, a worker index [W] (traced
  rounds and weights): the user of rank round mod n_users among the
  module's users by worker order; a worker whose module has no user leads
  itself."""
  experts_W = jnp.asarray(experts_W, jnp.int32)
  a_W = jnp.take_along_axis(jnp.asarray(a_WxK), experts_W[:, None],
                            axis=1)[:, 0]
  # Row w: the users of w's module.
  users_WxW = ((experts_W[:, None] == experts_W[None, :])
               & (a_W > 0)[None, :])
  num_users_W = users_WxW.sum(axis=1)
  rank_WxW = jnp.cumsum(users_WxW, axis=1) - 1
  turn_W = jnp.asarray(round_W, jnp.int32) % jnp.maximum(num_users_W, 1)
  leads_WxW = users_WxW & (rank_WxW == turn_W[:, None])
  return jnp.where(num_users_W > 0, jnp.argmax(leads_WxW, axis=1),
                   jnp.arange(experts_W.shape[0]))


def leaf_bytes(n: int, chunk: int, fraction: float,
               index_code: str = "fixed") -> tuple[int, int]:
  """(the indices' bytes, the codes' and scales' bytes) of one worker's
  leaf of n entries; the leader sends both, the others the second."""
  _, m, k = compress_topk.layout(n, chunk, fraction)
  return (compress_topk.index_bytes(n, chunk, fraction, index_code),
          -(-m * k * 2 // 8) + 8 * m)


def compress_leaf(spec: compress_spec.CompressionSpec, c_W, residual_W,
                  round_W, a_WxK, experts_W):
  """One leaf [W, ...] of a slot: (sent [W, ...], residual, next round
  [W], bytes sent [W], bytes read [W]). `residual_W` None = zeros;
  `round_W` each worker's round; `a_WxK` the slot's mixing weights,
  `experts_W` each worker's module."""
  c_W = jnp.asarray(c_W, jnp.float32)
  num_workers = c_W.shape[0]
  y_W = (c_W + spec.feedback_decay * residual_W
         if spec.error_feedback and residual_W is not None else c_W)
  n = y_W[0].size
  chunk, fraction = spec.topk_chunk, spec.topk_fraction
  _, _, k = compress_topk.layout(n, chunk, fraction)
  y_WxMxC = jax.vmap(lambda y: compress_topk.chunks(
      y.reshape(-1), chunk, fraction))(y_W)
  _, own_idx_WxMxK = jax.lax.top_k(jnp.abs(y_WxMxC), k)
  leader_W = leaders(round_W, a_WxK, experts_W)
  # Only the leader's int32 indices cross workers, never its values.
  idx_WxMxK = jnp.take(own_idx_WxMxK.astype(jnp.int32), leader_W, axis=0)
  code_WxMxK, scales_WxMx2 = jax.vmap(compress_topk.quantize)(
      jnp.take_along_axis(y_WxMxC, idx_WxMxK, axis=2))
  payload = {"idx": idx_WxMxK, "code": code_WxMxK, "scales": scales_WxMx2}
  sent_W = jax.vmap(lambda p: compress_topk.decode(p, n, chunk))(
      payload).reshape(c_W.shape)
  residual = y_W - sent_W if spec.error_feedback else residual_W
  index_bytes, value_bytes = leaf_bytes(n, chunk, fraction, spec.index_code)
  leads_W = leader_W == jnp.arange(num_workers)
  sent_bytes_W = value_bytes + jnp.where(leads_W, float(index_bytes), 0.0)
  read_bytes_W = jnp.where(leads_W, 0.0, float(index_bytes))
  return (sent_W, residual, jnp.asarray(round_W, jnp.int32) + 1,
          sent_bytes_W.astype(jnp.float32),
          read_bytes_W.astype(jnp.float32))


def compress_tree(spec: compress_spec.CompressionSpec, contribs: dict,
                  residuals, states, a_WxK, experts_W):
  """compress_leaf for every leaf of a slot's tree [W, ...]; `states` has
  the tree's structure with {"round": [W]} per leaf (None: round 0).
  Returns (sent, residuals, states, bytes sent [W], bytes read [W])."""
  leaves, treedef = jax.tree.flatten(contribs)
  num_workers = leaves[0].shape[0]
  none = [None] * len(leaves)
  res_in = none if residuals is None else treedef.flatten_up_to(residuals)
  st_in = none if states is None else treedef.flatten_up_to(states)
  sent, res_out, st_out = [], [], []
  sent_W = read_W = jnp.zeros((num_workers,), jnp.float32)
  for c_W, res_W, st in zip(leaves, res_in, st_in):
    round_W = (jnp.zeros((num_workers,), jnp.int32) if st is None
               else st["round"])
    s, r, next_round_W, b, rb = compress_leaf(spec, c_W, res_W, round_W,
                                              a_WxK, experts_W)
    sent.append(s)
    res_out.append(r)
    st_out.append({"round": next_round_W})
    sent_W, read_W = sent_W + b, read_W + rb
  return (treedef.unflatten(sent),
          treedef.unflatten(res_out) if spec.error_feedback else residuals,
          treedef.unflatten(st_out), sent_W, read_W)
