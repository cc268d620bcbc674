"""The workers' own views of the outer step under `delay=lookahead` and
`delay=eager` (`comm_step.py`'s docstring has the rules): each worker
steps the outer optimizer on its own copy, from its own contribution."""

import jax
import jax.numpy as jnp
import optax


def mix_scale_W(users_K, experts_W, rescale_by_sqrt_users):
  """s[e] of Eq. 2 for each worker's expert: [W]."""
  users_W = jnp.asarray(users_K, jnp.float32)[experts_W]
  return (jnp.sqrt(users_W) if rescale_by_sqrt_users
          else (users_W > 0).astype(jnp.float32))


def lookahead_views(tx, bank_K, opt_state_K, assignment_WxS, s, contribs_W,
                    scale_W, like_W):
  """Each worker's prediction of the next global modules: the outer
  optimizer applied to s[e] c_w, from its module's parameters and state
  (gathered to [W, ...]; elementwise optimizers then step each worker's
  row alone, as `outer.optimize` steps each module's)."""
  experts_W = assignment_WxS[:, s]
  global_W = jax.tree.map(lambda x: x[experts_W], bank_K)
  state_W = optax.tree_map_params(tx, lambda leaf: leaf[experts_W],
                                  opt_state_K,
                                  transform_non_params=lambda leaf: leaf)

  def estimate(c):
    return c * scale_W.reshape((-1,) + (1,) * (c.ndim - 1))

  updates, _ = tx.update(jax.tree.map(estimate, contribs_W), state_W,
                         global_W)
  return jax.tree.map(lambda p, like: p.astype(like.dtype),
                      optax.apply_updates(global_W, updates), like_W)


def own_scale_W(a_WxK, users_K, experts_W, rescale_by_sqrt_users):
  """s[e] a[w, e] of each worker for the expert it uses: [W]."""
  a_W = jnp.take_along_axis(a_WxK, experts_W[:, None], axis=1)[:, 0]
  return a_W * mix_scale_W(users_K, experts_W, rescale_by_sqrt_users)


def eager_views(tx, inner, name, sent_W, delayed_W, has_pending, scale_W,
                view_W):
  """Each worker's eager outer step on its own view: (views, opt state).
  `delayed_W` is D^{r-1} of each worker's module, `scale_W` each worker's
  own weight in its module's mix (`own_scale_W`)."""
  stale_W = inner["prev_sent"][name]
  delayed_W = jax.tree.map(
      lambda d: jnp.where(has_pending, d, jnp.zeros_like(d)), delayed_W)

  def estimate(delayed, fresh, stale):
    scale = scale_W.reshape((-1,) + (1,) * (fresh.ndim - 1))
    return delayed + scale * (fresh - stale)

  eager_W = jax.tree.map(estimate, delayed_W, sent_W, stale_W)

  def one_worker(view, opt_state, grad):
    updates, opt_state = tx.update(grad, opt_state, view)
    return optax.apply_updates(view, updates), opt_state

  return jax.vmap(one_worker)(view_W, inner["eager_opt"][name], eager_W)
