"""The outer step, per module: pure functions of arrays.

Every H inner steps, for each slot s and expert e (a *module*):

  delta[s][e] = sum_w a[w, e] * (outer[s][e] - inner[s][w])   (1)
  a[w, e]     = c_w [assignment[w, s] == e] / sum_w' c_w' [assignment[w', s] == e]

with c_w the worker's weight (its shard size in tokens, paper Eq. 2-3, or 1),
optionally times sqrt(number of workers using the module) (paper section
2.7). The outer optimizer (optax; Nesterov by default) treats delta as a
gradient. Then every worker restarts from its modules' new outer parameters,
keeping its own AdamW state. Modules with no users get delta = 0.

The SPMD runtime calls these inside one jitted function; the island runtime
calls the same functions on modules loaded from checkpoints. No formula here
is written anywhere else.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax


def mixing_matrices(assignment_WxS: np.ndarray, weights_W: np.ndarray,
                    num_experts: list[int]) -> list[np.ndarray]:
  """The a[w, e] of Eq. (1) for each slot: [W, K_s], columns sum to 1 or 0."""
  weights_W = np.asarray(weights_W, np.float64)
  if (weights_W < 0).any() or not weights_W.any():
    raise ValueError(f"worker weights must be >= 0, not all 0: {weights_W}")
  out = []
  for s, k in enumerate(num_experts):
    onehot_WxK = (assignment_WxS[:, s][:, None] == np.arange(k)[None, :])
    mass_WxK = onehot_WxK * weights_W[:, None]
    total_K = mass_WxK.sum(0)
    out.append((mass_WxK / np.where(total_K > 0, total_K, 1.0)).astype(
        np.float32))
  return out


def users_per_module(assignment_WxS: np.ndarray,
                     num_experts: list[int]) -> list[np.ndarray]:
  """How many workers use each module: [K_s] per slot."""
  return [np.bincount(assignment_WxS[:, s], minlength=k).astype(np.float32)
          for s, k in enumerate(num_experts)]


def _expand(v_K, leaf):
  return v_K.reshape(v_K.shape + (1,) * (leaf.ndim - 1))


def pseudo_gradients(outer_bank: dict, inner_params: dict, slot_names,
                     mixing: list, users: list,
                     rescale_by_sqrt_users: bool) -> dict:
  """Eq. (1) for every slot. Trees are {slot: params}; bank leaves [K, ...],
  inner leaves [W, ...]."""
  deltas = {}
  for s, name in enumerate(slot_names):
    a_WxK = jnp.asarray(mixing[s])
    scale_K = jnp.asarray(users[s])
    scale_K = jnp.where(scale_K > 0, jnp.sqrt(scale_K), 0.0) if (
        rescale_by_sqrt_users) else (scale_K > 0).astype(jnp.float32)

    def slot_delta(outer_K, inner_W, a_WxK=a_WxK, scale_K=scale_K):
      # The weighted mean of the workers' copies; HIGHEST keeps float32 on
      # GPUs, whose default matmul precision would round to TF32.
      mean_K = jnp.einsum("wk,w...->k...", a_WxK, inner_W.astype(jnp.float32),
                          precision=jax.lax.Precision.HIGHEST)
      return (outer_K - mean_K) * _expand(scale_K, outer_K)

    deltas[name] = jax.tree.map(slot_delta, outer_bank[name],
                                inner_params[name])
  return deltas


def gather_workers(bank: dict, assignment_WxS, slot_names) -> dict:
  """Each worker's copy of its modules: bank [K, ...] -> inner [W, ...]."""
  return {name: jax.tree.map(lambda x, s=s: x[assignment_WxS[:, s]],
                             bank[name])
          for s, name in enumerate(slot_names)}


def outer_update(outer_bank, outer_opt_state, inner_params, tx, *,
                 assignment_WxS, slot_names, mixing, users,
                 rescale_by_sqrt_users):
  """One outer step. Returns (outer_bank, outer_opt_state, inner_params)."""
  deltas = pseudo_gradients(outer_bank, inner_params, slot_names, mixing,
                            users, rescale_by_sqrt_users)
  updates, outer_opt_state = tx.update(deltas, outer_opt_state, outer_bank)
  outer_bank = optax.apply_updates(outer_bank, updates)
  restarted = gather_workers(outer_bank, assignment_WxS, slot_names)
  return outer_bank, outer_opt_state, restarted


def outer_optimizer(diloco_config) -> optax.GradientTransformation:
  """The outer optimizer named by `config.diloco` (an optax transform)."""
  name, lr = diloco_config.outer_optimizer, diloco_config.outer_lr
  momentum = diloco_config.outer_momentum
  if name == "nesterov":
    return optax.sgd(lr, momentum=momentum, nesterov=True)
  if name == "sgd":
    return optax.sgd(lr, momentum=momentum or None)
  if name == "adam":
    # DiLoCo's appendix: Adam as outer optimizer needs a large epsilon.
    return optax.adam(lr, b1=momentum, eps=0.1)
  raise ValueError(f"config.diloco.outer_optimizer: unknown {name!r}")
