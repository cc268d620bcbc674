"""One module or one worker cut out of the full training state, and put
back: for the island runtime's keys (`store/items.py`) and the SPMD
runtime alike."""

import jax
import numpy as np


def _set_row(x, i: int, value):
  """`x` with row `i` replaced; jax arrays stay jax arrays (functional)."""
  if isinstance(x, jax.Array):
    return x.at[i].set(value)
  x = np.array(x)
  x[i] = value
  return x


def module_of(outer_state, slot: str, expert: int) -> dict:
  """Module (slot, expert) of `state["outer"]`: {"params", "opt_state"}.

  The params are row `expert` of the slot's bank. In the slot's outer
  optimizer state, leaves with a leading K_s axis are sliced the same way;
  scalar leaves (e.g. an Adam count) are shared by the slot's experts and
  kept whole.
  """
  def take(x):
    return x if np.ndim(x) == 0 else x[expert]
  return {"params": jax.tree.map(lambda x: x[expert],
                                 outer_state["params"][slot]),
          "opt_state": jax.tree.map(take, outer_state["opt_state"][slot])}


def put_module(outer_state, slot: str, expert: int, module) -> dict:
  """`outer_state` with module (slot, expert) replaced by `module`
  (as from `module_of`); a scalar leaf takes the module's value."""
  def put(x, value):
    return value if np.ndim(x) == 0 else _set_row(x, expert, value)
  params = dict(outer_state["params"])
  opt_state = dict(outer_state["opt_state"])
  params[slot] = jax.tree.map(put, params[slot], module["params"])
  opt_state[slot] = jax.tree.map(put, opt_state[slot], module["opt_state"])
  return {**outer_state, "params": params, "opt_state": opt_state}


def worker_of(inner_state, worker: int):
  """Worker `worker`'s slice (row `worker` of every leaf) of
  `state["inner"]`."""
  return jax.tree.map(lambda x: x[worker], inner_state)


def put_worker(inner_state, worker: int, worker_tree):
  """`inner_state` with worker `worker`'s row replaced by `worker_tree`."""
  return jax.tree.map(lambda x, v: _set_row(x, worker, v), inner_state,
                      worker_tree)
