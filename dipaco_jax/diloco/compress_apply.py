"""A codec applied to what workers send (`compress.py`'s codecs): error
feedback, codec state, payload bytes; one leaf, or every leaf of
{slot: tree} vmapped over workers, or a module's users together for the
codecs that need the worker axis (`compress_together`). Used by the SPMD
simulation (`comm_step.py`) and the island workers (`islands/wire.py`).
"""

import functools

import jax
import jax.numpy as jnp

from dipaco_jax.diloco import compress
from dipaco_jax.diloco import compress_leader
from dipaco_jax.diloco import compress_shared


# Codecs whose workers encode each module together: (spec, contribs,
# residuals, states, a_WxK, experts_W) -> (sent, residuals, states, bytes
# sent [W], bytes read inside the upload [W]).
_TOGETHER = {"lowrank_shared": compress_shared.compress_tree,
             "leader_topk": compress_leader.compress_tree}


@functools.partial(jax.jit, static_argnums=0)  # codec: static
def compress_leaf(codec: compress.Codec, x, residual, state):
  """What one worker sends of one leaf.

  Returns (sent, residual, state, payload, bytes). With error feedback, the
  residual (None = zeros), times the feedback decay, is added before
  encoding and the new residual is what the codec lost; without, `residual` comes back as it was. A None
  state of a stateful codec starts from `init_state`.
  """
  x = jnp.asarray(x, jnp.float32)
  feedback = codec.spec.error_feedback
  y = (x + codec.spec.feedback_decay * residual
       if feedback and residual is not None else x)
  if state is None:
    state = codec.init_state(y) if codec.stateful else {}
  payload, state = codec.encode(y, state)
  sent = codec.decode(payload, y.shape)
  if feedback:
    residual = y - sent
  return sent, residual, state, payload, codec.payload_bytes(payload, y.shape)


def compress_tree(codec: compress.Codec, contribs: dict, residuals, states):
  """compress_leaf for every leaf [W, ...] of {slot: tree}, vmapped over W.

  `residuals` and `states` have the structure of `contribs` (a state is a
  dict per leaf), or are None (zeros; init_state). Returns (sent, residuals,
  states, bytes_W): residuals as given without error feedback, states None
  for a stateless codec given None, bytes_W [W] float32 each worker's
  payload bytes over all leaves.
  """
  leaves, treedef = jax.tree.flatten(contribs)
  none = [None] * len(leaves)
  res_in = none if residuals is None else treedef.flatten_up_to(residuals)
  st_in = none if states is None else treedef.flatten_up_to(states)

  def one(x, res, st):
    sent, res, st, _, nbytes = compress_leaf(codec, x, res, st)
    return sent, res, st, nbytes

  outs = [jax.vmap(one)(*args) for args in zip(leaves, res_in, st_in)]
  sent, res_out, st_out, bytes_L = (list(col) for col in zip(*outs))
  if codec.spec.error_feedback:
    residuals = treedef.unflatten(res_out)
  if states is not None or codec.stateful:
    states = treedef.unflatten(st_out)
  return treedef.unflatten(sent), residuals, states, sum(bytes_L)


def init_residuals(contribs_like):
  """Error-feedback buffers: float32 zeros of the contributions' shapes."""
  return jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32),
                      contribs_like)


def init_states(codec: compress.Codec, contribs_like):
  """Every worker's codec state, per leaf [W, ...] (arrays or shape structs):
  the same first state for every worker, broadcast over W."""
  def leaf_state(x):
    state = codec.init_state(jax.ShapeDtypeStruct(x.shape[1:], jnp.float32))
    return jax.tree.map(lambda s: jnp.broadcast_to(s, x.shape[:1] + s.shape),
                        state)
  leaves, treedef = jax.tree.flatten(contribs_like)
  return treedef.unflatten([leaf_state(x) for x in leaves])


def encodes_together(spec: compress.CompressionSpec) -> bool:
  return spec.name in _TOGETHER


def reads_while_sending(spec: compress.CompressionSpec) -> bool:
  """Whether a worker reads bytes inside its upload (`compress_together`'s
  read_W): leader_topk's non-leaders read the leader's indices,
  lowrank_shared's users their module's mean P and Q."""
  return spec.name in ("leader_topk", "lowrank_shared")


def compress_together(spec: compress.CompressionSpec, contribs: dict,
                      residuals, states, a_WxK, experts_W):
  """A slot's workers [W, ...] encoded module by module (`a_WxK` its mixing
  weights, `experts_W` each worker's module): as `_TOGETHER` says."""
  return _TOGETHER[spec.name](spec, contribs, residuals, states, a_WxK,
                              experts_W)


def float32_bytes_W(tree, num_workers: int):
  """float32 payload bytes per worker of an uncompressed tree [W, ...]."""
  per_worker = sum(x.size // num_workers for x in jax.tree.leaves(tree)) * 4
  return jnp.full((num_workers,), per_worker, jnp.float32)
