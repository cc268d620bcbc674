"""The island runtime as real processes (coordinator, workers, executor) on
this machine, with `kill -9` of each role during the run: the result equals
the run without failures, bit for bit."""

import json
import os
import pathlib
import random
import signal
import threading
import time

import jax
import numpy as np
import pytest

from dipaco_jax.islands import launcher
from dipaco_jax.islands import layout
import test_islands


def role_pids(run, role: str) -> list[int]:
  """Processes whose command line is `python -m dipaco_jax.islands.ROLE
  --store=RUN ...`."""
  pids = []
  for proc in pathlib.Path("/proc").iterdir():
    if not proc.name.isdigit():
      continue
    try:
      argv = (proc / "cmdline").read_bytes().split(b"\0")
    except OSError:
      continue
    if (f"dipaco_jax.islands.{role}".encode() in argv
        and f"--store={run}".encode() in argv):
      pids.append(int(proc.name))
  return pids


class Chaos(threading.Thread):
  """SIGKILLs one process of each role in `plan`, in order, every
  `every_s` seconds once the workers beat, until the run is done."""

  def __init__(self, run, plan, every_s: float, seed: int = 0):
    super().__init__(daemon=True)
    self.store, self.plan, self.every_s = run, list(plan), every_s
    self.rng = random.Random(seed)
    self.killed = []
    self.stop = threading.Event()

  def _run_started(self) -> bool:
    beats = layout.control(self.store, "heartbeat")
    return beats.exists() and any(beats.iterdir())

  def run(self):
    while not self._run_started() and not self.stop.wait(0.2):
      pass
    for role in self.plan:
      if self.stop.wait(self.every_s * (0.5 + self.rng.random())):
        return
      if layout.done_path(self.store).exists():
        return
      pids = role_pids(self.store, role)
      if pids:
        os.kill(self.rng.choice(pids), signal.SIGKILL)
        self.killed.append(role)


class KillAfterRound(Chaos):
  """Kills one worker (SIGKILL, or `sig`) once some contribution of round
  `r` is committed (the workers are then in rounds r .. r + 1)."""

  def __init__(self, run, round_index: int, sig=signal.SIGKILL):
    super().__init__(run, ["worker"], every_s=0.0)
    self.round_index, self.sig = round_index, sig

  def run(self):
    contribs = pathlib.Path(self.store, "contrib",
                            f"r{self.round_index:06d}")
    while not self.stop.wait(0.05):
      if layout.done_path(self.store).exists():
        return
      if any(layout.committed(d) for d in contribs.glob("*/*")):
        pids = role_pids(self.store, "worker")
        if pids:
          os.kill(self.rng.choice(pids), self.sig)
          self.killed.append("worker")
          return


def _train(tmp_path, name, chaos_plan=(), num_steps=16, stages=1,
           chaos=None, delay="none", **options):
  exp = test_islands._experiment(
      tmp_path / name, num_steps=num_steps, stages=stages, delay=delay,
      overlap_steps=1 if delay == "overlap" else 0)
  # Two executors for the five modules (dealt round robin, so each steps
  # several): three processes fewer to start (and to import JAX) per run.
  options = launcher.IslandOptions(**{
      **dict(num_workers=2, fake_devices=stages, num_executors=2,
             heartbeat_s=0.5, lease_timeout_s=4.0), **options})
  run = pathlib.Path(exp.run_dir).parent.parent / "islands" / exp.name
  # A kill about every 2 s: the five land within ~11 s of the first beat,
  # well before the end even though a restarted role finds its programs in
  # the session's compilation cache (conftest.py) and is back in seconds.
  chaos = chaos(run) if chaos else Chaos(run, chaos_plan, every_s=2.0)
  chaos.start()
  try:
    result = launcher.train_experiment(exp, options)
  finally:
    chaos.stop.set()
    chaos.join(timeout=10)
  return result, chaos.killed, run, exp


def test_kills_of_every_role_lose_nothing(tmp_path):
  calm, _, calm_run, _ = _train(tmp_path, "calm")
  plan = ["worker", "worker", "coordinator", "worker", "executor"]
  stormy, killed, run, _ = _train(tmp_path, "stormy", plan)
  assert killed == plan, f"the run ended before every kill: {killed}"
  for a, b in zip(jax.tree.leaves(calm.state["outer"]["params"]),
                  jax.tree.leaves(stormy.state["outer"]["params"])):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(calm.final_losses_W, stormy.final_losses_W)
  assert layout.done_path(run).exists()
  # Every role counted its store operations: per task, per outer step (its
  # module and outer state: two array writes) and per polling iteration
  # (the slow-store model of docs/islands.md).
  stats = json.loads(pathlib.Path(calm_run, "stats.json").read_text())
  assert set(stats["loop_store_ops"]) == {"coordinator", "executor",
                                          "worker"}
  assert all(v > 0 for v in stats["loop_store_ops"].values())
  assert stats["mean_task_store_ops"]["put"] >= 1  # Its contributions.
  assert stats["mean_outer_step_store_ops"]["put"] == 2
  # The coordinator collected what no one reads again: the final modules
  # remain, with the version and round they were made from (for a
  # rebuild, islands/repair.py).
  versions = {p.name for p in pathlib.Path(run, "modules").glob("*/*/v*")}
  assert versions == {"v000007", "v000008"}
  assert [p.name for p in pathlib.Path(run, "contrib").glob("r*")] == [
      "r000007"]
  # A run already done is read back without starting a role.
  started = time.monotonic()
  again, _, _, _ = _train(tmp_path, "calm")
  assert time.monotonic() - started < 30
  assert not role_pids(calm_run, "worker")
  for a, b in zip(jax.tree.leaves(calm.state["outer"]["params"]),
                  jax.tree.leaves(again.state["outer"]["params"])):
    np.testing.assert_array_equal(a, b)


def test_pipelined_units_survive_kills(tmp_path):
  # 2 pipeline stages per worker (2 fake devices each): each layer slot is
  # 2 units per module, dealt to the 2 executors; kills of a worker, an
  # executor and the coordinator, then the result equals the same run in
  # one process (another mesh: one path per task on 8 devices there, so
  # the tolerance of test_islands' one-path tasks) and only the last two
  # versions of the units remain.
  plan = ["worker", "executor", "coordinator"]
  stormy, killed, run, exp = _train(tmp_path, "stormy", plan, num_steps=8,
                                    stages=2)
  assert killed == plan, f"the run ended before every kill: {killed}"
  want = test_islands._islands_in_process(exp, tmp_path / "in_process", 1)
  diff = test_islands._max_abs_diff(want, stormy.state["outer"]["params"])
  assert diff < 1e-5, diff
  versions = {str(p.relative_to(run)) for p in
              pathlib.Path(run, "modules").glob("**/v*")}
  assert versions == {
      f"modules/{slot.name}{stage}/{e:05d}/v{v:06d}"
      for slot in exp.topology.slots for e in range(slot.num_experts)
      for stage in (("/stage0", "/stage1") if slot.layers else ("",))
      for v in (3, 4)}
  assert [p.name for p in pathlib.Path(run, "contrib").glob("r*")] == [
      "r000003"]


def test_a_killed_eager_worker_replays_from_its_committed_view(tmp_path):
  # delay=eager (islands/eager.py) with real processes, 6 rounds: each
  # worker's own outer step on its view, from round r - 1's payloads,
  # which it reads off the store while the coordinator collects what it
  # deems unread. Start states are committed every 3 rounds (after round
  # 2 only); a worker killed once some contribution of round 4 is
  # committed (so in round 4 or 5) comes back, or its task goes to the
  # other, with nothing kept, and replays from round 3's committed view
  # and outer state, stepping the view of round 3 from round 2's
  # payloads, which the coordinator kept for it: the run with every state
  # committed and no kill, bit for bit. (That islands' eager is the SPMD
  # runtime's: test_islands.py.)
  calm, _, _, _ = _train(tmp_path, "calm", num_steps=12, paths_per_task=2,
                         delay="eager")
  stormy, killed, run, _ = _train(
      tmp_path, "stormy", num_steps=12, paths_per_task=2, delay="eager",
      inner_state_every=3, chaos=lambda run: KillAfterRound(run, 4))
  assert killed == ["worker"], "the run ended before the kill"
  for a, b in zip(jax.tree.leaves(calm.state["outer"]["params"]),
                  jax.tree.leaves(stormy.state["outer"]["params"])):
    np.testing.assert_array_equal(a, b)
  logs = "".join(p.read_text() for p in pathlib.Path(run, "logs").glob(
      "worker_*.log"))
  assert "start state replayed from round 3" in logs
  assert {p.name for p in pathlib.Path(run, "modules").glob("*/*/v*")} == {
      "v000005", "v000006"}


@pytest.mark.parametrize("delay,kill_after,sig", [
    ("none", 1, signal.SIGTERM), ("one_round", 2, signal.SIGKILL),
    ("overlap", 2, signal.SIGKILL)])
def test_a_killed_worker_replays_with_inner_state_every(tmp_path, delay,
                                                        kill_after, sig):
  # AdamW states (one round late or overlapped, islands/delayed.py: with
  # the anchors)
  # committed every 4 rounds (of 8: after round 3 only), one group of 2
  # paths per worker; a worker killed once round `kill_after` is committed
  # comes back with nothing kept: its next task replays from the fresh
  # init (delayed: two or three rounds, so the next anchors of rounds 1
  # and up, made from versions 1 and up, are replayed too, where a wrong
  # rule would show). The result is the run with every state committed
  # (and no kill), bit for bit; only the final modules remain.
  calm, _, _, _ = _train(tmp_path, "calm", paths_per_task=2, delay=delay)
  stormy, killed, run, _ = _train(
      tmp_path, "stormy", paths_per_task=2, delay=delay,
      inner_state_every=4,
      chaos=lambda run: KillAfterRound(run, kill_after, sig))
  assert killed == ["worker"], "the run ended before the kill"
  for a, b in zip(jax.tree.leaves(calm.state["outer"]["params"]),
                  jax.tree.leaves(stormy.state["outer"]["params"])):
    np.testing.assert_array_equal(a, b)
  logs = "".join(p.read_text() for p in pathlib.Path(run, "logs").glob(
      "worker_*.log"))
  assert "start state replayed from round 0" in logs
  if sig == signal.SIGTERM:  # A preemption notice: one line, task back.
    assert "SIGTERM: stopped; committed keys stay" in logs
    coordinator = pathlib.Path(run, "logs", "coordinator.log").read_text()
    assert "left (preempted)" in coordinator
  assert {p.name for p in pathlib.Path(run, "modules").glob("*/*/v*")} == {
      "v000007", "v000008"}
  assert not list(pathlib.Path(run, "inner").glob("*/s*"))
