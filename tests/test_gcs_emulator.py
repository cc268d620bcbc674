"""The store on `gs://`, against a local GCS emulator (gcp-storage-emulator).

The same code paths as on real GCS: etils.epath -> fsspec -> gcsfs for the
small files and commit markers, orbax -> tensorstore's `gcs` driver for the
items. What cannot be pointed at an emulator, and is therefore replaced
inside these tests, is listed in `dipaco_jax/testing/gcs.py`: etils' TF
(`tf.io.gfile`) backend and gcsfs's gRPC bucket-layout probe.

Every setting (environment variables, fsspec configuration) is made inside
`testing_gcs.clients_pointed_at` and undone when a test ends, so no other
test sees it.
"""

import json
import os
import urllib.error
import urllib.request
import uuid

import jax
import numpy as np
import pytest

pytest.importorskip("gcp_storage_emulator")
pytest.importorskip("gcsfs")

# pylint: disable=g-import-not-at-top
from etils import epath
from etils.epath import backend as epath_backend

from dipaco_jax import errors
from dipaco_jax.islands import layout
from dipaco_jax.testing import gcs as testing_gcs
from dipaco_jax.store import atomic
from dipaco_jax.store import items
from dipaco_jax.store import keys
from dipaco_jax.store import object_store
# pylint: enable=g-import-not-at-top


@pytest.fixture(scope="module")
def emulator():
  with testing_gcs.running(timeout=60) as emulator:
    yield emulator


@pytest.fixture
def bucket(emulator):
  """A fresh bucket, with this process's gs:// clients sent to the
  emulator for the duration of the test."""
  name = f"dipaco-{uuid.uuid4().hex[:12]}"
  emulator.create_bucket(name)
  with testing_gcs.clients_pointed_at(emulator):
    yield name


class _Killed(Exception):
  """A writer stopped before its commit marker."""


def _abstract(tree, sharding=None):
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding),
      tree)


def _assert_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert np.shape(x) == np.shape(y)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _module(scale: float):
  params = {"w": np.arange(6, dtype=np.float32).reshape(2, 3) * scale,
            "b": np.full((3,), scale, np.float32)}
  opt_state = {"mu": np.ones((2, 3), np.float32) * scale,
               "count": np.int32(3)}
  return params, opt_state


def test_settings_are_scoped_to_the_block(emulator):
  names = list(testing_gcs.client_env(emulator))
  before = {n: os.environ.get(n) for n in names}
  with testing_gcs.clients_pointed_at(emulator):
    # The store's own path type sends gs:// through fsspec (gcsfs), to the
    # emulator: not tf.io.gfile, which no emulator can stand in for.
    assert isinstance(epath.Path("gs://b/x")._backend,  # pylint: disable=protected-access
                      epath_backend._FileSystemSpecBackend)  # pylint: disable=protected-access
    assert os.environ["STORAGE_EMULATOR_HOST"] == emulator.url
  assert {n: os.environ.get(n) for n in names} == before


def test_emulator_keeps_generations_and_preconditions(emulator):
  """What `dipaco_jax.testing.gcs` adds to the emulator, and tensorstore's OCDBT
  manifest updates need: a media read names the object's generation, and
  writes and reads honour generation preconditions."""
  name = f"dipaco-{uuid.uuid4().hex[:12]}"
  emulator.create_bucket(name)
  upload = f"{emulator.url}/upload/storage/v1/b/{name}/o?uploadType=media"

  def call(url, data=None, method=None):
    request = urllib.request.Request(url, data=data, method=method)
    try:
      with urllib.request.urlopen(request, timeout=10) as response:
        return response.status, response.headers, response.read()
    except urllib.error.HTTPError as e:
      return e.code, e.headers, b""

  status, _, body = call(f"{upload}&name=k&ifGenerationMatch=0", b"one")
  assert status == 200
  generation = json.loads(body)["generation"]
  assert call(f"{upload}&name=k&ifGenerationMatch=0", b"two")[0] == 412
  media = f"{emulator.url}/storage/v1/b/{name}/o/k?alt=media"
  status, headers, body = call(media)
  assert (status, headers["x-goog-generation"], body) == (
      200, generation, b"one")
  assert call(f"{media}&ifGenerationNotMatch={generation}")[0] == 304
  assert call(f"{upload}&name=k&ifGenerationMatch={generation}",
              b"three")[0] == 200
  assert call(media)[2] == b"three"


def test_small_files_land_in_the_bucket(bucket, emulator):
  root = epath.Path(f"gs://{bucket}/run")
  atomic.write_text(root / "notes.txt", "hello")
  atomic.write_json(root / "cfg" / "config.json", {"b": [1, 2], "a": "x"})
  atomic.write_npz(root / "shards" / "0.npz", tokens=np.arange(5))

  assert (root / "notes.txt").read_text() == "hello"
  assert json.loads((root / "cfg" / "config.json").read_text()) == {
      "a": "x", "b": [1, 2]}
  with (root / "shards" / "0.npz").open("rb") as f:
    np.testing.assert_array_equal(np.load(f)["tokens"], np.arange(5))
  # Asked of the emulator itself: the objects are there, under their final
  # names (no temporary-then-rename on an object store).
  assert emulator.object_names(bucket, "run/") == [
      "run/cfg/config.json", "run/notes.txt", "run/shards/0.npz"]


def test_commit_marker_on_gs(bucket, emulator):
  key = epath.Path(f"gs://{bucket}/store/key")
  atomic.write_bytes(key / "data.bin", b"\x00\x01")
  assert not atomic.is_committed(key)
  assert atomic.read_commit(key) is None
  atomic.commit(key, {"round": 3})
  assert atomic.is_committed(key)
  assert atomic.read_commit(key) == {"round": 3}
  assert f"store/key/{atomic.COMMIT_MARKER}" in emulator.object_names(
      bucket, "store/key/")


def test_module_round_trip_on_gs(bucket, emulator):
  root = f"gs://{bucket}/store"
  params, opt_state = _module(1.0)
  assert keys.save_module(root, "embed", 1, 7, params, opt_state,
                          {"round": 7})
  # Orbax's item and the marker are objects in the emulator's bucket.
  names = emulator.object_names(bucket, "store/modules/embed/00001/v000007/")
  assert f"store/modules/embed/00001/v000007/{atomic.COMMIT_MARKER}" in names
  item = items.item_dir(keys.module_dir(root, "embed", 1, 7))
  assert item.parent.name.startswith("writer-")  # The writer's own.
  item_prefix = str(item).removeprefix(f"gs://{bucket}/") + "/"
  assert any(n.startswith(item_prefix) for n in names)

  got_params, got_opt, meta = keys.load_module(
      root, "embed", 1, 7, _abstract(params), _abstract(opt_state))
  assert meta == {"round": 7}
  _assert_equal((got_params, got_opt), (params, opt_state))
  device = jax.sharding.SingleDeviceSharding(jax.devices()[1])
  got_params, _, _ = keys.load_module(
      root, "embed", 1, 7, _abstract(params, device), _abstract(opt_state))
  assert all(isinstance(x, jax.Array) and x.sharding == device
             for x in jax.tree.leaves(got_params))
  _assert_equal(got_params, params)
  assert keys.committed_versions(root, "embed", 1) == [7]
  assert keys.latest_version(root, "embed", 1) == 7
  assert keys.latest_version(root, "embed", 0) is None

  assert keys.save_inner(root, 2, 16, {"x": np.arange(4.0)}, {"step": 16})
  loaded, meta = keys.load_inner(root, 2, 16, {"x": np.zeros(4)})
  _assert_equal(loaded, {"x": np.arange(4.0)})
  assert meta == {"step": 16}
  assert keys.latest_inner_step(root, 2) == 16


def test_uncommitted_key_is_never_read_on_gs(bucket, emulator, monkeypatch):
  root = f"gs://{bucket}/store"
  params, opt_state = _module(1.0)
  assert keys.save_module(root, "embed", 0, 1, params, opt_state)

  # A writer that dies after orbax has finalized its item, before the marker.
  def die(directory, meta):
    del directory, meta
    raise _Killed()
  with monkeypatch.context() as m:
    m.setattr(atomic, "commit", die)
    with pytest.raises(_Killed):
      keys.save_module(root, "embed", 0, 2, *_module(2.0))
  directory = keys.module_dir(root, "embed", 0, 2)
  prefix = "store/modules/embed/00000/v000002/"
  leftover = emulator.object_names(bucket, prefix)
  assert leftover and all(n.startswith(prefix + "writer-") for n in leftover)

  assert not atomic.is_committed(directory)
  assert keys.committed_versions(root, "embed", 0) == [1]
  assert keys.latest_version(root, "embed", 0) == 1
  with pytest.raises(items.NotCommittedError, match=str(directory)):
    keys.load_module(root, "embed", 0, 2, _abstract(params),
                     _abstract(opt_state))

  # A new writer commits under its own directory and leaves the leftover
  # alone: it cannot tell a dead writer from a slow one.
  again, again_opt = _module(3.0)
  assert keys.save_module(root, "embed", 0, 2, again, again_opt)
  assert set(leftover) <= set(emulator.object_names(bucket, prefix))
  assert keys.latest_version(root, "embed", 0) == 2
  loaded, _, _ = keys.load_module(root, "embed", 0, 2, _abstract(again),
                                  _abstract(again_opt))
  _assert_equal(loaded, again)


def test_committed_key_is_immutable_on_gs(bucket, emulator):
  root = f"gs://{bucket}/store"
  first, first_opt = _module(1.0)
  assert keys.save_module(root, "embed", 0, 1, first, first_opt, {"by": 1})
  prefix = "store/modules/embed/00000/v000001/"
  objects = emulator.object_names(bucket, prefix)
  marker = keys.module_dir(root, "embed", 0, 1) / atomic.COMMIT_MARKER
  marker_text = marker.read_text()

  assert not keys.save_module(root, "embed", 0, 1, *_module(9.0), {"by": 2})
  assert emulator.object_names(bucket, prefix) == objects
  assert marker.read_text() == marker_text
  params, _, meta = keys.load_module(root, "embed", 0, 1, _abstract(first),
                                     _abstract(first_opt))
  _assert_equal(params, first)
  assert meta == {"by": 1}


def test_a_store_that_could_read_stale_listings_is_refused(bucket, monkeypatch):
  import fsspec.config  # pylint: disable=g-import-not-at-top
  run = f"gs://{bucket}/run"
  object_store.check_fresh(run)  # As the package configures gcsfs.
  # A user's fsspec configuration turning the listing cache back on.
  for protocol in ("gs", "gcs"):
    monkeypatch.setitem(fsspec.config.conf, protocol, {
        **fsspec.config.conf.get(protocol, {}), "use_listings_cache": True})
  testing_gcs.reset_client_caches()
  with pytest.raises(errors.UserError, match=(
      f"^{run}: gcsfs was set up with its listing cache on "
      r"\(use_listings_cache\).*remove the setting")):
    layout.RunSpec.load(run, timeout_s=0)
  # No gcsfs at all: named with the extra that installs it.
  monkeypatch.setattr(object_store.importlib.util, "find_spec",
                      lambda name: None)
  with pytest.raises(errors.UserError, match=(
      rf"^{run}: gs:// stores are read through gcsfs, which is not "
      r"installed: pip install -e '\.\[gcs\]'$")):
    object_store.check_fresh(run)
  object_store.check_fresh("/a/local/store")  # Never refused.
