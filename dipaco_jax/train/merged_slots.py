"""A path's layer slots as one stacked leaf during a K-step dispatch
(`config.train.merge_layer_slots`).

A DiPaCo path cut into level slots (2x2: layers 0-3 and 4-7) holds each
layer parameter as one stacked leaf per slot, so AdamW, which runs per
leaf, launches one update kernel per slot and leaf: on an H100 the
compiled update of two slots is 64 kernels against one slot's 18
(`bench/hlo_kernels.py`; the models' kernels are the same), and the
two-slot step 4.1% slower (docs/performance.md). Inside
`Runtime.inner_k_steps` this module concatenates the layer slots' leaves
along the layer axis, once per dispatch, for the parameters and every
parameter-shaped part of the optimizer state; the K steps update the
merged leaves (the model gets its slots back as slices of them); the
dispatch's end cuts them apart again. Outside a dispatch nothing
changes: the outer step, checkpoints and islands see the slots as
always.

AdamW is elementwise, so the merged update is the per-slot one; only the
global-norm clipping and the gradient-norm metric sum the same squares in
another order (a float32 rounding). A merge costs one copy of the
parameters and the AdamW moments each way per dispatch. Measured on one
H100 at K = 10: one 2x2 path 2.0% faster, DiPaCo 2x2 (4 paths vmapped)
6.0% (`bench/layout_cost.sh`).
"""

import functools

import jax
import jax.numpy as jnp

MERGED = "merged_layer_slots"  # The merged leaf's key in the param tree.


def layer_group(topology, config) -> tuple[str, ...]:
  """The layer slots to merge: all of a path's, when the setting is on and
  their leaves stack (scanned layers, no pipeline); else (). Any order
  will do: `split` hands each slot back its own layers."""
  names = tuple(s.name for s in topology.layer_slots)
  on = (config.train.get("merge_layer_slots", False)
        and config.model.scan_layers and len(names) > 1
        and (config.mesh.stage or config.pipeline.stages) <= 1)
  return names if on else ()


def merge(tree, group: tuple[str, ...], axis: int):
  """`tree` (a param-shaped tree) with the slots of `group` concatenated
  along `axis` (the layer axis: 0 per worker, 1 with the workers' axis
  in front) under the key MERGED."""
  out = {k: v for k, v in tree.items() if k not in group}
  out[MERGED] = jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=axis),
                             *[tree[name] for name in group])
  return out


def layer_counts(params, group: tuple[str, ...], axis: int
                 ) -> tuple[int, ...]:
  """Each slot of `group`'s layers: its leaves' size along `axis`."""
  return tuple(jax.tree.leaves(params[name])[0].shape[axis]
               for name in group)


def split(tree, group: tuple[str, ...], sizes: tuple[int, ...], axis: int):
  """The inverse of `merge`, the slots holding `sizes` layers."""
  out = {k: v for k, v in tree.items() if k != MERGED}
  start = 0
  for name, size in zip(group, sizes):
    out[name] = jax.tree.map(
        lambda x, a=start, n=size: jax.lax.slice_in_dim(x, a, a + n,
                                                        axis=axis),
        tree[MERGED])
    start += size
  return out


def map_param_trees(fn, opt_state, params):
  """`fn` applied to every part of an optax state shaped like `params`
  (AdamW's moments, a weight-decay mask's), the rest unchanged."""
  shape = jax.tree.structure(params)

  def is_params(x):
    return jax.tree.structure(x) == shape
  return jax.tree.map(lambda x: fn(x) if is_params(x) else x, opt_state,
                      is_leaf=is_params)


def _with_inner(state, params, fn):
  """`state` with `fn` applied to its inner parameters (`params`) and to
  every part of their optimizer state shaped like them."""
  inner = state["inner"]
  return dict(state, inner=dict(
      inner, params=fn(params),
      opt_state=map_param_trees(fn, inner["opt_state"], params)))


def scan(step, group: tuple[str, ...], state, batches_KxWxBxLp1):
  """`jax.lax.scan` of `step(state, batch, unmerge=...)` over the K
  batches with the workers' layer slots of `group` merged: merged once
  before the K steps, cut apart once after them. The state's inner
  parameters are [W, layers, ...] per slot."""
  params = state["inner"]["params"]
  sizes = layer_counts(params, group, axis=1)
  state = _with_inner(state, params,
                      functools.partial(merge, group=group, axis=1))
  # Inside the step, per worker: the layer axis comes first.
  unmerge = functools.partial(split, group=group, sizes=sizes, axis=0)
  state, metrics = jax.lax.scan(functools.partial(step, unmerge=unmerge),
                                state, batches_KxWxBxLp1)
  return _with_inner(state, state["inner"]["params"], functools.partial(
      split, group=group, sizes=sizes, axis=1)), metrics
