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
in the state, the bytes each worker read `inner.recv_bytes_W`.
"""

import jax
import jax.numpy as jnp

from dipaco_jax.diloco import compress
from dipaco_jax.diloco import compress_apply


def publish(comm, copy_K, bank_K):
  """(the workers' new copy of a slot's modules, bytes read per module
  [K]): each module's change since the copy, g - p, encoded with the
  slot's download codec (`comm.download_spec`), and p <- p + decoded."""
  codec = compress.make_codec(comm.download_spec)
  change_K = jax.tree.map(lambda g, p: g.astype(jnp.float32) - p,
                          bank_K, copy_K)
  sent_K, _, _, bytes_K = compress_apply.compress_tree(codec, change_K,
                                                       None, None)
  return jax.tree.map(lambda p, d: (p + d).astype(p.dtype), copy_K,
                      sent_K), bytes_K
