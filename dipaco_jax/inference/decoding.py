"""The compiled parts of generation: prefill, one decoding step, sampling.

Each is jitted once for a generation's shapes (B rows, a cache of S
positions) and reused for every step, every path and every re-route: the
parameters are arguments, positions are traced values, and rows are
masked in or out (`update_B`) instead of being sliced. Rows are
right-padded: row b's text is tokens[b, :length_b].
"""

import functools

import jax
import jax.numpy as jnp

from dipaco_jax.model import kv_cache


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def prefill(model, params, caches, tokens_BxS, lengths_B, update_B):
  """Reads each row's whole text into its cache (from position 0) and
  returns (logits_BxV predicting position length_b, caches). Rows outside
  `update_B` keep their cache (another path decodes them)."""
  start_B = jnp.zeros(tokens_BxS.shape[:1], jnp.int32)
  hidden_BxSxD, new = model.apply({"params": params}, tokens_BxS, start_B,
                                  caches, method=model.decode)
  last_Bx1xD = jnp.take_along_axis(
      hidden_BxSxD, (lengths_B - 1)[:, None, None], axis=1)
  logits_Bx1xV = model.apply({"params": params}, last_Bx1xD,
                             method=model.logits)
  return (logits_Bx1xV[:, 0].astype(jnp.float32),
          kv_cache.keep_rows(new, caches, update_B))


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def step(model, params, caches, token_B, position_B, update_B):
  """Reads one token per row at `position_B`; returns (logits_BxV
  predicting position_B + 1, caches), rows outside `update_B` untouched."""
  hidden_Bx1xD, new = model.apply({"params": params}, token_B[:, None],
                                  position_B, caches, method=model.decode)
  logits_Bx1xV = model.apply({"params": params}, hidden_Bx1xD,
                             method=model.logits)
  return (logits_Bx1xV[:, 0].astype(jnp.float32),
          kv_cache.keep_rows(new, caches, update_B))


@jax.jit
def sample(logits_BxV, key, temperature, top_p):
  """The next token of each row: argmax at temperature 0, else a draw from
  softmax(logits / temperature) cut to the smallest set of tokens whose
  probability reaches `top_p` (nucleus sampling; 1 keeps every token)."""
  greedy_B = jnp.argmax(logits_BxV, axis=-1)
  scaled_BxV = logits_BxV / jnp.maximum(temperature, 1e-6)
  sorted_BxV = jnp.sort(scaled_BxV, axis=-1)[:, ::-1]
  probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
  # A token stays while the mass before it is under top_p: the first
  # always does.
  before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV
  kept_BxV = before_BxV < top_p
  threshold_Bx1 = jnp.min(jnp.where(kept_BxV, sorted_BxV, jnp.inf), axis=-1,
                          keepdims=True)
  nucleus_BxV = jnp.where(scaled_BxV >= threshold_Bx1, scaled_BxV, -jnp.inf)
  drawn_B = jax.random.categorical(key, nucleus_BxV, axis=-1)
  return jnp.where(temperature > 0, drawn_B, greedy_B).astype(jnp.int32)
