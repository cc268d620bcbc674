"""Digests keyed by region (`store/shard_digests.py`) in one process: keys,
and a whole copy checked against digests recorded in any layout. The
sharded side (each process hashing its own shards) is
tests/test_sharded_checkpoint.py's."""

import jax
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np

from dipaco_jax.store import integrity
from dipaco_jax.store import shard_digests


def test_region_keys_round_trip():
  shape = (8, 6)
  assert shard_digests.region_key("['w']", (slice(None), slice(None)),
                                  shape) == "['w']"
  assert shard_digests.region_key("['w']", (), ()) == "['w']"
  key = shard_digests.region_key("['w']", (slice(2, 4), slice(None)), shape)
  assert key == "['w']@2:4,0:6"
  assert shard_digests.parse_key(key) == ("['w']", (slice(2, 4), slice(0, 6)))
  assert shard_digests.parse_key("['a'][0]") == ("['a'][0]", None)


def test_one_process_hashes_each_leaf_whole_even_when_sharded():
  mesh = jax.make_mesh((8,), ("d",))
  x = jax.device_put(np.arange(64, dtype=np.float32).reshape(16, 4),
                     NamedSharding(mesh, P("d", None)))
  assert shard_digests.held_digests({"w": x, "b": np.ones(3)}) == {
      "['w']": integrity.digest(np.asarray(x)),
      "['b']": integrity.digest(np.ones(3))}


def test_a_whole_copy_is_checked_against_regions_of_another_layout():
  w = np.arange(48, dtype=np.float32).reshape(8, 6)
  # As two processes holding 4 rows each recorded them.
  want = {f"['w']@{lo}:{lo + 4},0:6": integrity.digest(w[lo:lo + 4])
          for lo in (0, 4)}
  assert shard_digests.check({"w": w}, want) == (None, 0)
  flipped = w.copy()
  flipped[5, 1] += 1.0
  assert shard_digests.check({"w": flipped}, want) == (
      "digest mismatch in ['w']", 0)
  # A leaf without digests, and digests of a leaf the tree lacks.
  bad, _ = shard_digests.check({"w": w, "v": w}, {**want, "['u']": "0"})
  assert bad == "digest mismatch in ['u'], ['v']"
