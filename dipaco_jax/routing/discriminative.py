"""Discriminative routing: label documents by their best path, fit a router.

The DiPaCo paper's discriminative phase (section 2.4.2, App. 7.2.1):
1. score every router-data document under every path (summed negative
   log-likelihood of its tokens), label it with the best path;
2. fit a P-class linear logistic-regression router from the document feature
   to that label;
3. calibrate an additive bias so the router's argmax shares match the target
   document-to-path distribution (without it the least-populated paths get
   even fewer documents and can end up empty);
4. re-shard training and validation data with the router.

This module holds the pure math of steps 1-3 and the routing of step 4; the
pipeline composes them (it calls `calibrate_bias` and folds the bias into
`b_P`).
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

# Features with (near) zero spread are divided by 1 instead of ~0.
_MIN_STD = 1e-6


class LinearRouter(NamedTuple):
  """A linear router on standardized features.

  logits = ((x - mean_D) / std_D) @ w_DxP + b_P.
  """
  w_DxP: jax.Array
  b_P: jax.Array
  mean_D: jax.Array
  std_D: jax.Array


def best_path_labels(nll_NxP: jax.Array) -> jax.Array:
  """Best path per document: argmin over paths of the summed NLL (int32).

  Args:
    nll_NxP: negative log-likelihood of doc n under path p, already summed
      over tokens; an [N, P, T] per-token array is summed over T here.

  Returns:
    labels_N, int32; ties go to the lower path index.
  """
  nll = jnp.asarray(nll_NxP, jnp.float32)
  if nll.ndim == 3:
    nll = jnp.sum(nll, axis=-1)
  if nll.ndim != 2:
    raise ValueError(f"nll must be [N, P] or [N, P, T], got {nll.shape}.")
  return jnp.argmin(nll, axis=-1).astype(jnp.int32)


def router_logits(router: LinearRouter, x_NxD: jax.Array) -> jax.Array:
  """Logits_NxP of `router` for features x_NxD."""
  z_NxD = ((jnp.asarray(x_NxD, jnp.float32) - router.mean_D[None, :]) /
           router.std_D[None, :])
  logits_NxP = jnp.matmul(z_NxD, router.w_DxP,
                          precision=jax.lax.Precision.HIGHEST)
  return logits_NxP + router.b_P[None, :]


def _standardize(x_NxD):
  mean_D = jnp.mean(x_NxD, axis=0)
  std_D = jnp.std(x_NxD, axis=0)
  std_D = jnp.where(std_D > _MIN_STD, std_D, 1.0)
  return (x_NxD - mean_D[None, :]) / std_D[None, :], mean_D, std_D


def _adam_fit(z_NxD, w_DxP, b_P, loss_of_logits, l2, num_steps,
              learning_rate):
  """Full-batch Adam on loss_of_logits(z @ w + b) + l2/2 ||w||^2."""

  def loss_fn(params):
    w_DxP, b_P = params
    logits_NxP = jnp.matmul(z_NxD, w_DxP,
                            precision=jax.lax.Precision.HIGHEST) + b_P[None, :]
    # L2 on w only: penalizing the bias would pull shares towards uniform.
    return loss_of_logits(logits_NxP) + 0.5 * l2 * jnp.sum(jnp.square(w_DxP))

  opt = optax.adam(learning_rate)
  grad_fn = jax.grad(loss_fn)

  def step(_, carry):
    params, opt_state = carry
    updates, opt_state = opt.update(grad_fn(params), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  params = (w_DxP, b_P)
  params, _ = jax.lax.fori_loop(0, num_steps, step,
                                (params, opt.init(params)))
  return params


@functools.partial(jax.jit, static_argnames=("num_paths", "num_steps"))
def _fit(key, x_NxD, labels_N, num_paths, l2, num_steps, learning_rate):
  """Jitted body of `fit_linear_router`."""
  z_NxD, mean_D, std_D = _standardize(x_NxD)
  # The problem is convex, so the init only affects speed; start the bias at
  # the log label frequencies (the optimum of a bias-only model) and w small.
  counts_P = jnp.zeros((num_paths,), jnp.float32).at[labels_N].add(1.0)
  b_P = jnp.log((counts_P + 1.0) / (labels_N.shape[0] + num_paths))
  w_DxP = 1e-3 * jax.random.normal(key, (x_NxD.shape[1], num_paths))
  cross_entropy = lambda logits: jnp.mean(
      optax.softmax_cross_entropy_with_integer_labels(logits, labels_N))
  w_DxP, b_P = _adam_fit(z_NxD, w_DxP, b_P, cross_entropy, l2, num_steps,
                         learning_rate)
  return LinearRouter(w_DxP, b_P, mean_D, std_D)


@functools.partial(jax.jit, static_argnames=("num_steps",))
def _fit_expected_cost(key, x_NxD, cost_NxP, l2, num_steps, learning_rate):
  """Jitted body of `fit_linear_router_expected_cost`."""
  z_NxD, mean_D, std_D = _standardize(x_NxD)
  num_paths = cost_NxP.shape[1]
  w_DxP = 1e-3 * jax.random.normal(key, (x_NxD.shape[1], num_paths))
  # Start from the best constant choice: the bias prefers cheap paths.
  b_P = -jnp.mean(cost_NxP, axis=0) / (jnp.std(cost_NxP) + 1e-6)
  expected_cost = lambda logits: jnp.mean(jnp.sum(
      jax.nn.softmax(logits, axis=-1) * cost_NxP, axis=-1))
  w_DxP, b_P = _adam_fit(z_NxD, w_DxP, b_P, expected_cost, l2, num_steps,
                         learning_rate)
  return LinearRouter(w_DxP, b_P, mean_D, std_D)


def fit_linear_router_expected_cost(
    key: jax.Array, x_NxD: jax.Array, cost_NxP: jax.Array, l2: float = 1e-4,
    num_steps: int = 500, learning_rate: float = 0.05) -> LinearRouter:
  """A linear router trained on the cost of its choice, not on a label.

  Minimizes mean_n sum_p softmax(logits_n)_p cost_np + l2/2 ||w||^2: the
  expected cost of routing by the softmax, e.g. the excess NLL of each path
  over the best one. Unlike cross-entropy on best-path labels, a near-tie
  costs nearly nothing and a clear win counts in full, so the router is
  fit to the quantity the routed evaluation sums. Not convex; started from
  the best constant choice. Needs no share calibration.
  """
  x_NxD = jnp.asarray(x_NxD, jnp.float32)
  cost_NxP = jnp.asarray(cost_NxP, jnp.float32)
  if x_NxD.ndim != 2 or cost_NxP.ndim != 2 or (
      cost_NxP.shape[0] != x_NxD.shape[0]):
    raise ValueError(f"Need x [N, D] and cost [N, P], got {x_NxD.shape} and "
                     f"{cost_NxP.shape}.")
  return _fit_expected_cost(key, x_NxD, cost_NxP, jnp.float32(l2), num_steps,
                            jnp.float32(learning_rate))


def fit_linear_router(key: jax.Array, x_NxD: jax.Array, labels_N: jax.Array,
                      num_paths: int, l2: float = 1e-4, num_steps: int = 500,
                      learning_rate: float = 0.05) -> LinearRouter:
  """Multinomial logistic regression from features to path labels.

  Full-batch Adam on mean cross-entropy + l2/2 ||w||^2, features standardized
  with the stored mean/std. Does not calibrate the bias (see
  `calibrate_bias`).

  Args:
    key: PRNG key for the weight init.
    x_NxD: router features.
    labels_N: int path labels in [0, num_paths).
    num_paths: P (static); paths without any label are allowed.
    l2: weight-decay coefficient on w.
    num_steps: Adam steps (static).
    learning_rate: Adam learning rate.

  Returns:
    The fitted LinearRouter (float32).
  """
  x_NxD = jnp.asarray(x_NxD, jnp.float32)
  labels_N = jnp.asarray(labels_N, jnp.int32)
  if x_NxD.ndim != 2 or labels_N.shape != x_NxD.shape[:1]:
    raise ValueError(f"Need x [N, D] and labels [N], got {x_NxD.shape} and "
                     f"{labels_N.shape}.")
  return _fit(key, x_NxD, labels_N, num_paths, jnp.float32(l2), num_steps,
              jnp.float32(learning_rate))


def _argmax_shares(logits_NxP):
  p = logits_NxP.shape[-1]
  assign_N = jnp.argmax(logits_NxP, axis=-1)
  counts_P = jnp.zeros((p,), jnp.float32).at[assign_N].add(1.0)
  return counts_P / logits_NxP.shape[0]


@functools.partial(jax.jit, static_argnames=("num_iters",))
def _calibrate(logits_NxP, target_P, num_iters, step):
  n, _ = logits_NxP.shape
  # eps of half a document: an empty path's log-ratio stays bounded
  # (log(2 N target)) instead of log(target / 1e-9), which would overshoot.
  eps = 0.5 / n
  log_target_P = jnp.log(target_P + eps)
  needed_P = target_P > 0

  def error(shares_P):
    # L1 share error, plus a large penalty for starving a path that should
    # get documents: an empty path is the failure the bias exists to prevent.
    starved = jnp.sum(needed_P & (shares_P == 0))
    return jnp.sum(jnp.abs(shares_P - target_P)) + 10.0 * starved

  def body(i, carry):
    bias_P, best_bias_P, best_err = carry
    shares_P = _argmax_shares(logits_NxP + bias_P[None, :])
    err = error(shares_P)
    better = err < best_err
    best_bias_P = jnp.where(better, bias_P, best_bias_P)
    best_err = jnp.where(better, err, best_err)
    # Argmax shares are piecewise constant in the bias, so a fixed step can
    # cycle around the target; a decaying step settles it.
    lr = step / jnp.sqrt(1.0 + i / 10.0)
    bias_P = bias_P + lr * (log_target_P - jnp.log(shares_P + eps))
    return bias_P, best_bias_P, best_err

  zero_P = jnp.zeros((logits_NxP.shape[1],), jnp.float32)
  bias_P, best_bias_P, best_err = jax.lax.fori_loop(
      0, num_iters, body, (zero_P, zero_P, jnp.float32(jnp.inf)))
  # The last update has not been scored yet.
  last_err = error(_argmax_shares(logits_NxP + bias_P[None, :]))
  best_bias_P = jnp.where(last_err < best_err, bias_P, best_bias_P)
  # Only differences between biases matter; centre for readability.
  finite_P = jnp.where(needed_P, best_bias_P, 0.0)
  return best_bias_P - jnp.sum(finite_P) / jnp.maximum(jnp.sum(needed_P), 1)


def calibrate_bias(logits_NxP: jax.Array, target_shares_P: jax.Array,
                   num_iters: int = 200, step: float = 0.5) -> jax.Array:
  """An additive bias matching argmax shares of logits + bias to targets.

  Iterates bias += step_t * (log(target + eps) - log(share + eps)) with a
  decaying step_t, and returns the bias with the smallest L1 share error seen
  (a path with a positive target left empty counts as a large error).

  Args:
    logits_NxP: router logits of the documents to balance.
    target_shares_P: desired fraction of documents per path (normalized
      here); paths with target 0 are pushed towards no documents.
    num_iters: update iterations (static).
    step: initial step size, in logit units per unit of log-ratio.

  Returns:
    bias_P, float32, to be added to the router's b_P.
  """
  logits_NxP = jnp.asarray(logits_NxP, jnp.float32)
  target_P = jnp.asarray(target_shares_P, jnp.float32)
  if logits_NxP.ndim != 2 or target_P.shape != logits_NxP.shape[1:]:
    raise ValueError(f"Need logits [N, P] and targets [P], got "
                     f"{logits_NxP.shape} and {target_P.shape}.")
  target_P = target_P / jnp.sum(target_P)
  return _calibrate(logits_NxP, target_P, num_iters, jnp.float32(step))


@functools.partial(jax.jit, static_argnames=("k",))
def route_top_k(router: LinearRouter, x_NxD: jax.Array, k: int) -> jax.Array:
  """The k highest-logit paths per document, best first (int32)."""
  _, paths_Nxk = jax.lax.top_k(router_logits(router, x_NxD), k)
  return paths_Nxk.astype(jnp.int32)
