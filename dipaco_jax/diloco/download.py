"""Compressed downloads (`diloco.download_compression`, delay none or
overlap; ours, in the spirit of bidirectional compression with error
feedback, e.g. DoubleSqueeze, Tang et al. 2019).

What the workers read back after an outer step is not the new global
modules g but the change of their copy p of them, encoded with a block
codec C_d (one broadcast per module):

  p   <- p + C_d(g - p)                   (after the outer step)
  x_w <- p[e(w)],  c_w = p[e(w)] - x_w    (rounds start from the copy)

g stays the model of record (evaluation, checkpoints' bank); what C_d
dropped stays in g - p and is sent with the next round's change, so p
trails g by one round's quantization error, not more. With `overlap` the
apply reads p in g's place: x_w <- x_w + (p[e(w)] - h_w), a_w <- p[e(w)]
(`overlap_step.py`); the flush at the end of training restarts everyone
from g itself (p = g, `comm_step.flush`). The copy is `outer.published`
in the state, the bytes each worker read `inner.recv_bytes_W`, and a
stateful download codec's state (strided's round) `outer.published_state`.
"""

import jax
import jax.numpy as jnp

from dipaco_jax.diloco import compress
from dipaco_jax.diloco import compress_apply


def init_outer(comms: dict, bank: dict) -> dict:
  """What compressed downloads add to the outer state: the workers' copy,
  equal to the global modules at first (`published`), and a stateful
  codec's state (`published_state`); {} without compressed downloads."""
  codecs = {n: compress.make_codec(c.download_spec)
            for n, c in comms.items() if c.download != "none"}
  outer = {}
  if codecs:
    outer["published"] = {n: jax.tree.map(jnp.copy, bank[n]) for n in codecs}
  stateful = {n: c for n, c in codecs.items() if c.stateful}
  if stateful:
    outer["published_state"] = {
        n: compress_apply.init_states(c, bank[n]) for n, c in stateful.items()}
  return outer


def publish_slot(outer, new_outer, comm, name: str, bank_K):
  """`publish` of slot `name` in the outer state: sets the workers' new
  copy, and a stateful codec's state, in `new_outer`; returns (the copy,
  bytes read per module [K])."""
  copy_K, recv_K, state_K = publish(
      comm, outer["published"][name], bank_K,
      outer.get("published_state", {}).get(name))
  new_outer["published"][name] = copy_K
  if state_K is not None:
    new_outer["published_state"][name] = state_K
  return copy_K, recv_K


def publish(comm, copy_K, bank_K, state_K=None):
  """(the workers' new copy of a slot's modules, bytes read per module
  [K], the codec's new state or None): each module's change since the
  copy, g - p, encoded with the slot's download codec
  (`comm.download_spec`), and p <- p + decoded."""
  codec = compress.make_codec(comm.download_spec)
  change_K = jax.tree.map(lambda g, p: g.astype(jnp.float32) - p,
                          bank_K, copy_K)
  sent_K, _, state_K, bytes_K = compress_apply.compress_tree(
      codec, change_K, None, state_K)
  return jax.tree.map(lambda p, d: (p + d).astype(p.dtype), copy_K,
                      sent_K), bytes_K, state_K
