"""The outer step, per module: a chain of small pure functions of arrays.

Every H inner steps, for each slot s and expert e (a *module*):

  contribution  c[w][s] = outer[s][e(w, s)] - inner[s][w]             (1)
  (compress     what worker w sends: c itself here; DiLoCoX's codecs
                and delays are `diloco/comm_step.py`, built from these same
                functions)
  mix           delta[s][e] = r[s][e] * sum_w a[w, e] c[w][s]            (2)
                a[w, e] = c_w [e(w, s) == e] / sum_w' c_w' [e(w', s) == e]
  optimize      outer[s], state[s] <- outer optimizer(delta[s])   (optax)
  restart       inner[s][w] = outer[s][e(w, s)]

with e(w, s) = assignment[w, s] the expert of slot s that worker w uses,
c_w the worker's weight (its shard size in tokens, paper Eq. 2-3, or 1; 0
for a worker that is missing this round) and r the optional sqrt(number of
weighted users) rescaling (paper section 2.7), else 1. A module whose users
all have weight 0 (or that has no users) is *frozen*: delta = 0, and its
parameters and optimizer state (momentum) stay as they are, since a zero
pseudo-gradient alone would still move it by its momentum.

The weights are traced arrays, so a worker dropping out (weight 0) does not
recompile a jitted step. The outer optimizer state is held per slot,
`{slot: tx.init(bank[slot])}`, so one module's executor can own its state.
Every optimizer here is elementwise, so this equals one update of the whole
bank.

The SPMD runtime calls the whole chain (`outer_update`) inside one jitted
step; the island runtime calls `contributions` and `compress` in a worker
and the rest in the module's outer executor. No formula here is written
anywhere else.
"""


import jax
import jax.numpy as jnp
import numpy as np
import optax

def check_weights(weights_W) -> np.ndarray:
  """The worker weights as float64, or a clear error."""
  weights_W = np.asarray(weights_W, np.float64)
  if (weights_W < 0).any() or not weights_W.any():
    raise ValueError(f"worker weights must be >= 0, not all 0: {weights_W}")
  return weights_W


def _onehot_WxK(assignment_W, num_experts: int):
  return (jnp.asarray(assignment_W)[:, None] ==
          jnp.arange(num_experts)[None, :]).astype(jnp.float32)


def mixing_matrices(assignment_WxS, weights_W, num_experts: list[int]
                    ) -> list[jax.Array]:
  """The a[w, e] of Eq. (2) for each slot: [W, K_s]; a column sums to 1, or
  to 0 for a module with no weighted user. `weights_W` may be traced."""
  weights_W = jnp.asarray(weights_W, jnp.float32)
  out = []
  for s, k in enumerate(num_experts):
    mass_WxK = _onehot_WxK(assignment_WxS[:, s], k) * weights_W[:, None]
    total_K = mass_WxK.sum(0)
    out.append(mass_WxK / jnp.where(total_K > 0, total_K, 1.0)[None, :])
  return out


def users_per_module(assignment_WxS, weights_W, num_experts: list[int]
                     ) -> list[jax.Array]:
  """How many workers with weight > 0 use each module: [K_s] per slot."""
  present_W = (jnp.asarray(weights_W) > 0).astype(jnp.float32)
  return [(_onehot_WxK(assignment_WxS[:, s], k) * present_W[:, None]).sum(0)
          for s, k in enumerate(num_experts)]


def _expand(v_K, leaf):
  """[K] -> [K, 1, ...] to broadcast against a leaf [K, ...]."""
  return v_K.reshape(v_K.shape + (1,) * (leaf.ndim - 1))


def gather_workers(bank: dict, assignment_WxS, slot_names) -> dict:
  """Each worker's copy of its modules: bank [K, ...] -> inner [W, ...]."""
  return {name: jax.tree.map(lambda x, s=s: x[assignment_WxS[:, s]],
                             bank[name])
          for s, name in enumerate(slot_names)}


def contributions(outer_bank: dict, inner_params: dict, assignment_WxS,
                  slot_names) -> dict:
  """Eq. (1): what each worker moved its modules by, outer - inner, in
  float32: {slot: leaves [W, ...]}."""
  start = gather_workers(outer_bank, assignment_WxS, slot_names)
  return {name: jax.tree.map(
      lambda o, i: o.astype(jnp.float32) - i.astype(jnp.float32),
      start[name], inner_params[name]) for name in slot_names}


def mix(contribs: dict, slot_names, mixing: list, users: list,
        rescale_by_sqrt_users: bool, aggregates=None) -> dict:
  """Eq. (2): each module's pseudo-gradient from its users' contributions:
  {slot: leaves [W, ...]} -> {slot: leaves [K, ...]}.

  `aggregates[s]` ("mean" when None): "senders" averages each coordinate
  over the users whose contribution is nonzero there, with the same
  weights renormalized (SparseLoCo's reference aggregation of top-k
  payloads: a coordinate one user of eight sent moves by that user's value,
  not by an eighth of it); a coordinate no user sent stays 0."""
  deltas = {}
  for s, name in enumerate(slot_names):
    a_WxK = jnp.asarray(mixing[s], jnp.float32)
    users_K = jnp.asarray(users[s], jnp.float32)
    scale_K = (jnp.sqrt(users_K) if rescale_by_sqrt_users
               else (users_K > 0).astype(jnp.float32))
    senders = aggregates is not None and aggregates[s] == "senders"

    def slot_delta(c_W, a_WxK=a_WxK, scale_K=scale_K, senders=senders):
      # HIGHEST keeps float32 on GPUs, whose default matmul precision would
      # round to TF32.
      mean_K = jnp.einsum("wk,w...->k...", a_WxK, c_W,
                          precision=jax.lax.Precision.HIGHEST)
      if senders:
        # The weight of the users that sent each coordinate, against the
        # weight of all (1 for a used module): the mean over senders.
        sent_K = jnp.einsum("wk,w...->k...", a_WxK,
                            (c_W != 0).astype(jnp.float32),
                            precision=jax.lax.Precision.HIGHEST)
        total_K = _expand(a_WxK.sum(axis=0), mean_K)
        mean_K = jnp.where(sent_K > 0,
                           mean_K * total_K / jnp.where(sent_K > 0, sent_K,
                                                        1.0), 0.0)
      return mean_K * _expand(scale_K, mean_K)

    deltas[name] = jax.tree.map(slot_delta, contribs[name])
  return deltas


def pseudo_gradients(outer_bank: dict, inner_params: dict, assignment_WxS,
                     slot_names, mixing: list, users: list,
                     rescale_by_sqrt_users: bool) -> dict:
  """Contributions, then mixing, without compression: Eq. (1)-(2)."""
  return mix(contributions(outer_bank, inner_params, assignment_WxS,
                           slot_names),
             slot_names, mixing, users, rescale_by_sqrt_users)


def init_outer_opt_state(tx: optax.GradientTransformation,
                         bank: dict) -> dict:
  """The outer optimizer's state, per slot: {slot: tx.init(bank[slot])}."""
  return {name: tx.init(params) for name, params in bank.items()}


def optimize(tx: optax.GradientTransformation, bank: dict, opt_state: dict,
             deltas: dict, active: dict) -> tuple[dict, dict]:
  """The outer optimizer, slot by slot, treating `deltas` as gradients.

  `active` is {slot: bool [K]}: a module that is not active keeps its
  parameters and its optimizer state. Returns (bank, opt_state).
  """
  new_bank, new_state = {}, {}
  for name, params in bank.items():
    active_K = active[name]
    keep = lambda new, old, a=active_K: jnp.where(_expand(a, new), new, old)
    updates, state = tx.update(deltas[name], opt_state[name], params)
    new_bank[name] = jax.tree.map(keep, optax.apply_updates(params, updates),
                                  params)
    # The state's parameter-shaped leaves (momentum) are frozen like the
    # parameters; the others (step counts) advance.
    mask = optax.tree_map_params(
        tx, lambda leaf, a=active_K: _expand(a, leaf), state,
        transform_non_params=lambda _: True)
    new_state[name] = jax.tree.map(jnp.where, mask, state, opt_state[name])
  return new_bank, new_state


def outer_update(outer: dict, inner_params: dict,
                 tx: optax.GradientTransformation, *, assignment_WxS,
                 slot_names, weights_W, rescale_by_sqrt_users: bool):
  """The whole chain: one outer step of every module.

  Args:
    outer: {"params": bank {slot: [K, ...]}, "opt_state": {slot: state}}.
    inner_params: every worker's parameters {slot: [W, ...]}.
    tx: the outer optimizer.
    assignment_WxS: int table, worker w uses expert [w, s] of slot s.
    slot_names: the slots, in the table's column order.
    weights_W: the workers' weights (may be traced; 0 = missing).
    rescale_by_sqrt_users: multiply by sqrt(weighted users).

  Returns:
    (outer, restarted inner params).
  """
  bank = outer["params"]
  num_experts = [jax.tree.leaves(bank[n])[0].shape[0] for n in slot_names]
  sent = contributions(bank, inner_params, assignment_WxS, slot_names)
  users = users_per_module(assignment_WxS, weights_W, num_experts)
  deltas = mix(sent, slot_names, mixing_matrices(assignment_WxS, weights_W,
                                                 num_experts),
               users, rescale_by_sqrt_users)
  active = {name: users[s] > 0 for s, name in enumerate(slot_names)}
  bank, opt_state = optimize(tx, bank, outer["opt_state"], deltas, active)
  restarted = gather_workers(bank, assignment_WxS, slot_names)
  return {"params": bank, "opt_state": opt_state}, restarted


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
