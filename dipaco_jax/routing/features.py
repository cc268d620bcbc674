"""Routing features, computed from the first `prefix_len` tokens only.

The DiPaCo paper routes each document once, offline, on "the average of the
hidden state from the last transformer block from the initial LM over the
first 32 tokens". Without a base model yet, the mean token embedding of the
same prefix is used. `group_feature_sums` gives the same feature over later
windows of a document, for re-routing at evaluation time.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np


@functools.partial(jax.jit, static_argnums=0)
def _mean_hidden(model, params, tokens_BxT, mask_BxT):
  hidden_BxTxD = model.apply({"params": params}, tokens_BxT,
                             method=model.hidden_states).astype(jnp.float32)
  mask_BxT = mask_BxT.astype(jnp.float32)
  total_BxD = jnp.einsum("btd,bt->bd", hidden_BxTxD, mask_BxT)
  return total_BxD / jnp.maximum(mask_BxT.sum(1), 1.0)[:, None]


# Documents whose prefixes are read and featurized at a time: the memory of
# `prefix_features` beyond its [N, D] result stays at one block's.
FEATURE_BLOCK_DOCS = 65_536


def prefix_features(model, params, docs, prefix_len: int, kind: str,
                    batch_size: int = 64) -> np.ndarray:
  """[N, D] features of every document's first `prefix_len` tokens.

  Only `docs.prefixes(prefix_len)` is read, so nothing after the prefix can
  influence routing (tested); `FEATURE_BLOCK_DOCS` documents at a time.
  """
  if kind not in ("token_embedding", "base_hidden"):
    raise ValueError(f"config.routing.features: unknown {kind!r}")
  d = int(params["embed_head"]["embedding"].shape[-1])
  out_NxD = np.empty((len(docs), d), np.float32)
  for first in range(0, len(docs), FEATURE_BLOCK_DOCS):
    stop = min(first + FEATURE_BLOCK_DOCS, len(docs))
    block = docs if (first, stop) == (0, len(docs)) else docs.subset(
        np.arange(first, stop))
    out_NxD[first:stop] = _block_features(model, params, block, prefix_len,
                                          kind, batch_size)
  return out_NxD


def _block_features(model, params, docs, prefix_len, kind, batch_size):
  prefix_NxT, lengths_N = docs.prefixes(prefix_len)
  mask_NxT = np.arange(prefix_len)[None, :] < lengths_N[:, None]
  if kind == "token_embedding":
    table_VxD = np.asarray(params["embed_head"]["embedding"], np.float32)
    total_NxD = np.einsum("ntd,nt->nd", table_VxD[prefix_NxT], mask_NxT)
    return (total_NxD / np.maximum(mask_NxT.sum(1), 1)[:, None]).astype(
        np.float32)
  out = []
  for start in range(0, len(prefix_NxT), batch_size):
    tokens = prefix_NxT[start:start + batch_size]
    mask = mask_NxT[start:start + batch_size]
    pad = batch_size - len(tokens)
    if pad:  # Fixed shapes: compile once.
      tokens = np.concatenate([tokens, np.zeros((pad, prefix_len),
                                                tokens.dtype)])
      mask = np.concatenate([mask, np.zeros((pad, prefix_len), bool)])
    out.append(np.asarray(_mean_hidden(model, params, tokens, mask))[
        :batch_size - pad])
  return np.concatenate(out).astype(np.float32) if out else np.zeros(
      (0, int(params["embed_head"]["embedding"].shape[-1])), np.float32)


@functools.partial(jax.jit, static_argnums=(0, 5))
def _group_sums(model, params, inputs_BxL, group_BxL, acc_GxD, num_groups):
  hidden = model.apply({"params": params}, inputs_BxL,
                       method=model.hidden_states).astype(jnp.float32)
  ids = jnp.where(group_BxL < 0, num_groups, group_BxL).reshape(-1)
  sums = jax.ops.segment_sum(hidden.reshape(-1, hidden.shape[-1]), ids,
                             num_segments=num_groups + 1)
  return acc_GxD + sums[:num_groups]


def group_feature_sums(model, params, inputs_MxL, group_MxL,
                       num_groups: int, kind: str, batch_size: int = 64):
  """Sums of the routing feature over groups of input positions.

  Returns (sums [G, D], counts [G]); `group_MxL` names the group of every
  input position of every window (-1: none). For `base_hidden` the model
  sees each window in context, as it sees the prefix.
  """
  valid = group_MxL >= 0
  counts = np.bincount(group_MxL[valid], minlength=num_groups)
  d = int(params["embed_head"]["embedding"].shape[-1])
  if kind == "token_embedding":
    table_VxD = np.asarray(params["embed_head"]["embedding"], np.float32)
    sums = np.zeros((num_groups, d), np.float32)
    np.add.at(sums, group_MxL[valid], table_VxD[inputs_MxL[valid]])
    return sums, counts
  acc = jnp.zeros((num_groups, d), jnp.float32)
  for start in range(0, len(inputs_MxL), batch_size):
    inputs = inputs_MxL[start:start + batch_size]
    groups = group_MxL[start:start + batch_size]
    pad = batch_size - len(inputs)
    if pad:  # Fixed shapes: compile once.
      inputs = np.concatenate([inputs, np.zeros((pad,) + inputs.shape[1:],
                                                inputs.dtype)])
      groups = np.concatenate([groups, np.full((pad,) + groups.shape[1:], -1,
                                               groups.dtype)])
    acc = _group_sums(model, params, inputs, groups, acc, num_groups)
  return np.asarray(acc), counts
