"""The store on gs:// across processes, against the local GCS emulator.

A single process cannot see what another process's writes do to its own
caches, so each test here starts real processes (`tests/store_probe.py`, a
long-lived process that answers store questions as a coordinator or worker
would) that talk to the emulator over loopback. Their environment is the
emulator's address only (`testing.gcs.client_env`): no gcsfs setting, so
what keeps their reads fresh is the package's own (`store/object_store.py`).

Every process started here is stopped when its test ends, and every wait is
bounded.
"""

import contextlib
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

pytest.importorskip("gcp_storage_emulator")
pytest.importorskip("gcsfs")

# pylint: disable=g-import-not-at-top
from etils import epath

from dipaco_jax.islands import layout
from dipaco_jax.islands import repair
from dipaco_jax.store import atomic
from dipaco_jax.store import integrity
from dipaco_jax.store import items
from dipaco_jax.store import object_store
from dipaco_jax.testing import gcs as testing_gcs
# The emulator (one per module) and a fresh bucket a test.
from test_gcs_emulator import bucket  # pylint: disable=unused-import
from test_gcs_emulator import emulator  # pylint: disable=unused-import
# pylint: enable=g-import-not-at-top

_PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      "store_probe.py")
_ANSWER_TIMEOUT_S = 120.0  # A probe's import of JAX and orbax on 2 cores.


class _Probe:
  """A `store_probe.py` process: `ask` sends one command, waits (bounded)
  for its answer; `send` / `answer` split the two for commands that run
  side by side."""

  def __init__(self, env: dict):
    self.process = subprocess.Popen(
        [sys.executable, _PROBE], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    self._answers: list[str] = []
    self._arrived = threading.Condition()
    threading.Thread(target=self._read, daemon=True).start()

  def _read(self):
    for line in self.process.stdout:
      with self._arrived:
        self._answers.append(line)
        self._arrived.notify_all()

  def send(self, op: str, **arguments) -> None:
    self.process.stdin.write(json.dumps({"op": op, **arguments}) + "\n")
    self.process.stdin.flush()

  def answer(self) -> dict:
    with self._arrived:
      if not self._arrived.wait_for(lambda: self._answers,
                                    timeout=_ANSWER_TIMEOUT_S):
        raise TimeoutError(f"probe gave no answer in {_ANSWER_TIMEOUT_S} s")
      return json.loads(self._answers.pop(0))

  def ask(self, op: str, **arguments):
    self.send(op, **arguments)
    answer = self.answer()
    assert "ok" in answer, answer
    return answer["ok"]

  def quit(self) -> int:
    self.send("quit")
    return self.process.wait(timeout=30)

  def stop(self) -> None:
    if self.process.poll() is None:
      self.process.kill()
      self.process.wait(timeout=10)


@contextlib.contextmanager
def _probes(count: int, emulator=None):
  """`count` probe processes, pointed at `emulator` when given; always
  stopped on leaving."""
  env = {**os.environ}
  # The test process's own gcsfs settings stay here: a probe is set up
  # as a user's process is, by the package alone.
  for name in ("FSSPEC_GCS_USE_LISTINGS_CACHE", "FSSPEC_GCS"):
    env.pop(name, None)
  if emulator is not None:
    env.update(testing_gcs.client_env(emulator))
  probes = [_Probe(env) for _ in range(count)]
  try:
    yield probes
  finally:
    for probe in probes:
      probe.stop()


def _tree(value: float, n: int = 4) -> dict:
  return {"w": np.full((n,), value, np.float32)}


def test_a_process_sees_what_another_wrote_after_it_listed(bucket,
                                                           emulator):
  # The probe is a long-lived role (a coordinator): it lists, reads and
  # looks for versions first; this process then writes as another role
  # would, and every later answer of the probe must show it.
  run = epath.Path(f"gs://{bucket}/run")
  beats = layout.control(run, "heartbeat")
  atomic.write_json(beats / "w0.json", {"beat": 1})
  assert items.save_tree(layout.module_dir(run, "s", 0, 0), _tree(0.0))
  v1 = layout.module_dir(run, "s", 0, 1)
  repairs = layout.control(run, "repair")
  with _probes(1, emulator) as (probe,):
    env = probe.ask("env")
    assert env["env_setting"] is None  # Nothing set for it ...
    assert not env["listings_cache"]   # ... and no listing cache all the same.
    assert probe.ask("control_files", dir=str(beats)) == ["w0.json"]
    assert probe.ask("read_json", path=str(beats / "w0.json")) == {"beat": 1}
    assert probe.ask("latest_module_version", run=str(run), slot="s",
                     expert=0) == 0
    assert not probe.ask("is_committed", key=str(v1))
    probe.send("load_tree", key=str(v1))
    assert probe.answer()["error"].startswith("NotCommittedError")
    assert probe.ask("control_files", dir=str(repairs)) == []
    assert probe.ask("repair_requests", run=str(run)) == []

    # Another role writes: a new heartbeat, a heartbeat that grew, a new
    # module version, a repair request (of version 0, which it sets aside).
    atomic.write_json(beats / "w1.json", {"beat": 1})
    grown = {"beat": 10, "task": "r000003/00001", "pad": "x" * 300}
    atomic.write_json(beats / "w0.json", grown)
    assert items.save_tree(v1, _tree(1.0))
    v0 = layout.module_dir(run, "s", 0, 0)
    marker = atomic.read_commit(v0)
    repair.report(run, integrity.DamagedKeyError(v0, "a test",
                                                 marker["writer"]),
                  "test", lambda _: None)

    assert probe.ask("control_files", dir=str(beats)) == ["w0.json",
                                                           "w1.json"]
    assert probe.ask("read_json", path=str(beats / "w0.json")) == grown
    assert probe.ask("latest_module_version", run=str(run), slot="s",
                     expert=0) == 1
    assert probe.ask("is_committed", key=str(v1))
    assert probe.ask("load_tree", key=str(v1)) == {"w": [1.0] * 4}
    assert probe.ask("repair_requests", run=str(run)) == [
        "modules/s/00000/v000000"]
    assert not probe.ask("is_committed", key=str(v0))

    # The key rebuilt (a new writer's directory, new values): read anew.
    assert items.save_tree(v0, _tree(7.0))
    assert probe.ask("load_tree", key=str(v0)) == {"w": [7.0] * 4}
    assert probe.quit() == 0


def _store_root(kind: str, tmp_path, bucket_name) -> epath.Path:
  if kind == "local":
    return epath.Path(tmp_path) / "store"
  return epath.Path(f"gs://{bucket_name}/store")


def _key_entries(kind, key, emulator, bucket_name) -> set:
  """The top-level entries of a key directory, asked of the store itself."""
  if kind == "local":
    return {p.name for p in epath.Path(key).iterdir()}
  prefix = str(key).removeprefix(f"gs://{bucket_name}/") + "/"
  return {n[len(prefix):].split("/")[0]
          for n in emulator.object_names(bucket_name, prefix)}


@pytest.mark.parametrize("kind", ["local", "gs"])
def test_of_two_writers_racing_on_a_key_exactly_one_commits(
    kind, tmp_path, emulator, request):
  # Both racers pass the "is it committed?" check before either writes a
  # marker (a barrier each side of the check, and again before the
  # marker), the interleaving that check-then-write lost on gs://: the
  # second upload overwrote the first writer's marker under its readers.
  bucket_name = None
  if kind == "gs":
    bucket_name = request.getfixturevalue("bucket")
  key = _store_root(kind, tmp_path, bucket_name) / "modules" / "s" / (
      "00000") / "v000001"
  barrier = str(tmp_path / "barrier")
  seen, vanished, stop = [], [], threading.Event()

  def watch():
    # A reader all along: once a marker appears it never changes or goes.
    while not stop.is_set():
      try:
        seen.append(object_store.read_bytes(key / atomic.COMMIT_MARKER))
      except FileNotFoundError:
        vanished.extend(seen[-1:])
      except BaseException as e:
        vanished.append(repr(e))
        raise
      time.sleep(0.005)

  with _probes(2, emulator if kind == "gs" else None) as probes:
    for probe in probes:
      probe.ask("env")  # Both imported and ready: the race starts together.
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    for probe, value in zip(probes, (1.0, 2.0)):
      probe.send("save_tree", key=str(key), value=value, barrier=barrier)
    answers = [probe.answer() for probe in probes]
    stop.set()
    watcher.join(timeout=30)
    # And once more now: on a loaded machine the watcher's thread may not
    # have run between the commit and the answers (CI saw it see nothing).
    seen.append(object_store.read_bytes(key / atomic.COMMIT_MARKER))
    assert all("ok" in a for a in answers), answers  # Both returned.
    won = [a["ok"] for a in answers]
    assert sorted(won) == [False, True], won  # Exactly one, never none.
    assert sorted(os.listdir(barrier)) == sorted(
        f"{stage}-{p.process.pid}" for stage in ("checked", "written")
        for p in probes)  # Both raced past the check to the marker.
    value = (1.0, 2.0)[won.index(True)]
    assert [probe.quit() for probe in probes] == [0, 0]

  marker = atomic.read_commit(key)
  tree, _ = items.load_tree(key, _tree(0.0))
  np.testing.assert_array_equal(tree["w"], _tree(value)["w"])
  # One marker, the winner's, all along; never gone once there.
  assert seen and len(set(seen)) == 1 and not vanished
  # The loser removed its own copy and nothing else.
  assert _key_entries(kind, key, emulator, bucket_name) == {
      atomic.COMMIT_MARKER, marker["writer"]}
