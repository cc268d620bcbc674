"""An inner step written out by hand, for the equivalence tests.

The tests that check the SPMD runtime against plain DiLoCo must not run the
code they check, so this file shares nothing with `train.state` or
`diloco.inner`: the loss, the gradient clipping, the warmup + cosine
learning rate and AdamW (Loshchilov & Hutter; optax's defaults eps=1e-8,
no decay on RMSNorm scales) are written from their definitions. Only the
Flax model's forward pass is shared.
"""

import math

import jax
import jax.numpy as jnp


def _loss(model, params, batch_BxLp1):
  inputs_BxL, targets_BxL = batch_BxLp1[:, :-1], batch_BxLp1[:, 1:]
  logits_BxLxV = model.apply({"params": params}, inputs_BxL).astype(
      jnp.float32)
  logp_BxLxV = jax.nn.log_softmax(logits_BxLxV)
  return -jnp.take_along_axis(logp_BxLxV, targets_BxL[..., None],
                              axis=-1).mean()


def learning_rate(inner_opt, num_steps: int, t):
  """Linear warmup from 0, then cosine to final_lr_fraction x peak."""
  peak = inner_opt.learning_rate
  warmup = min(inner_opt.warmup_steps, max(num_steps - 1, 0))
  decay = max(num_steps, warmup + 1) - warmup
  end_fraction = inner_opt.final_lr_fraction
  progress = jnp.minimum(t - warmup, decay) / decay
  cosine = peak * ((1 - end_fraction) * 0.5 * (
      1 + jnp.cos(math.pi * progress)) + end_fraction)
  return jnp.where(t < warmup, peak * t / max(warmup, 1), cosine)


def _decays(path) -> bool:
  return not any(getattr(k, "key", None) == "scale" for k in path)


def init(params):
  zeros = lambda: jax.tree.map(jnp.zeros_like, params)
  return {"t": jnp.zeros((), jnp.int32), "mu": zeros(), "nu": zeros()}


def make_step(model, inner_opt, num_steps: int):
  """step(params, opt, batch) -> (params, opt, loss) for AdamW or SGD."""

  def step(params, opt, batch_BxLp1):
    loss, grads = jax.value_and_grad(
        lambda p: _loss(model, p, batch_BxLp1))(params)
    if inner_opt.grad_clip > 0:
      norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
      factor = jnp.where(norm < inner_opt.grad_clip, 1.0,
                         inner_opt.grad_clip / norm)
      grads = jax.tree.map(lambda g: g * factor, grads)
    t = opt["t"]
    lr = learning_rate(inner_opt, num_steps, t)
    if inner_opt.name == "sgd":
      params = jax.tree.map(lambda p, g: p - lr * g, params, grads)
      return params, dict(opt, t=t + 1), loss
    b1, b2, eps = inner_opt.b1, inner_opt.b2, 1e-8
    mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, opt["mu"], grads)
    nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, opt["nu"],
                      grads)
    t1 = (t + 1).astype(jnp.float32)

    def update(path, p, m, v):
      adam = (m / (1 - b1 ** t1)) / (jnp.sqrt(v / (1 - b2 ** t1)) + eps)
      decay = inner_opt.weight_decay * p if _decays(path) else 0.0
      return p - lr * (adam + decay)

    params = jax.tree_util.tree_map_with_path(update, params, mu, nu)
    return params, {"t": t + 1, "mu": mu, "nu": nu}, loss

  return jax.jit(step)
