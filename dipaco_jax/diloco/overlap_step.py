"""The two halves of `delay=overlap`'s outer step (Streaming DiLoCo's
overlap of communication with tau inner steps; `comm_step.py`'s docstring
has the rule): `handover` at the end of each round, `apply` tau inner
steps later. Both are pure functions of the state, so a checkpoint taken
between them holds the whole round in flight (pending D, h, a, residuals).
"""

import jax
import jax.numpy as jnp

from dipaco_jax.diloco import comm_step
from dipaco_jax.diloco import compress_apply
from dipaco_jax.diloco import download
from dipaco_jax.diloco import outer as outer_lib


def handover(outer: dict, inner: dict, *, comms: dict, assignment_WxS,
             slot_names, weights_W, rescale_by_sqrt_users: bool
             ) -> tuple[dict, dict]:
  """Round k's handover: c_w = a_w - x_w compressed (with error feedback)
  as `one_round` does, D^k = mix(C(c)) pending, h_w <- x_w. Nothing is
  applied: the parameters do not change. Returns (outer, inner)."""
  bank = outer["params"]
  num_experts = [jax.tree.leaves(bank[n])[0].shape[0] for n in slot_names]
  num_workers = assignment_WxS.shape[0]
  users = outer_lib.users_per_module(assignment_WxS, weights_W, num_experts)
  mixing = outer_lib.mixing_matrices(assignment_WxS, weights_W, num_experts)
  new_outer, new_inner = (comm_step.copy_top(outer),
                          comm_step.copy_top(inner))
  bytes_W = read_W = jnp.zeros((num_workers,), jnp.float32)
  for s, name in enumerate(slot_names):
    x_W = inner["params"][name]
    _, sent, slot_bytes_W, slot_read_W = comm_step.contribute(
        comms[name], inner["anchor"][name], x_W, inner, new_inner, name,
        num_workers, mixing[s], assignment_WxS[:, s])
    bytes_W, read_W = bytes_W + slot_bytes_W, read_W + slot_read_W
    new_outer["pending"][name] = outer_lib.mix(
        {name: sent}, (name,), [mixing[s]], [users[s]],
        rescale_by_sqrt_users, [comms[name].spec.aggregate])[name]
    new_outer["pending_users"][name] = users[s]
    new_inner["handover"][name] = x_W
  new_outer["has_pending"] = jnp.ones((), jnp.int32)
  if "sent_bytes_W" in inner:
    new_inner["sent_bytes_W"] = bytes_W
  if "recv_bytes_W" in inner:
    # Logged now with the last apply's download, which the next apply
    # replaces: leader_topk's indices read inside this upload.
    new_inner["recv_bytes_W"] = inner["recv_bytes_W"] + read_W
  return new_outer, new_inner


def apply(outer: dict, inner: dict, tx, *, assignment_WxS, slot_names,
          comms=None) -> tuple[dict, dict]:
  """Round k's apply, tau steps after its handover: g <- OuterOpt(g, D^k),
  x_w <- x_w + (g[e(w)] - h_w), a_w <- g[e(w)]; with compressed downloads
  (`comms` needed) the workers' copy p <- p + C(g - p) takes g's place
  there. A no-op without a round in flight. Returns (outer, inner)."""
  has_pending = outer["has_pending"] > 0
  published = outer.get("published", {})
  new_outer, new_inner = (comm_step.copy_top(outer),
                          comm_step.copy_top(inner))
  recv_W = jnp.zeros((assignment_WxS.shape[0],), jnp.float32)
  for s, name in enumerate(slot_names):
    b, o = comm_step._optimize(  # pylint: disable=protected-access
        tx, outer["params"], outer["opt_state"], name,
        outer["pending"][name], outer["pending_users"][name] > 0)
    read_K = b
    if name in published:
      read_K, recv_K = download.publish_slot(outer, new_outer, comms[name],
                                             name, b)
      for part in ("published", "published_state"):
        if name in outer.get(part, {}):
          new_outer[part][name] = jax.tree.map(
              lambda n, old: jnp.where(has_pending, n, old),
              new_outer[part][name], outer[part][name])
      recv_W = recv_W + recv_K[assignment_WxS[:, s]]
    else:  # Read whole (counted if leader_topk reads inside uploads).
      recv_W = recv_W + compress_apply.float32_bytes_W(
          inner["params"][name], assignment_WxS.shape[0])
    global_W = jax.tree.map(lambda g: g[assignment_WxS[:, s]], read_K)
    x_W = inner["params"][name]
    # x + (g - h): the same floating-point form as one_round's x + (g - a).
    new_x_W = jax.tree.map(lambda x, g, h: (x + (g - h)).astype(x.dtype),
                           x_W, global_W, inner["handover"][name])
    new_a_W = jax.tree.map(lambda g, a: g.astype(a.dtype), global_W,
                           inner["anchor"][name])
    (new_outer["params"][name], new_outer["opt_state"][name],
     new_inner["params"][name], new_inner["anchor"][name]) = jax.tree.map(
         lambda n, old: jnp.where(has_pending, n, old),
         (b, o, new_x_W, new_a_W),
         (outer["params"][name], outer["opt_state"][name], x_W,
          inner["anchor"][name]))
  new_outer["has_pending"] = jnp.zeros((), jnp.int32)
  if "recv_bytes_W" in inner:  # Logged at the next handover.
    new_inner["recv_bytes_W"] = jnp.where(has_pending, recv_W,
                                          inner["recv_bytes_W"])
  return new_outer, new_inner


def jit_steps(runtime):
  """The runtime's jitted (handover(state, weights_W), apply(state)), with
  the state's shardings and donated, as `Runtime.outer_step` is."""
  kw = dict(assignment_WxS=runtime.topology.assignment_WxS,
            slot_names=runtime.slot_names)

  def handover_fn(state, weights_W):
    outer, inner = handover(
        state["outer"], state["inner"], comms=runtime.comms,
        weights_W=weights_W,
        rescale_by_sqrt_users=runtime.config.diloco.rescale_by_sqrt_users,
        **kw)
    return dict(state, inner=inner, outer=outer)

  def apply_fn(state):
    outer, inner = apply(state["outer"], state["inner"], runtime.outer_tx,
                         comms=runtime.comms, **kw)
    return dict(state, inner=inner, outer=outer)

  shardings = runtime.state_shardings
  replicated = jax.sharding.NamedSharding(runtime.mesh,
                                          jax.sharding.PartitionSpec())
  return (runtime._in_context(jax.jit(  # pylint: disable=protected-access
      handover_fn, in_shardings=(shardings, replicated),
      out_shardings=shardings, donate_argnums=0)),
          runtime._in_context(jax.jit(  # pylint: disable=protected-access
              apply_fn, in_shardings=(shardings,), out_shardings=shardings,
              donate_argnums=0)))
