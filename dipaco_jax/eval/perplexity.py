"""Validation loss and perplexity over document windows.

Every token except the first `prefix_len` of each document is scored (the
DiPaCo paper's protocol: routing reads exactly those tokens). Windows come
from `data.batches.eval_windows`.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax


@functools.partial(jax.jit, static_argnums=0)
def _window_nll(model, params, inputs_BxL, targets_BxL, weights_BxL):
  logits_BxLxV = model.apply({"params": params}, inputs_BxL)
  nll_BxL = optax.softmax_cross_entropy_with_integer_labels(
      logits_BxLxV.astype(jnp.float32), targets_BxL)
  return (nll_BxL * weights_BxL).sum(-1), weights_BxL.sum(-1)


def window_nll(model, params, windows: dict, batch_size: int,
               rows: np.ndarray | None = None):
  """Summed NLL and scored-token count of each window (or of `rows`).

  Batches have a fixed shape (the last one padded with zero-weight rows) so
  the scorer compiles once.
  """
  rows = np.arange(len(windows["inputs"])) if rows is None else rows
  nll_M = np.zeros(len(rows), np.float64)
  count_M = np.zeros(len(rows), np.float64)
  for start in range(0, len(rows), batch_size):
    idx = rows[start:start + batch_size]
    pad = batch_size - len(idx)
    take = np.concatenate([idx, np.full(pad, idx[0])]) if pad else idx
    weights = windows["weights"][take].copy()
    if pad:
      weights[len(idx):] = 0.0
    nll, count = _window_nll(model, params, windows["inputs"][take],
                             windows["targets"][take], weights)
    nll_M[start:start + len(idx)] = np.asarray(nll)[:len(idx)]
    count_M[start:start + len(idx)] = np.asarray(count)[:len(idx)]
  return nll_M, count_M


def per_document(values_M, doc_index_M, num_docs: int):
  out = np.zeros(num_docs, np.float64)
  np.add.at(out, doc_index_M, values_M)
  return out


def summarize(nll_sum: float, count: float) -> dict:
  loss = nll_sum / max(count, 1.0)
  return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)),
          "tokens": int(count)}
