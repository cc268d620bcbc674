"""A path model: embedding+head and layer segments named after bank slots.

The parameter tree of `PathTransformer` is `{slot_name: slot_params}`: one
entry per slot of the topology (`dipaco_jax.paths`). A path's parameters are
gathered from the module bank slot by slot, so a path is an ordinary dense
decoder-only LM, and `PathTransformer` with a single layer segment *is* the
dense model.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from dipaco_jax.model import chunked_loss
from dipaco_jax.model import kv_cache
from dipaco_jax.model import layers
from dipaco_jax.model import pipelined

_REMAT_POLICIES = {
    "full": None,  # Save nothing: recompute the whole block.
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class EmbedHead(nn.Module):
  """Token embedding at the bottom, final norm and LM head at the top."""
  dims: layers.ModelDims

  def setup(self):
    d = self.dims
    # A tied table doubles as the head, so it is initialized at the head's
    # scale and the input side multiplies by sqrt(d_model) (as Gemma does).
    self.embedding = self.param(
        "embedding", nn.with_logical_partitioning(
            nn.initializers.normal(d.d_model ** -0.5 if d.tie_embeddings
                                   else 1.0), ("vocab", "embed")),
        (d.padded_vocab, d.d_model), jnp.float32)
    self.final_norm = layers.RMSNorm(d)
    if not d.tie_embeddings:
      self.head = self.param(
          "head", nn.with_logical_partitioning(
              nn.initializers.normal(d.d_model ** -0.5), ("embed", "vocab")),
          (d.d_model, d.padded_vocab), jnp.float32)

  def embed(self, tokens_BxL):
    x_BxLxD = jnp.take(self.embedding, tokens_BxL, axis=0)
    if self.dims.tie_embeddings:
      x_BxLxD = x_BxLxD * self.dims.d_model ** 0.5
    return x_BxLxD.astype(self.dims.compute_dtype)

  def head_inputs(self, x_BxLxD):
    """What the head multiplies: the final-normed hidden states and its
    float32 weight ([V, D] table when tied, else [D, V])."""
    weight = self.embedding if self.dims.tie_embeddings else self.head
    return self.final_norm(x_BxLxD), weight

  def logits(self, x_BxLxD):
    # Padding ids never occur: their logits are masked (head_logits).
    return chunked_loss.head_logits(*self.head_inputs(x_BxLxD), self.dims)

  def __call__(self, tokens_BxL):  # Only used by init.
    return self.logits(self.embed(tokens_BxL))


class LayerStack(nn.Module):
  """`num_layers` decoder blocks, scanned (parameters stacked on axis 0)."""
  dims: layers.ModelDims
  num_layers: int

  @nn.compact
  def __call__(self, x_BxLxD, cache=None):
    """The blocks in order; with `cache` (a `kv_cache.LayerCache` stacked
    over these layers) returns `(x, updated cache)`."""
    block = layers.DecoderBlock
    if self.dims.remat != "none":
      block = nn.remat(block, prevent_cse=not self.dims.scan_layers,
                       policy=_REMAT_POLICIES[self.dims.remat])
    if self.dims.scan_layers:
      # Parameters stay stacked on a leading `layers` axis either way;
      # unrolling the loop lets XLA schedule across layers (measured faster
      # on H200, docs/performance.md), a rolled loop compiles faster.
      unroll = self.dims.scan_unroll or self.num_layers
      stack = nn.scan(block, variable_axes={"params": 0},
                      split_rngs={"params": True}, length=self.num_layers,
                      unroll=min(unroll, self.num_layers),
                      metadata_params={nn.PARTITION_NAME: "layers"})
      # The cache is the scan's per-layer input and output (None in
      # training): layer i reads and returns row i of every leaf.
      x_BxLxD, cache = stack(self.dims, name="blocks")(x_BxLxD, cache)
      return x_BxLxD if cache is None else (x_BxLxD, cache)
    layer_caches = []
    for i in range(self.num_layers):
      mine = None if cache is None else jax.tree.map(lambda c, i=i: c[i],
                                                     cache)
      x_BxLxD, mine = block(self.dims, name=f"block_{i}")(x_BxLxD, mine)
      layer_caches.append(mine)
    if cache is None:
      return x_BxLxD
    return x_BxLxD, jax.tree.map(lambda *c: jnp.stack(c), *layer_caches)


class PathTransformer(nn.Module):
  """Decoder-only LM whose top-level parameters are the bank's slots.

  Attributes:
    dims: model shape.
    segments: ((slot_name, num_layers), ...) in depth order.
    embed_slot: name of the embedding+head slot.
    pipeline: run each segment as a GPipe pipeline (`model.pipelined`);
      the parameters are the same either way. None: plain, as for
      evaluation and decoding.
  """
  dims: layers.ModelDims
  segments: tuple[tuple[str, int], ...]
  embed_slot: str = "embed_head"
  pipeline: pipelined.Schedule | None = None

  def setup(self):
    self.embed_head = EmbedHead(self.dims, name=self.embed_slot)
    self.stacks = [LayerStack(self.dims, n, name=name)
                   for name, n in self.segments]

  def hidden_states(self, tokens_BxL):
    """The last block's output (before the final norm): routing features."""
    x_BxLxD = self.embed_head.embed(tokens_BxL)
    if self.pipeline is None or self.is_initializing():
      for stack in self.stacks:
        x_BxLxD = stack(x_BxLxD)
      return x_BxLxD
    split = [pipelined.split_stages(self.variables["params"][name],
                                    self.pipeline.stages)
             for name, _ in self.segments]
    if self.pipeline.kind == "circular":  # Segments of one length.
      # The schedule rematerializes each tick's stage as a whole, so its
      # blocks do not: at the model's policy, and with remat "none" keeping
      # the matmuls' outputs ("dots"), since keeping everything would keep
      # a copy of the lap's parameters per tick (`pipelined.circular`).
      plain = dataclasses.replace(self.dims, remat="none")
      policy = _REMAT_POLICIES[
          "dots" if self.dims.remat == "none" else self.dims.remat]
      x_BxLxD = pipelined.circular(
          self._stage_fn(self.segments[0][1], plain), split, x_BxLxD,
          self.pipeline, policy=policy)
    else:
      for (_, n), params in zip(self.segments, split):
        x_BxLxD = pipelined.gpipe(self._stage_fn(n), params, x_BxLxD,
                                  self.pipeline)
    return pipelined.spread_over_stages(x_BxLxD)

  def _stage_fn(self, segment_layers: int, dims=None):
    """One stage of a segment: a plain LayerStack of n/S layers, detached
    (parent=None) so that it is applied to its slice of a slot's parameters
    instead of becoming a submodule with its own."""
    stage = LayerStack(dims or self.dims,
                       segment_layers // self.pipeline.stages, parent=None)
    return lambda p, x: stage.apply({"params": p}, x)

  def __call__(self, tokens_BxL):
    return self.embed_head.logits(self.hidden_states(tokens_BxL))

  def decode(self, tokens_BxL, start_B, caches):
    """`hidden_states` of L new tokens per row at positions start_B ..
    start_B + L - 1, reading and extending `caches` ({slot:
    `kv_cache.LayerCache`}, `kv_cache.init`). Returns (hidden, caches);
    `logits` of the hidden states are then what `__call__` gives for the
    whole text at those positions (tests/test_generate.py)."""
    caches = kv_cache.with_start(caches, start_B)
    x_BxLxD = self.embed_head.embed(tokens_BxL)
    out = {}
    for (name, _), stack in zip(self.segments, self.stacks):
      x_BxLxD, out[name] = stack(x_BxLxD, caches[name])
    return x_BxLxD, out

  def logits(self, x_BxLxD):
    """Final norm and head of hidden states (`hidden_states`, `decode`)."""
    return self.embed_head.logits(x_BxLxD)

  def head_inputs(self, tokens_BxL):
    """The final-normed hidden states and the head's weight, for a loss
    that makes the logits itself (`chunked_loss.mean_cross_entropy`)."""
    return self.embed_head.head_inputs(self.hidden_states(tokens_BxL))


def segments_of(topology) -> tuple[tuple[str, int], ...]:
  return tuple((s.name, len(s.layers)) for s in topology.layer_slots)


def build_model(dims: layers.ModelDims, topology,
                pipeline: pipelined.Schedule | None = None
                ) -> PathTransformer:
  from dipaco_jax import paths  # pylint: disable=g-import-not-at-top
  return PathTransformer(dims, segments_of(topology), paths.EMBED_SLOT,
                         pipeline)
