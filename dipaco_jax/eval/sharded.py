"""Validation NLL of a group of paths at once, sharded over local devices.

Evaluation used to score one path at a time on one device. Here a group of
G paths is scored by one jitted program: the paths' parameters are stacked
on a leading axis sharded over a `path` mesh axis, the windows of a batch
over a `data` axis, so 256 paths on 8 devices are 32 passes over the
validation windows with every device busy, not 256 passes on one device.

The mesh is this process's devices only (as the host bank is replicated on
every process, each process scores everything it needs on its own devices
and nothing crosses hosts). The path axis has gcd(G, devices) devices and
the rest go to `data`, so a dense model (G = 1) spreads its windows over
every device.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P


def _token_nll(model, params, inputs_BxL, targets_BxL, weights_BxL):
  logits = model.apply({"params": params}, inputs_BxL)
  nll = optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), targets_BxL)
  return nll * weights_BxL


def eval_mesh(group_size: int, devices=None) -> jax.sharding.Mesh:
  """`path x data` over this process's devices for groups of `group_size`."""
  devices = list(devices if devices is not None else jax.local_devices())
  path_axis = math.gcd(group_size, len(devices))
  return jax.sharding.Mesh(
      np.array(devices).reshape(path_axis, len(devices) // path_axis),
      ("path", "data"))


def auto_group_size(num_paths: int, num_devices: int, requested: int) -> int:
  """`eval.path_group`: the requested size, or (0) one path per device of
  the path axis: gcd(paths, devices), so no group is ragged."""
  return requested or math.gcd(num_paths, num_devices)


@functools.lru_cache(maxsize=16)
def _scorer(model, mesh):
  """jit(vmap over paths) of `_token_nll`; its [G, B, L] output is sharded
  like its inputs, paths over `path` and windows over `data`."""
  return jax.jit(jax.vmap(functools.partial(_token_nll, model),
                          in_axes=(0, None, None, None)),
                 out_shardings=NamedSharding(mesh, P("path", "data")))


def stack_params(params_list):
  """G parameter trees -> one tree with a leading G axis: on the devices
  when every leaf is already there and this process holds all of it (as
  early stopping's path parameters, which a host round trip cost 2 copies
  of a path every outer step), else on the host."""
  on_devices = all(isinstance(x, jax.Array) and x.is_fully_addressable
                   for x in jax.tree.leaves(params_list))
  stack = jnp.stack if on_devices else (
      lambda xs: np.stack([np.asarray(a) for a in xs]))
  return jax.tree.map(lambda *x: stack(x), *params_list)


def _rows_per_batch(mesh, batch_size: int) -> int:
  """Windows per batch: every data device gets the same number."""
  data_axis = mesh.shape["data"]
  return -(-batch_size // data_axis) * data_axis


def _placed(params_list, batch_size: int, devices):
  """(mesh, windows per batch, the G stacked parameter trees placed with
  paths over `path`) for scoring a group of G paths."""
  mesh = eval_mesh(len(params_list), devices)
  params = jax.device_put(stack_params(params_list),
                          NamedSharding(mesh, P("path")))
  return mesh, _rows_per_batch(mesh, batch_size), params


def bank_devices(bank):
  """The bank's devices in its mesh's order, when it is a device bank held
  wholly by this process (early stopping's, in the train state); else
  None (a host bank, or one spanning processes)."""
  leaves = jax.tree.leaves(bank)
  if not leaves or not all(isinstance(x, jax.Array) and x.is_fully_addressable
                           and isinstance(x.sharding, NamedSharding)
                           for x in leaves):
    return None
  meshes = {x.sharding.mesh for x in leaves}
  return list(meshes.pop().devices.flat) if len(meshes) == 1 else None


@functools.lru_cache(maxsize=16)
def _path_gather(slot_names: tuple, sharding):
  """jit: (bank, [G, S] expert rows laid out by `sharding`) -> the G paths'
  parameters stacked, laid out by `sharding` (paths over `path`), so the
  partitioner has each device gather only its own paths' modules. The
  rows are an argument, not constants: one program serves every group."""
  def gather(bank, rows_GxS):
    return {name: jax.tree.map(lambda x, i=i: x[rows_GxS[:, i]], bank[name])
            for i, name in enumerate(slot_names)}
  return jax.jit(gather, out_shardings=sharding)


def gather_paths(bank, slot_names, rows_GxS, devices):
  """(mesh, G paths' parameters) gathered from a device bank on `devices`
  (`bank_devices`' order) in one program, placed for scoring: a device
  holds its own paths only, where stacking G gathered paths held all G on
  every device and then copied them between meshes (measured on 4 GPUs:
  twice as slow as scoring the paths one by one; 4 x H200, 2026-11-28)."""
  mesh = eval_mesh(len(rows_GxS), devices)
  by_path = NamedSharding(mesh, P("path"))
  rows = jax.device_put(np.asarray(rows_GxS, np.int32), by_path)
  return mesh, _path_gather(tuple(slot_names), by_path)(bank, rows)


def group_token_nll(model, params_list, layout, batch_size: int,
                    devices=None) -> np.ndarray:
  """[G, M, L] weighted per-token NLL of `layout`'s windows under each of
  the G parameter trees of `params_list` (each a path's parameters)."""
  g = len(params_list)
  mesh, batch, params = _placed(params_list, batch_size, devices)
  rows = NamedSharding(mesh, P("data"))
  nll_fn = _scorer(model, mesh)
  w = layout.windows
  m = len(w["inputs"])
  out_GxMxL = np.zeros((g,) + w["inputs"].shape, np.float32)
  for start in range(0, m, batch):
    idx = np.arange(start, min(start + batch, m))
    # The last batch is padded with copies of a real window, weighted 0.
    take = np.concatenate([idx, np.full(batch - len(idx), idx[0])])
    weights = w["weights"][take].copy()
    weights[len(idx):] = 0
    inputs, targets, weights = (jax.device_put(a, rows) for a in (
        w["inputs"][take], w["targets"][take], weights))
    nll_GxBxL = nll_fn(params, inputs, targets, weights)
    out_GxMxL[:, idx] = np.asarray(nll_GxBxL)[:, :len(idx)]
  return out_GxMxL


@functools.lru_cache(maxsize=16)
def _own_windows_scorer(model, mesh):
  """jit(vmap over paths) of `_token_nll` summed: path g scores its own
  windows, [G, B, L] inputs -> [G] weighted NLL sums."""
  def nll_sum(params, inputs_BxL, targets_BxL, weights_BxL):
    return _token_nll(model, params, inputs_BxL, targets_BxL,
                      weights_BxL).sum()
  return jax.jit(jax.vmap(nll_sum), out_shardings=NamedSharding(mesh,
                                                                P("path")))


def own_windows_nll_sums(model, params_list, layouts, batch_size: int,
                         devices=None) -> np.ndarray:
  """[G] weighted NLL sums, path g scored on `layouts[g]`'s windows only
  (early stopping: each path on its own held-out documents). The G paths
  run in one program per batch, sharded like `group_token_nll`'s, and the
  sums stay on the devices until the one read at the end."""
  mesh, _, params = _placed(params_list, batch_size, devices)
  return placed_own_windows_nll_sums(model, mesh, params, layouts,
                                     batch_size)


def placed_own_windows_nll_sums(model, mesh, params, layouts,
                                batch_size: int) -> np.ndarray:
  """`own_windows_nll_sums` of G paths' parameters already placed on
  `mesh` with paths over `path` (`gather_paths`)."""
  g = len(layouts)
  batch = _rows_per_batch(mesh, batch_size)
  rows = NamedSharding(mesh, P("path", "data"))
  nll_fn = _own_windows_scorer(model, mesh)
  windows = [layout.windows for layout in layouts]
  seq_len = windows[0]["inputs"].shape[1]
  total_G = jnp.zeros(g, jnp.float32)
  for start in range(0, max(len(w["inputs"]) for w in windows), batch):
    inputs, targets, weights = (
        np.zeros((g, batch, seq_len), dtype) for dtype in (
            windows[0]["inputs"].dtype, windows[0]["targets"].dtype,
            np.float32))
    for k, w in enumerate(windows):
      m = len(w["inputs"])
      if not m:
        continue  # Zero windows, weighted 0.
      idx = np.arange(start, min(start + batch, m))
      # Padded with copies of a real window, weighted 0 (as
      # `group_token_nll`), so no padding can make a NaN.
      take = np.concatenate([idx, np.zeros(batch - len(idx), np.int64)])
      inputs[k], targets[k] = w["inputs"][take], w["targets"][take]
      weights[k, :len(idx)] = w["weights"][idx]
    total_G = total_G + nll_fn(params, *(jax.device_put(a, rows) for a in (
        inputs, targets, weights)))
  return np.asarray(total_G)


def score_paths(model, path_params, num_paths: int, layout, batch_size: int,
                on_path, group: int = 0, devices=None) -> None:
  """Calls `on_path(p, nll_MxL)` for every path p in order, scoring `group`
  paths at a time (0: `auto_group_size`); `path_params(p)` gives path p's
  parameters. Memory stays at one group's [G, windows, L] NLLs."""
  devices = devices if devices is not None else jax.local_devices()
  group = auto_group_size(num_paths, len(devices), group)
  for first in range(0, num_paths, group):
    paths = range(first, min(first + group, num_paths))
    nll_GxMxL = group_token_nll(model, [path_params(p) for p in paths],
                                layout, batch_size, devices)
    for p, nll_MxL in zip(paths, nll_GxMxL):
      on_path(p, nll_MxL)
