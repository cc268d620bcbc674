"""Sharded evaluation (eval/sharded.py): a group of paths scored at once over
8 fake devices gives each path's NLLs as scoring it alone on one device."""

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from dipaco_jax import testing
from dipaco_jax.data import token_store
from dipaco_jax.eval import routed
from dipaco_jax.eval import sharded


def _layout(seq_len):
  rng = np.random.default_rng(0)
  lengths = [40, 9, 23, 17, 33]
  tokens = rng.integers(4, testing.TINY_VOCAB, sum(lengths)).astype(np.int32)
  docs = token_store.TokenDocs(tokens, np.r_[0, np.cumsum(lengths)])
  return routed.make_layout(docs, seq_len, prefix_len=4)


def test_group_of_paths_on_8_devices_equals_one_path_on_one_device():
  runtime = testing.tiny_runtime(testing.tiny_config(shape="2x2", inner_steps=2))
  bank = jax.device_get(runtime.init_state(jax.random.key(0))["outer"]
                        ["params"])
  # Experts start equal (from one base); make every module different.
  rng = np.random.default_rng(1)
  bank = jax.tree.map(lambda x: x + 0.05 * rng.standard_normal(x.shape)
                      .astype(x.dtype), bank)
  params = [runtime.path_params(bank, p) for p in range(4)]
  layout = _layout(runtime.config.data.seq_len)
  # 4 paths over 8 devices: a 4 x 2 mesh; batch 3 is padded up to 4 rows.
  assert dict(sharded.eval_mesh(4).shape) == {"path": 4, "data": 2}
  got_GxMxL = sharded.group_token_nll(runtime.model, params, layout, 3)
  one_device = [jax.devices()[0]]
  for p in range(4):
    want_MxL = sharded.group_token_nll(runtime.model, [params[p]], layout, 3,
                                       devices=one_device)[0]
    np.testing.assert_allclose(got_GxMxL[p], want_MxL, rtol=2e-5, atol=2e-5)
  # Padding windows are never scored, and the paths really differ.
  assert (got_GxMxL[:, layout.windows["weights"] == 0] == 0).all()
  assert not np.allclose(got_GxMxL[0], got_GxMxL[3])
  # One path (the dense baseline's case) spreads its windows over all 8.
  assert dict(sharded.eval_mesh(1).shape) == {"path": 1, "data": 8}
  np.testing.assert_allclose(
      routed.token_nll(runtime.model, params[2], layout, 3), got_GxMxL[2],
      rtol=2e-5, atol=2e-5)


def test_group_size_and_compact_route_ids():
  assert sharded.auto_group_size(256, 8, 0) == 8
  assert sharded.auto_group_size(6, 4, 0) == 2
  assert sharded.auto_group_size(6, 4, 3) == 3
  assert routed.compact_ids(np.array([0, 255])).dtype == np.int16
  assert routed.compact_ids(np.array([0, 40_000])).dtype == np.int32


def test_parameters_on_the_devices_are_scored_without_a_host_copy():
  """Early stopping scores a path gathered from the training state's bank
  (replicated over the mesh): it is stacked on the devices, not copied to
  the host and back, and scores as the host copy does."""
  runtime = testing.tiny_runtime(testing.tiny_config(shape="2x2", inner_steps=2))
  bank = runtime.init_state(jax.random.key(0))["outer"]["params"]
  params = runtime.path_params(bank, 1)
  assert all(isinstance(x, jax.Array) and len(x.sharding.device_set) == 8
             for x in jax.tree.leaves(params))
  stacked = sharded.stack_params([params])
  assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(stacked))
  host = sharded.stack_params([jax.device_get(params)])
  assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(host))
  layout = _layout(runtime.config.data.seq_len)
  np.testing.assert_allclose(
      routed.token_nll(runtime.model, params, layout, 3),
      routed.token_nll(runtime.model, jax.device_get(params), layout, 3),
      rtol=1e-6, atol=1e-6)


def test_paths_on_their_own_windows_in_one_program():
  """Early stopping scores each path on its own held-out windows, a group
  of paths at once over 8 devices: the sums equal scoring each path alone
  on one device, whatever the windows' counts (none included)."""
  runtime = testing.tiny_runtime(testing.tiny_config(shape="2x2", inner_steps=2))
  bank = jax.device_get(runtime.init_state(jax.random.key(0))["outer"]
                        ["params"])
  rng = np.random.default_rng(2)
  bank = jax.tree.map(lambda x: x + 0.05 * rng.standard_normal(x.shape)
                      .astype(x.dtype), bank)
  params = [runtime.path_params(bank, p) for p in range(4)]
  seq_len = runtime.config.data.seq_len
  docs = []
  for lengths in ([40, 9, 23], [400], [17, 33, 12, 8, 61], [3]):
    tokens = rng.integers(4, testing.TINY_VOCAB, sum(lengths))
    docs.append(token_store.TokenDocs(tokens, np.r_[0, np.cumsum(lengths)]))
  layouts = [routed.make_layout(d, seq_len, prefix_len=4) for d in docs]
  counts = [len(layout.windows["inputs"]) for layout in layouts]
  assert counts[3] == 0 and len(set(counts)) == 4, counts
  got_G = sharded.own_windows_nll_sums(runtime.model, params, layouts, 3)
  one_device = [jax.devices()[0]]
  for p in range(3):
    want = sharded.group_token_nll(runtime.model, [params[p]], layouts[p], 3,
                                   devices=one_device)[0].sum()
    np.testing.assert_allclose(got_G[p], want, rtol=1e-5)
  assert got_G[3] == 0
  # On the devices, as early stopping passes them: the same sums.
  device_params = [runtime.path_params(runtime.init_state(jax.random.key(0))
                                       ["outer"]["params"], p)
                   for p in range(4)]
  np.testing.assert_allclose(
      sharded.own_windows_nll_sums(runtime.model, device_params, layouts, 3),
      sharded.own_windows_nll_sums(runtime.model, jax.device_get(
          device_params), layouts, 3), rtol=1e-6)


def test_paths_gathered_from_a_device_bank_in_one_program():
  """Early stopping gathers a group from the train state's bank straight
  into the scoring layout: each device holds only its own path (not the
  whole group), the parameters are exactly the path's, the sums equal
  those of the stacked path parameters, and one program serves every
  group."""
  runtime = testing.tiny_runtime(testing.tiny_config(shape="2x2",
                                                     inner_steps=2))
  bank = runtime.init_state(jax.random.key(0))["outer"]["params"]
  rng = np.random.default_rng(3)
  shardings = jax.tree.map(lambda x: x.sharding, bank)
  bank = jax.device_put(jax.tree.map(
      lambda x: x + 0.05 * rng.standard_normal(x.shape).astype(x.dtype),
      jax.device_get(bank)), shardings)
  devices = sharded.bank_devices(bank)
  assert devices == list(runtime.mesh.devices.flat)
  assert sharded.bank_devices(jax.device_get(bank)) is None  # Host bank.
  topology = runtime.topology
  rows_GxS = topology.path_assignment_PxS()[[3, 1, 2, 0]]
  mesh, params = sharded.gather_paths(
      bank, [s.name for s in topology.slots], rows_GxS, devices)
  assert dict(mesh.shape) == {"path": 4, "data": 2}
  for leaf in jax.tree.leaves(params):
    assert leaf.shape[0] == 4
    assert {s.data.shape[0] for s in leaf.addressable_shards} == {1}
  for g, p in enumerate([3, 1, 2, 0]):
    jax.tree.map(lambda got, want, g=g: np.testing.assert_array_equal(
        np.asarray(got)[g], np.asarray(want)),
        params, runtime.path_params(bank, p))
  seq_len = runtime.config.data.seq_len
  tokens = rng.integers(4, testing.TINY_VOCAB, 200)
  layouts = [routed.make_layout(token_store.TokenDocs(
      np.roll(tokens, 7 * g), np.array([0, 50, 200])), seq_len, prefix_len=4)
             for g in range(4)]
  np.testing.assert_allclose(
      sharded.placed_own_windows_nll_sums(runtime.model, mesh, params,
                                          layouts, 3),
      sharded.own_windows_nll_sums(
          runtime.model, [runtime.path_params(bank, p) for p in [3, 1, 2, 0]],
          layouts, 3), rtol=1e-6)
  # Another group of the same size: the same program, compiled once.
  _, params = sharded.gather_paths(
      bank, [s.name for s in topology.slots], rows_GxS[::-1], devices)
  gather = sharded._path_gather(tuple(s.name for s in topology.slots),
                                NamedSharding(mesh, P("path")))
  assert gather._cache_size() == 1  # pylint: disable=protected-access
  # Compiled, a device's output is its one path and no temporary holds
  # the group (the bank itself is the argument, already held).
  memory = gather.lower(bank, jax.device_put(
      np.asarray(rows_GxS, np.int32), NamedSharding(mesh, P("path")))
                        ).compile().memory_analysis()
  path_bytes = 4 * sum(x.size for x in jax.tree.leaves(
      runtime.path_params(bank, 0)))
  assert memory.output_size_in_bytes < 1.01 * path_bytes
  assert memory.temp_size_in_bytes < 0.1 * path_bytes
  jax.tree.map(lambda got, want: np.testing.assert_array_equal(
      np.asarray(got)[0], np.asarray(want)),
      params, runtime.path_params(bank, 0))
