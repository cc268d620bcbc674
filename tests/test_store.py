"""Per-module / per-worker orbax items, commit markers, early stopping."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dipaco_jax.eval import early_stopping
from dipaco_jax.eval import routed
from dipaco_jax.eval import sharded
from dipaco_jax.store import atomic
from dipaco_jax.store import items
from dipaco_jax.store import keys
from dipaco_jax.store import link

K, W = 3, 4


def _outer_state():
  """A two-slot bank with an Adam outer state that has taken one step."""
  key = jax.random.PRNGKey(0)
  bank = {"embed": {"table": jax.random.normal(key, (K, 5, 2))},
          "layers_00_01": {"w": jax.random.normal(key, (K, 2, 3)),
                           "b": jnp.arange(K * 3.0).reshape(K, 3)}}
  tx = optax.adam(0.1)
  opt_state = {}
  for slot, params in bank.items():
    state = tx.init(params)
    _, opt_state[slot] = tx.update(jax.tree.map(jnp.ones_like, params),
                                   state, params)
  return {"params": bank, "opt_state": opt_state}


def _inner_state():
  params = {"embed": {"table": jnp.arange(W * 10.0).reshape(W, 5, 2)}}
  opt_state = jax.vmap(optax.adamw(1e-3).init)(params)
  return {"params": params, "opt_state": opt_state}


def _abstract(tree, sharding=None):
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding),
      tree)


def _assert_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert np.shape(x) == np.shape(y)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_module_round_trip_to_host_and_device(tmp_path):
  module = items.module_of(_outer_state(), "layers_00_01", 1)
  count = module["opt_state"][0].count
  assert np.ndim(count) == 0 and int(count) == 1  # Kept whole, not sliced.
  assert keys.save_module(tmp_path, "layers_00_01", 1, 7, module["params"],
                          module["opt_state"], {"round": 7})
  params, opt_state, meta = keys.load_module(
      tmp_path, "layers_00_01", 1, 7, _abstract(module["params"]),
      _abstract(module["opt_state"]))
  assert meta == {"round": 7}
  _assert_equal((params, opt_state), (module["params"], module["opt_state"]))
  assert all(isinstance(x, np.ndarray)
             for x in jax.tree.leaves((params, opt_state)))

  device = jax.sharding.SingleDeviceSharding(jax.devices()[3])
  params, opt_state, _ = keys.load_module(
      tmp_path, "layers_00_01", 1, 7, _abstract(module["params"], device),
      _abstract(module["opt_state"], device))
  _assert_equal((params, opt_state), (module["params"], module["opt_state"]))
  assert all(isinstance(x, jax.Array) and x.sharding == device
             for x in jax.tree.leaves((params, opt_state)))
  assert keys.committed_versions(tmp_path, "layers_00_01", 1) == [7]
  assert keys.latest_version(tmp_path, "layers_00_01", 0) is None


def test_a_relative_store_directory_saves_and_loads(tmp_path, monkeypatch):
  # The store makes local paths absolute before orbax sees them: orbax's
  # CheckpointManager refuses a relative one mid-save (a bench's
  # --workdir=runs/x failed at its first checkpoint, 2026-12-01).
  monkeypatch.chdir(tmp_path)
  tree = {"a": np.arange(6.0).reshape(2, 3)}
  assert items.save_tree("relative/t", tree, {"round": 1})
  loaded, meta = items.load_tree("relative/t", _abstract(tree))
  _assert_equal(loaded, tree)
  assert meta == {"round": 1}
  assert (tmp_path / "relative" / "t").is_dir()


def test_load_with_wrong_target_names_the_leaf(tmp_path):
  items.save_tree(tmp_path / "t", {"a": np.zeros((2, 3)), "b": np.ones(4)})
  with pytest.raises(ValueError, match=r"\['a'\]: saved shape \[2, 3\]"):
    items.load_tree(tmp_path / "t", {"a": np.zeros((3, 2)), "b": np.ones(4)})


def test_module_of_and_put_module_round_trip():
  outer = _outer_state()
  same = items.put_module(outer, "embed", 2, items.module_of(outer, "embed",
                                                             2))
  _assert_equal(same, outer)

  module = jax.tree.map(lambda x: x + 10, items.module_of(outer, "embed", 2))
  new = items.put_module(outer, "embed", 2, module)
  _assert_equal(items.module_of(new, "embed", 2), module)
  for e in (0, 1):  # The other experts and slots are untouched.
    got, want = (items.module_of(t, "embed", e) for t in (new, outer))
    _assert_equal((got["params"], got["opt_state"][0].mu),
                  (want["params"], want["opt_state"][0].mu))
  _assert_equal(new["params"]["layers_00_01"],
                outer["params"]["layers_00_01"])
  assert int(new["opt_state"]["embed"][0].count) == 11

  host = jax.device_get(outer)  # Numpy trees work the same way.
  _assert_equal(items.put_module(host, "embed", 2, module), new)


def test_worker_round_trip(tmp_path):
  inner = _inner_state()
  worker = items.worker_of(inner, 2)
  assert worker["opt_state"][0].count.shape == ()
  _assert_equal(items.put_worker(inner, 2, worker), inner)
  changed = jax.tree.map(lambda x: x + 1, worker)
  new = items.put_worker(inner, 2, changed)
  _assert_equal(items.worker_of(new, 2), changed)
  _assert_equal(items.worker_of(new, 1), items.worker_of(inner, 1))

  for step in (8, 16):
    assert keys.save_inner(tmp_path, 2, step, worker, {"step": step})
  loaded, meta = keys.load_inner(tmp_path, 2, 16, _abstract(worker))
  _assert_equal(loaded, worker)
  assert meta == {"step": 16}
  assert keys.committed_inner_steps(tmp_path, 2) == [8, 16]
  assert keys.latest_inner_step(tmp_path, 2) == 16
  assert keys.latest_inner_step(tmp_path, 0) is None


def test_committed_version_is_never_overwritten(tmp_path):
  first = {"w": np.full((3,), 1.0, np.float32)}
  assert keys.save_module(tmp_path, "embed", 0, 1, first, {})
  assert not keys.save_module(tmp_path, "embed", 0, 1,
                              {"w": np.full((3,), 9.0, np.float32)}, {})
  params, _, _ = keys.load_module(tmp_path, "embed", 0, 1, _abstract(first),
                                  {})
  _assert_equal(params, first)


_KILLED_WRITER = textwrap.dedent("""
    import sys
    import time
    import numpy as np
    from dipaco_jax.store import atomic
    from dipaco_jax.store import keys

    root, ready = sys.argv[1], sys.argv[2]

    def pause_before_commit(directory, meta):
      # The orbax item is written and finalized; stop before the marker.
      open(ready, "w").close()
      time.sleep(600)

    atomic.commit = pause_before_commit
    keys.save_module(root, "embed", 0, 2,
                     {"w": np.full((3,), 2.0, np.float32)},
                     {"count": np.int32(5)}, {"round": 2})
""")


def test_writer_killed_before_its_commit_marker(tmp_path):
  root, ready = tmp_path / "store", tmp_path / "ready"
  params = {"w": np.full((3,), 1.0, np.float32)}
  opt_state = {"count": np.int32(4)}
  keys.save_module(root, "embed", 0, 1, params, opt_state)
  script = tmp_path / "writer.py"
  script.write_text(_KILLED_WRITER)
  log = (tmp_path / "writer.log").open("w")
  proc = subprocess.Popen(
      [sys.executable, str(script), str(root), str(ready)],
      env={**os.environ, "JAX_PLATFORMS": "cpu"}, stdout=log,
      stderr=subprocess.STDOUT)
  try:
    deadline = time.monotonic() + 120
    while not ready.exists():
      assert proc.poll() is None, (tmp_path / "writer.log").read_text()
      assert time.monotonic() < deadline, "the writer never got to commit"
      time.sleep(0.1)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait(timeout=30)
    log.close()

  directory = keys.module_dir(root, "embed", 0, 2)
  (leftover,) = directory.iterdir()  # The killed writer's own directory,
  assert leftover.name.startswith("writer-")
  assert any((leftover / items.ITEM).iterdir())  # with orbax's files.
  assert not atomic.is_committed(directory)
  assert keys.committed_versions(root, "embed", 0) == [1]
  assert keys.latest_version(root, "embed", 0) == 1
  with pytest.raises(items.NotCommittedError, match=str(directory)):
    keys.load_module(root, "embed", 0, 2, _abstract(params),
                     _abstract(opt_state))

  again = {"w": np.full((3,), 3.0, np.float32)}
  assert keys.save_module(root, "embed", 0, 2, again, opt_state)
  assert keys.latest_version(root, "embed", 0) == 2
  # Beside the leftover, untouched: a slow writer is not told from a dead
  # one, and no writer deletes another's files.
  assert leftover.exists() and items.item_dir(directory).parent != leftover
  loaded, _, _ = keys.load_module(root, "embed", 0, 2, _abstract(again),
                                  _abstract(opt_state))
  _assert_equal(loaded, again)


def _stopper(directory, monkeypatch, **kwargs):
  """EarlyStopping over 2 paths of 2 slots, "shared" (one module both paths
  use) and "x" (one module each); a path's held-out loss is its x[0]."""
  monkeypatch.setattr(routed, "make_layout", lambda docs, seq_len, prefix: (
      types.SimpleNamespace(windows={"weights": np.ones(1)})))
  monkeypatch.setattr(sharded, "own_windows_nll_sums", lambda model, params,
                      layouts, b: np.array([p["x"][0] for p in params]))
  topology = types.SimpleNamespace(
      slots=[types.SimpleNamespace(name="shared"),
             types.SimpleNamespace(name="x")],
      path_assignment_PxS=lambda: np.array([[0, 0], [0, 1]]))
  runtime = types.SimpleNamespace(
      model=None, topology=topology, path_params=lambda bank, p: {
          "shared": bank["shared"][0], "x": bank["x"][p]})
  return early_stopping.EarlyStopping(runtime, [None, None], directory,
                                      seq_len=4, prefix_len=0, batch_size=1,
                                      **kwargs)


def _state(x0, x1):
  """The shared module holds x0 + x1, so each step's is different."""
  return {"outer": {"params": {
      "shared": np.array([[x0 + x1]], np.float32),
      "x": np.array([[x0, x0 + 0.5], [x1, x1 + 0.5]], np.float32)}}}


def _snapshots(directory):
  """module -> the steps of its snapshots, e.g. {"x/00000": [3]}."""
  return {f"{d.parent.name}/{d.name}": sorted(
      int(s.name[1:]) for s in d.iterdir())
          for d in sorted((directory / "modules").glob("*/*"))}


_LIKE = {"shared": np.zeros(1, np.float32), "x": np.zeros(2, np.float32)}


def test_early_stopping_keeps_the_committed_best(tmp_path, monkeypatch):
  directory = tmp_path / "early_stopping"
  stopper = _stopper(directory, monkeypatch)
  stopper(1, _state(5.0, 5.0))
  stopper(2, _state(3.0, 6.0))  # Path 0 improves, path 1 does not.
  stopper(3, _state(2.0, 7.0))  # Path 0 improves again.
  assert stopper.best == {"0": {"loss": 2.0, "step": 3},
                          "1": {"loss": 5.0, "step": 1}}
  _assert_equal(stopper.best_params(0, _LIKE),
                {"shared": np.array([9.0]), "x": np.array([2.0, 2.5])})
  _assert_equal(stopper.best_params(1, _LIKE),
                {"shared": np.array([10.0]), "x": np.array([5.0, 5.5])})
  # One snapshot per module and step, kept while a best names it: step 2's
  # are gone; the shared module of steps 1 and 3 stays, for path 1 and 0.
  assert _snapshots(directory) == {"shared/00000": [1, 3], "x/00000": [3],
                                   "x/00001": [1]}

  # Killed while writing a better snapshot (in the background): the error
  # comes out at the next flush, and on disk the old best stays the best.
  def killed(directory, meta):
    raise KeyboardInterrupt
  with monkeypatch.context() as m:
    m.setattr(atomic, "commit", killed)
    stopper(4, _state(1.0, 8.0))
    with pytest.raises(KeyboardInterrupt):
      stopper.flush()
  assert json.loads((directory / "best.json").read_text())["0"] == {
      "loss": 2.0, "step": 3}
  leftover = directory / "modules" / "shared" / "00000" / "s00000004"
  assert leftover.exists()

  # A resumed run drops the uncommitted leftover, and an entry whose
  # snapshot lost its marker is forgotten rather than read (with the
  # snapshots only it named).
  (directory / "modules" / "x" / "00001" / "s00000001" /
   atomic.COMMIT_MARKER).unlink()
  resumed = _stopper(directory, monkeypatch)
  assert resumed.best == {"0": {"loss": 2.0, "step": 3}}
  assert _snapshots(directory) == {"shared/00000": [3], "x/00000": [3],
                                   "x/00001": []}
  _assert_equal(resumed.best_params(0, _LIKE),
                {"shared": np.array([9.0]), "x": np.array([2.0, 2.5])})
  with pytest.raises(KeyError, match="Path 1"):
    resumed.best_params(1, _LIKE)
  resumed(5, _state(4.0, 9.0))  # Path 1 starts afresh; path 0 is kept.
  assert resumed.best["1"] == {"loss": 9.0, "step": 5}
  _assert_equal(resumed.best_params(1, _LIKE),
                {"shared": np.array([13.0]), "x": np.array([9.0, 9.5])})


def test_early_stopping_reader_deletes_nothing_and_follows_the_run(
    tmp_path, monkeypatch):
  """A read-only stopper (inference on a run still training) keeps the
  snapshots best.json does not name yet, and when the run replaces a best
  after the reader read best.json, the reader reads the new one."""
  directory = tmp_path / "early_stopping"
  writer = _stopper(directory, monkeypatch)
  writer(1, _state(5.0, 5.0))
  writer.flush()
  # The writer has committed step 2's snapshots but not yet best.json.
  for slot, expert, value in (("shared", 0, [4.0]), ("x", 0, [2.0, 2.5])):
    items.save_tree(directory / "modules" / slot / f"{expert:05d}" /
                    "s00000002", np.array(value, np.float32))
  before = _snapshots(directory)
  reader = _stopper(directory, monkeypatch, read_only=True)
  assert _snapshots(directory) == before
  assert before["x/00000"] == [1, 2]
  assert reader.best["0"] == {"loss": 5.0, "step": 1}
  with pytest.raises(RuntimeError, match="read-only"):
    reader(3, _state(1.0, 1.0))
  writer(3, _state(1.0, 7.0))  # Path 0's step-1 snapshots are deleted.
  writer.flush()
  assert reader.best["0"]["step"] == 1
  _assert_equal(reader.best_params(0, _LIKE),
                {"shared": np.array([8.0]), "x": np.array([1.0, 1.5])})
  assert reader.best["0"] == {"loss": 1.0, "step": 3}


def test_early_stopping_scores_every_nth_outer_step_and_the_last(
    tmp_path, monkeypatch):
  """eval.early_stopping_every = 3 with H = 10 over 70 steps: rounds 3 and
  6 (steps 30, 60) and the last step (70) are scored, nothing else; with
  overlap's applies (step 10 k + tau) the round is the step // H."""
  stopper = _stopper(tmp_path / "es", monkeypatch, every_rounds=3,
                     inner_steps=10, last_step=70)
  for step, x0 in ((10, 1.0), (20, 0.5), (30, 4.0), (40, 0.1), (50, 0.2),
                   (60, 3.0), (70, 2.0)):
    stopper(step, _state(x0, 9.0 - x0))
  stopper.flush()
  # Steps 20, 40 and 50 had the lower losses but were never scored.
  assert stopper.best == {"0": {"loss": 2.0, "step": 70},
                          "1": {"loss": 5.0, "step": 30}}
  assert [stopper.scores_at(s) for s in (33, 35, 62, 70, 71)] == [
      True, True, True, True, False]
  every = _stopper(tmp_path / "es1", monkeypatch)  # The default: each one.
  assert all(every.scores_at(s) for s in (1, 7, 10))
  # An outer step where no path improves writes nothing, best.json neither.
  writes = []
  monkeypatch.setattr(early_stopping.atomic, "write_json",
                      lambda *args, **kw: writes.append(args))
  stopper(90, _state(8.0, 8.0))  # Scored (round 9), no better.
  stopper.flush()
  assert not writes and stopper.best["0"]["step"] == 70


def test_early_stopping_reads_whole_path_snapshots_of_older_runs(
    tmp_path, monkeypatch):
  """Run directories from before module snapshots kept a whole path per
  snapshot: still read, and deleted once a new best replaces them."""
  directory = tmp_path / "early_stopping"
  old = directory / "path_00000" / "s00000007"
  items.save_tree(old, {"shared": np.array([1.0], np.float32),
                        "x": np.array([3.0, 3.5], np.float32)})
  directory.joinpath("best.json").write_text(
      json.dumps({"0": {"loss": 3.0, "step": 7}}))
  stopper = _stopper(directory, monkeypatch)
  assert stopper.best == {"0": {"loss": 3.0, "step": 7}}
  _assert_equal(stopper.best_params(0, _LIKE),
                {"shared": np.array([1.0]), "x": np.array([3.0, 3.5])})
  stopper(8, _state(2.0, 5.0))
  stopper.flush()
  assert not old.exists()
  _assert_equal(stopper.best_params(0, _LIKE),
                {"shared": np.array([7.0]), "x": np.array([2.0, 2.5])})


def test_early_stopping_writes_in_the_background(tmp_path, monkeypatch):
  """Outer steps never wait for the snapshots: they are written by a
  thread, and a best replaced before it was written is skipped. `flush`
  (before every checkpoint) and `best_params` wait for all of it."""
  import threading  # pylint: disable=g-import-not-at-top
  directory = tmp_path / "early_stopping"
  stopper = _stopper(directory, monkeypatch)
  entered, release, saved = threading.Event(), threading.Event(), []
  save_tree = items.save_tree

  def slow_save(path, tree, meta):
    entered.set()
    assert release.wait(timeout=30)
    saved.append(str(path)[len(str(directory)) + 1:])
    return save_tree(path, tree, meta)
  monkeypatch.setattr(items, "save_tree", slow_save)
  stopper(1, _state(5.0, 5.0))
  assert entered.wait(timeout=30)  # The writer holds step 1's 3 modules.
  assert stopper.best == {"0": {"loss": 5.0, "step": 1},
                          "1": {"loss": 5.0, "step": 1}}  # Decided at once.
  stopper(2, _state(3.0, 6.0))  # Path 0 improves twice while the writer
  stopper(3, _state(2.0, 7.0))  # is blocked: step 2 is never written.
  assert not saved and not (directory / "best.json").exists()
  release.set()
  stopper.flush()
  assert saved == ["modules/shared/00000/s00000001",
                   "modules/x/00000/s00000001",
                   "modules/x/00001/s00000001",
                   "modules/shared/00000/s00000003",
                   "modules/x/00000/s00000003"]
  assert json.loads((directory / "best.json").read_text()) == stopper.best
  assert _snapshots(directory) == {"shared/00000": [1, 3], "x/00000": [3],
                                   "x/00001": [1]}
  _assert_equal(stopper.best_params(0, _LIKE),
                {"shared": np.array([9.0]), "x": np.array([2.0, 2.5])})


def test_threads_of_one_process_write_one_file_at_once(tmp_path):
  """A worker's heartbeat thread and its main thread both write its
  heartbeat file: every write succeeds, the file is always whole, and no
  temporary file is left (each write renames its own)."""
  import threading  # pylint: disable=g-import-not-at-top
  path = tmp_path / "hb.json"
  errors = []

  def writer(tag):
    try:
      for i in range(300):
        atomic.write_json(path, {"tag": tag, "i": i})
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)
  threads = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors, errors[0]
  assert set(json.loads(path.read_text())) == {"tag", "i"}
  assert [p.name for p in tmp_path.iterdir()] == ["hb.json"]


def test_the_emulated_link_counts_and_delays_every_store_operation(
    tmp_path):
  # `--link_latency_ms`: every store operation waits it out and is counted
  # by kind on its own thread (the slow-store model of docs/islands.md).
  link.set_link(0.0, 20.0)
  try:
    before = link.thread_counts().copy()
    t0 = time.monotonic()
    atomic.write_json(tmp_path / "a.json", {"x": 1})
    assert atomic.read_commit(tmp_path) is None
    assert not atomic.is_committed(tmp_path)
    items.save_tree(tmp_path / "k", {"w": np.ones(4, np.float32)})
    items.load_tree(tmp_path / "k", {"w": np.zeros(4, np.float32)})
    elapsed = time.monotonic() - t0
    other = threading.Thread(target=link.operation, args=("list",))
    other.start()
    other.join()
  finally:
    link.set_link(0.0, 0.0)
  ops = link.since(before)
  # save_tree: is it committed, the arrays (under the writer's own
  # directory: no leftover to look for), the marker's creation; load_tree:
  # the marker, the arrays. The other thread's listing is its own.
  assert ops == {"write": 2, "read": 2, "exists": 2, "put": 1, "get": 1}
  assert elapsed >= 0.020 * sum(ops.values())


def test_with_fsync_a_keys_files_reach_the_disk_before_its_marker(
    tmp_path, monkeypatch):
  # `--store_fsync`: every file of the item, its directories and the key's
  # entry are synced before the marker exists; the marker, then its
  # directory, after. Without it nothing is synced.
  key = tmp_path / "k"
  synced = []  # (path, whether the key was committed then)
  sync = os.fsync

  def recording(fd):
    synced.append((os.readlink(f"/proc/self/fd/{fd}"),
                   (key / atomic.COMMIT_MARKER).exists()))
    sync(fd)
  monkeypatch.setattr(os, "fsync", recording)
  atomic.set_fsync(True)
  try:
    items.save_tree(key, {"w": np.ones(4, np.float32)})
  finally:
    atomic.set_fsync(False)
  before = {path for path, committed in synced if not committed}
  files = {str(p) for p in key.rglob("*")
           if p.name != atomic.COMMIT_MARKER}
  assert files <= before
  assert {str(key), str(tmp_path)} <= before
  assert [path for path, committed in synced if committed] == [str(key)]
  synced.clear()
  items.save_tree(tmp_path / "k2", {"w": np.ones(4, np.float32)})
  assert synced == []
