"""Every read of a store key is verified against its commit marker's
digests: a flipped bit, a missing or truncated file, a damaged marker."""

import json

import jax
import numpy as np
import pytest

from dipaco_jax.store import atomic
from dipaco_jax.store import integrity
from dipaco_jax.store import items


def _tree():
  return {"w": np.arange(600, dtype=np.float32).reshape(20, 30),
          "b": {"c": np.linspace(0, 1, 7).astype(np.float32)}}


def _like(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _chunk(key, leaf="w"):
  """The data file of leaf `leaf` (one chunk: the arrays are small)."""
  files = [p for p in (items.item_dir(key) / leaf).iterdir()
           if not p.name.startswith(".")]
  assert len(files) == 1, files
  return files[0]


@pytest.fixture
def key(tmp_path):
  directory = tmp_path / "modules" / "embed" / "00000" / "v000001"
  assert items.save_tree(directory, _tree(), {"round": 0})
  return directory


def test_an_intact_key_reads_back_and_carries_its_digests(key):
  tree, meta = items.load_tree(key, _like(_tree()))
  np.testing.assert_array_equal(tree["w"], _tree()["w"])
  assert meta == {"round": 0}
  marker = atomic.read_commit(key)
  assert marker["digests"] == integrity.tree_digests(_tree(), True)
  assert marker["dtypes"] == {"['w']": "float32", "['b']['c']": "float32"}


def test_a_flipped_bit_is_named_by_both_readers(key):
  chunk = _chunk(key)
  data = bytearray(chunk.read_bytes())
  data[123] ^= 0x10
  chunk.write_bytes(bytes(data))
  for read in (lambda: items.load_tree(key, _like(_tree())),
               lambda: items.load_saved(key)):
    with pytest.raises(integrity.DamagedKeyError,
                       match=r"digest mismatch in \['w'\]") as e:
      read()
    assert e.value.key == key


@pytest.mark.parametrize("damage", ["deleted", "truncated"])
def test_a_missing_or_truncated_file_is_damage_not_a_traceback(key, damage):
  chunk = _chunk(key)
  if damage == "deleted":
    chunk.unlink()
  else:
    chunk.write_bytes(chunk.read_bytes()[:100])
  with pytest.raises(integrity.DamagedKeyError) as e:
    items.load_tree(key, _like(_tree()))
  assert str(key) in str(e.value) and "\n" not in e.value.reason


def test_a_damaged_marker_is_damage(key):
  (key / atomic.COMMIT_MARKER).write_text('{"meta": {"round"')
  with pytest.raises(integrity.DamagedKeyError, match="unreadable"):
    items.load_tree(key, _like(_tree()))


def test_a_cast_on_read_still_verifies_the_saved_bytes(key):
  like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, np.float16),
                      _tree())
  tree, _ = items.load_tree(key, like)
  assert tree["w"].dtype == np.float16
  np.testing.assert_array_equal(tree["w"], _tree()["w"].astype(np.float16))


def test_keys_written_before_digests_load_unverified(key):
  marker = atomic.read_commit(key)
  del marker["digests"], marker["dtypes"]
  (key / atomic.COMMIT_MARKER).write_text(json.dumps(marker))
  tree, _ = items.load_tree(key, _like(_tree()))
  np.testing.assert_array_equal(tree["b"]["c"], _tree()["b"]["c"])
