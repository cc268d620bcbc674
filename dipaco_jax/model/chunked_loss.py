"""The LM head's logits, and the next-token loss computed chunk by chunk.

At the paper's path shape the head's output is the step's largest tensor:
[B, L, V] logits (16 x 1024 x 32000), kept for the backward pass and made
again as their gradient. `mean_cross_entropy` never holds it: it splits the
sequence into chunks of C positions and, for each, makes the chunk's logits,
their cross-entropy (`model/cross_entropy.py`, as the unchunked loss) and
drops them. Each chunk is a `jax.checkpoint`, so the backward pass
recomputes the chunk's logits from the normed hidden states instead of
keeping them: the head's forward matmul runs twice (2 x D x V more FLOPs
per token, about 6% of the step at the path shape), for memory that no
longer grows with L x V.

Chunks run over the sequence axis, not over flattened tokens, so that the
batch axis keeps its sharding (`batch` over data/fsdp) inside every chunk.
A sequence that C does not divide ends with one shorter chunk.

Numerics: each token's logits are the same operations as the unchunked
head's (`head_logits`, compute dtype, then float32); only the order of the
final sum differs, and the head's weight gradient is summed over chunks in
float32 instead of over all tokens inside one matmul (tests/
test_chunked_loss.py states the tolerance).
"""

import functools

import jax
import jax.numpy as jnp

from dipaco_jax.model import cross_entropy

# Sits in the op names of the loss's trace events (bench/step_profile.py).
SCOPE = "output_layer_loss"


def head_logits(normed_BxLxD, weight, dims):
  """The head's logits of final-normed hidden states, in compute dtype.

  `weight` is float32: the embedding table [V, D] when tied, else the head
  [D, V]. Padding ids get a large negative logit, so the softmax (and the
  loss) equal those of the unpadded vocabulary.
  """
  dtype = dims.compute_dtype
  if dims.tie_embeddings:
    logits_BxLxV = jnp.einsum("bld,vd->blv", normed_BxLxD,
                              weight.astype(dtype))
  else:
    logits_BxLxV = jnp.einsum("bld,dv->blv", normed_BxLxD,
                              weight.astype(dtype))
  if dims.padded_vocab == dims.vocab_size:
    return logits_BxLxV
  real_V = jnp.arange(dims.padded_vocab) < dims.vocab_size
  return jnp.where(real_V, logits_BxLxV,
                   jnp.asarray(-1e9, logits_BxLxV.dtype))


def _loss_sum(weight, normed_BxCxD, targets_BxC, dims):
  """Summed cross-entropy of one chunk (its logits live only in here)."""
  logits_BxCxV = head_logits(normed_BxCxD, weight, dims)
  return cross_entropy.summed_cross_entropy(logits_BxCxV, targets_BxC)


def mean_cross_entropy(normed_BxLxD, weight, targets_BxL, dims,
                       chunk: int):
  """Mean next-token cross-entropy, `chunk` positions of every row at a time.

  Args:
    normed_BxLxD: final-normed hidden states (`PathTransformer.head_inputs`).
    weight: the head's float32 weight (`head_logits`). It enters each chunk
      in float32, so that its gradient is accumulated over chunks in float32.
    targets_BxL: the next tokens.
    dims: the model's `layers.ModelDims`.
    chunk: positions per chunk (> 0); the last chunk may be shorter.
  """
  batch, length, width = normed_BxLxD.shape
  num_full = length // chunk
  loss_sum = functools.partial(_loss_sum, dims=dims)
  with jax.named_scope(SCOPE):
    total = jnp.zeros((), jnp.float32)
    if num_full:
      # Inside a loop the recomputation cannot be merged away, so
      # prevent_cse (which costs fusion) is not needed (jax.checkpoint docs).
      body = jax.checkpoint(loss_sum, prevent_cse=False)
      full = num_full * chunk
      normed_NxBxCxD = jnp.moveaxis(normed_BxLxD[:, :full].reshape(
          batch, num_full, chunk, width), 1, 0)
      targets_NxBxC = jnp.moveaxis(targets_BxL[:, :full].reshape(
          batch, num_full, chunk), 1, 0)
      sums_N = jax.lax.map(lambda xs: body(weight, *xs),
                           (normed_NxBxCxD, targets_NxBxC))
      total = total + sums_N.sum()
    if length % chunk:
      rest = num_full * chunk
      total = total + jax.checkpoint(loss_sum)(
          weight, normed_BxLxD[:, rest:], targets_BxL[:, rest:])
    return total / (batch * length)
