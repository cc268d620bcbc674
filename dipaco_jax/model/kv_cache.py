"""The key/value cache of decoding: what each attention layer keeps of the
text read so far, so that a new token costs one position, not the whole
text again.

One layer's cache is a `LayerCache`: the keys and values of S positions
per row, and `start_B`, the position where the current call's first token
goes. A call with L new tokens writes their keys and values at start_B ..
start_B + L - 1 and lets each attend to every position up to its own.
Whatever lies beyond (padding, or what an earlier text left there) is
masked out, so a cache is never cleared: a prefill is the same call with
start 0 over the whole text. Rows are independent, each at its own
position, so prompts of different lengths share one batch right-padded.

A model's cache is `{slot name: LayerCache}` with a leading layer axis on
every leaf, the same layout as the scanned layer parameters
(`transformer.LayerStack`).

Shapes: B rows, S cached positions, L new tokens, H heads, Dh head width,
N layers of a slot.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp


class LayerCache(NamedTuple):
  k_BxSxHxDh: jax.Array  # keys, rotary applied
  v_BxSxHxDh: jax.Array
  start_B: jax.Array  # int32: position of the call's first token per row


def positions(cache: LayerCache, length: int) -> jax.Array:
  """[B, L] positions of a call's L new tokens."""
  return cache.start_B[:, None] + jnp.arange(length, dtype=jnp.int32)[None, :]


def _write(cache_BxSxHxDh, new_BxLxHxDh, start_B):
  # dynamic_update_slice would clamp a start past S - L and write at the
  # wrong place; the caller sizes the cache for the whole text.
  return jax.vmap(lambda c, u, s: jax.lax.dynamic_update_slice_in_dim(
      c, u, s, axis=0))(cache_BxSxHxDh,
                        new_BxLxHxDh.astype(cache_BxSxHxDh.dtype), start_B)


def attend(q_BxLxHxDh, k_BxLxHxDh, v_BxLxHxDh, cache: LayerCache):
  """Writes the new keys and values into `cache`, then attends each new
  query to the cached positions up to its own. Returns (out, cache)."""
  k_BxSxHxDh = _write(cache.k_BxSxHxDh, k_BxLxHxDh, cache.start_B)
  v_BxSxHxDh = _write(cache.v_BxSxHxDh, v_BxLxHxDh, cache.start_B)
  query_BxL = positions(cache, q_BxLxHxDh.shape[1])
  key_S = jnp.arange(k_BxSxHxDh.shape[1], dtype=jnp.int32)
  visible_BxLxS = key_S[None, None, :] <= query_BxL[:, :, None]
  out_BxLxHxDh = jax.nn.dot_product_attention(
      q_BxLxHxDh, k_BxSxHxDh, v_BxSxHxDh, mask=visible_BxLxS[:, None])
  return out_BxLxHxDh, cache._replace(k_BxSxHxDh=k_BxSxHxDh,
                                      v_BxSxHxDh=v_BxSxHxDh)


def init(dims, segments, batch: int, size: int) -> dict:
  """An empty cache of `size` positions for `batch` rows of a model with
  `segments` ((slot name, layers), ...; `transformer.segments_of`)."""
  def zeros(num_layers):
    shape = (num_layers, batch, size, dims.num_heads, dims.head_dim)
    return LayerCache(jnp.zeros(shape, dims.compute_dtype),
                      jnp.zeros(shape, dims.compute_dtype),
                      jnp.zeros((num_layers, batch), jnp.int32))
  return {name: zeros(n) for name, n in segments}


def with_start(caches: dict, start_B) -> dict:
  """`caches` with every layer's next call starting at `start_B`."""
  start_B = jnp.asarray(start_B, jnp.int32)
  return {name: c._replace(start_B=jnp.broadcast_to(
      start_B[None, :], c.start_B.shape)) for name, c in caches.items()}


def keep_rows(new_caches: dict, old_caches: dict, update_B) -> dict:
  """`new_caches` in the rows where `update_B`, `old_caches` elsewhere
  (rows of a batch that another path decodes keep their own cache)."""
  def pick(new, old):
    where_B = update_B.reshape((1, -1) + (1,) * (new.ndim - 2))
    return jnp.where(where_B, new, old)
  return jax.tree.map(pick, new_caches, old_caches)
