"""The bank topology: paths of any shape, levels, private modules."""

import numpy as np

from dipaco_jax import paths


def test_three_levels_give_every_combination_once():
  topo = paths.build_topology(6, (2, 2, 2))
  assert topo.num_paths == 8
  levels = [s for s in topo.slots if s.kind == "level"]
  assert [s.layers for s in levels] == [(0, 1), (2, 3), (4, 5)]
  ids = topo.assignment_WxS[:, 1:]  # after the shared embed_head
  assert len({tuple(r) for r in ids}) == 8
  np.testing.assert_array_equal(ids[5], np.unravel_index(5, (2, 2, 2)))


def test_uneven_levels_private_layers_and_embedding():
  topo = paths.build_topology(12, (16, 16), (4, 8), private_layers=(0, 11),
                              private_embedding=True)
  kinds = [(s.name, s.kind, s.num_experts) for s in topo.slots]
  assert kinds == [("embed_head", "private", 256),
                   ("layers_00_00", "private", 256),
                   ("layers_01_03", "level", 16),
                   ("layers_04_10", "level", 16),
                   ("layers_11_11", "private", 256)]
  # Path 17 = (level-0 expert 1, level-1 expert 1); private slots are its own.
  np.testing.assert_array_equal(topo.assignment_WxS[17], [17, 17, 1, 1, 17])


def test_diloco_replicas_share_every_module():
  topo = paths.build_topology(4, (1,), num_replicas=8)
  assert topo.num_paths == 1 and topo.num_workers == 8
  assert (topo.assignment_WxS == 0).all()
  assert all(s.kind == "shared" for s in topo.slots)


def test_unequal_expert_counts_per_level():
  topo = paths.build_topology(4, (2, 4))
  assert topo.num_paths == 8
  assert [s.num_experts for s in topo.slots if s.kind == "level"] == [2, 4]
  # Path 5 = (level-0 expert 1, level-1 expert 1): row-major over (2, 4).
  np.testing.assert_array_equal(topo.assignment_WxS[5, 1:], [1, 1])
  # Each level-1 expert serves 2 paths, each level-0 expert 4.
  assert np.bincount(topo.assignment_WxS[:, 1]).tolist() == [4, 4]
  assert np.bincount(topo.assignment_WxS[:, 2]).tolist() == [2, 2, 2, 2]
