"""A whole island run on gs://, against the local GCS emulator: the
coordinator, the workers and the executors are separate processes that share
only the bucket (data shards, modules, control files), as islands on several
machines would. A worker joins late, the worker holding round 1's task is
killed mid-round, and a final module damaged in the bucket is rebuilt on
the next read; the result is the SPMD runtime's.

The run's store operations per round are counted from the emulator's own
request log (what GCS would bill), printed (`pytest -s`) and checked for
what a round must do; docs/islands.md quotes them.
"""

import collections
import os
import signal
import subprocess
import threading
import time
import uuid

import jax
import numpy as np
import pytest

pytest.importorskip("gcp_storage_emulator")
pytest.importorskip("gcsfs")

# pylint: disable=g-import-not-at-top
from etils import epath

from dipaco_jax.islands import launcher
from dipaco_jax.islands import layout
from dipaco_jax.islands import roles
from dipaco_jax.islands import timeline
from dipaco_jax.store import atomic
from dipaco_jax.store import items
from dipaco_jax.testing import gcs as testing_gcs
import test_islands
import test_islands_processes
# pylint: enable=g-import-not-at-top

_WAIT_S = 300.0  # Bounded waits of the chaos thread (a round takes ~40 s).


def _worker_pid(run, worker_id: str) -> int | None:
  for pid in test_islands_processes.role_pids(run, "worker"):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = f.read().split(b"\0")
    except OSError:
      continue
    if f"--worker_id={worker_id}".encode() in argv:
      return pid
  return None


class _LateJoinAndKill(threading.Thread):
  """Once round 1's task is leased (to w0, the only worker the launcher
  starts), kills w0 (SIGKILL, mid-round) and starts a worker of its own,
  `late`, which the launcher knows nothing of."""

  def __init__(self, run, log_path, env):
    super().__init__(daemon=True)
    self.run_path, self.log_path, self.env = run, log_path, env
    self.late = None
    self.events = []
    self.stop = threading.Event()

  def _leased_round(self) -> int | None:
    lease = layout.read_json(layout.control(self.run_path, "assign",
                                            "w0.json"))
    task = (lease or {}).get("task")
    return None if task is None else task["round"]

  def run(self):
    deadline = time.monotonic() + _WAIT_S
    while self._leased_round() != 1:
      if self.stop.wait(0.1) or time.monotonic() > deadline:
        return
    pid = _worker_pid(self.run_path, "w0")
    if pid is not None:
      os.kill(pid, signal.SIGKILL)
      self.events.append("killed w0 in round 1")
    with open(self.log_path, "a") as log:
      self.late = subprocess.Popen(
          roles.role_command("worker", self.run_path, "--worker_id=late",
                             "--fake_devices=8"),
          stdout=log, stderr=subprocess.STDOUT, env=self.env,
          start_new_session=True)
    self.events.append("started late")

  def close(self):
    self.stop.set()
    self.join(timeout=30)
    if self.late is not None and self.late.poll() is None:
      self.late.kill()
    if self.late is not None:
      self.late.wait(timeout=30)


def _relative_diff(a, b) -> float:
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))
                   / max(float(np.max(np.abs(np.asarray(y)))), 1e-30))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _ops_per_round(rows, run, num_rounds) -> list[dict]:
  """The emulator's requests by kind (`testing.gcs.request_kind`) in each
  round: from the end of round r - 1's task (the first request for round
  0) to the end of round r's, as the workers recorded them (this machine's
  clock, as the log's)."""
  ends = {}
  for tasks in timeline.worker_tasks(run).values():
    for t in tasks:
      ends[t["round"]] = max(ends.get(t["round"], 0.0),
                             t["start"] + t["seconds"])
  assert sorted(ends) == list(range(num_rounds)), ends
  counts = [collections.Counter() for _ in range(num_rounds)]
  for row in rows:
    r = next((r for r in range(num_rounds) if row["time"] <= ends[r]), None)
    if r is not None:
      counts[r][row["kind"]] += 1
  return [dict(c) for c in counts]


def test_an_island_run_on_gs_with_a_late_worker_a_kill_and_a_damaged_key(
    tmp_path):
  # The SPMD runtime's result, on a local disk (the same data: seeded).
  spmd_exp = test_islands._experiment(tmp_path / "spmd")
  spmd = jax.device_get(spmd_exp.train().state["outer"]["params"])

  bucket = f"dipaco-{uuid.uuid4().hex[:12]}"
  with testing_gcs.running(timeout=60) as emulator:
    emulator.create_bucket(bucket)
    with testing_gcs.clients_pointed_at(emulator):
      root = epath.Path(f"gs://{bucket}/work")
      exp = test_islands._experiment(root)  # Its shards on gs:// too.
      run = root / "islands" / exp.name
      # Every path in one task (the SPMD run's mesh: 8 devices), so the
      # same roundings; one worker started by the launcher, one late.
      options = launcher.IslandOptions(
          num_workers=1, paths_per_task=4, fake_devices=8, num_executors=1,
          heartbeat_s=0.5, lease_timeout_s=4.0,
          log_dir=str(tmp_path / "logs"))
      chaos = _LateJoinAndKill(run, tmp_path / "logs" / "worker_late.log",
                               {**os.environ, "JAX_PLATFORMS": "cpu",
                                "PYTHONUNBUFFERED": "1"})
      chaos.start()
      started = time.time()
      try:
        result = launcher.train_experiment(exp, options)
      finally:
        chaos.close()
      assert chaos.events == ["killed w0 in round 1", "started late"]
      diff = _relative_diff(result.state["outer"]["params"], spmd)
      assert diff < 1e-6, diff
      done = layout.read_json(layout.done_path(run))
      assert done["tasks_done"].get("late", 0) >= 1, done  # It took tasks.
      assert sum(done["tasks_done"].values()) == 3, done
      worker_log = (tmp_path / "logs" / "worker_w0.log").read_text()
      assert "[worker w0]" in worker_log  # The logs are on this machine.

      rows = [r for r in emulator.requests() if r["time"] >= started]
      per_round = _ops_per_round(rows, run, 3)
      print("store operations per round (emulator's log):")
      for r, counts in enumerate(per_round):
        print(f"  round {r}: {sum(counts.values())} "
              + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
      for counts in per_round:  # Each round reads and writes arrays.
        assert counts.get("write", 0) > 0 and counts.get("read", 0) > 0

      # A final module damaged in the bucket (one chunk's bytes flipped):
      # the next launch, which reads the finished run back, rebuilds it
      # from the version before and the contributions of the last round.
      slot = exp.topology.slots[1].name
      key = layout.module_dir(run, slot, 0, 3)
      writer = atomic.read_commit(key)["writer"]
      # An array's chunks: item/ARRAY/0.0 (its .zarray beside them).
      chunks = sorted((p for p in items.item_dir(key).glob("*/*")
                       if not p.name.startswith(".")),
                      key=lambda p: (-p.stat().length, str(p)))
      data = bytearray(chunks[0].read_bytes())
      data[len(data) // 2] ^= 0xFF
      chunks[0].write_bytes(bytes(data))
      again = launcher.train_experiment(exp, options)
      rebuilt = atomic.read_commit(key)
      assert rebuilt["writer"] != writer
      # The damaged copy is gone (a directory is not renamable on GCS),
      # the key holds the new writer's only.
      prefix = str(key).removeprefix(f"gs://{bucket}/") + "/"
      assert {n[len(prefix):].split("/")[0] for n in emulator.object_names(
          bucket, prefix)} == {atomic.COMMIT_MARKER, rebuilt["writer"]}
      diff = _relative_diff(again.state["outer"]["params"], spmd)
      assert diff < 1e-6, diff
