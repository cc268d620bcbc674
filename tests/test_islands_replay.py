"""Committing the workers' inner states every K rounds
(`RunSpec.inner_state_every`, `islands/replay.py`): a task whose start
state is neither kept nor committed replays the rounds since the last
commit, and the run ends with the same bits as with K = 1."""

import dataclasses
import threading
import time

import jax
import numpy as np
import pytest

from dipaco_jax import testing
from dipaco_jax.errors import UserError
from dipaco_jax.islands import background
from dipaco_jax.islands import coordinator as coordinator_lib
from dipaco_jax.islands import executor as executor_lib
from dipaco_jax.islands import garbage
from dipaco_jax.islands import launcher
from dipaco_jax.islands import layout
from dipaco_jax.islands import repair
from dipaco_jax.islands import task_runner as runner_lib
from dipaco_jax.store import atomic
from dipaco_jax.store import integrity
import test_islands

H = 2  # Inner steps per round (test_islands._experiment's default).


def _setup(exp, run, every):
  spec = dataclasses.replace(test_islands._spec(exp, 2),
                             inner_state_every=every)
  launcher.write_version_zero(run, exp.runtime, None, exp.config.seed)
  spec.save(run)
  return spec


def _runner(run, spec, name, log=lambda _: None):
  return runner_lib.TaskRunner(run, spec, layout.ByteMeter(run, name),
                               log=log)


def _rounds(exp, run, spec, pick, rounds):
  """Runs `rounds` of every group in this process, task (r, g) on runner
  `pick(r, g)`, each round's outer steps after its tasks (an executor
  restarted per call finds every module at its last version)."""
  executor = executor_lib.Executor(
      run, spec, executor_lib.owned_modules(spec, 0, 1), "executor",
      log=lambda _: None)
  likes = executor_lib.module_likes(spec)
  for r in rounds:
    for g, group in enumerate(spec.groups()):
      executor.poll(likes)
      pick(r, g).run_task(runner_lib.Task(r, group))
    executor.poll(likes)
  del exp


def _final(exp, run, spec):
  return launcher.read_final_bank(run, exp.runtime, spec.num_rounds)


def _assert_same_bits(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)


def _inner_steps_on_store(run):
  """{worker: sorted steps} of the committed inner states."""
  out = {}
  for d in sorted((run / "inner").glob("*/s*")):
    if layout.committed(d):
      out.setdefault(int(d.parent.name), []).append(int(d.name[1:]))
  return out


def _written(run, role):
  return sum(layout.read_json(layout.control(run, "bytes", f"{role}.json"))
             ["written"].values())


def _check_written(k1_run, run, skipped):
  """The workers' written bytes (byte meters) of `run` are K = 1's less
  the inner states at steps `skipped`."""
  inner = sum(layout.directory_bytes(layout.inner_dir(k1_run, w, s))
              for w in range(4) for s in skipped)
  k1 = _written(k1_run, "w0") + _written(k1_run, "w1")
  k = _written(run, "w0") + _written(run, "w1")
  print(f"written by the workers: K = 1 {k1:,} B, here {k:,} B; inner "
        f"states not committed {inner:,} B")
  assert abs((k1 - k) - inner) < 1e-3 * inner, (k1, k, inner)


@pytest.fixture(scope="module")
def every_round(tmp_path_factory):
  """4 rounds, 2 groups of 2 workers, K = 1, one runner per group (its
  state kept between rounds, committed every round)."""
  tmp_path = tmp_path_factory.mktemp("k1")
  exp = test_islands._experiment(tmp_path, num_steps=4 * H)
  run = tmp_path / "islands"
  spec = _setup(exp, run, 1)
  runners = [_runner(run, spec, f"w{g}") for g in range(2)]
  _rounds(exp, run, spec, lambda r, g: runners[g], range(spec.num_rounds))
  return exp, run, jax.device_get(_final(exp, run, spec))


def test_moved_tasks_replay_and_end_with_the_same_bits(every_round,
                                                       tmp_path):
  exp, k1_run, want = every_round
  run = tmp_path / "islands"
  spec = _setup(exp, run, 2)
  lines = []
  # The groups alternate between the two runners: no task finds its start
  # state kept, and rounds 1 and 3 start from an uncommitted state.
  runners = [_runner(run, spec, f"w{i}", lines.append) for i in range(2)]
  _rounds(exp, run, spec, lambda r, g: runners[(r + g) % 2],
          range(spec.num_rounds))
  _assert_same_bits(want, _final(exp, run, spec))
  # One round replayed per group in rounds 1 and 3.
  assert sum(x.replayed_rounds for x in runners) == 4
  replays = [l for l in lines if "replayed" in l]
  assert len(replays) == 4 and "from round 2: 1 round(s)" in replays[-1], (
      replays)
  # Inner states only at the commit rounds' ends: step 2H (none at the
  # last round's, 4H, which no task starts from).
  assert _inner_steps_on_store(run) == {w: [2 * H] for w in range(4)}
  assert _inner_steps_on_store(k1_run) == {
      w: [H, 2 * H, 3 * H] for w in range(4)}
  # The byte meters: the same contributions, half the inner states (to
  # metadata's few bytes: the keys' files name their paths).
  _check_written(k1_run, run, skipped=(H, 3 * H))
  # A finished task is seen as done without its (absent) inner state.
  assert runners[0].is_done(runner_lib.Task(2, (0, 1)))
  assert coordinator_lib.Coordinator(run, spec, log=lambda _: None
                                     ).frontier == [4, 4]


def test_every_4_rounds_of_4_write_no_inner_state(every_round, tmp_path):
  # Each group on its own runner (as the coordinator's sticky leases do):
  # no replay, and no inner state: the only commit round is the last.
  exp, k1_run, want = every_round
  run = tmp_path / "islands"
  spec = _setup(exp, run, 4)
  runners = [_runner(run, spec, f"w{g}") for g in range(2)]
  _rounds(exp, run, spec, lambda r, g: runners[g], range(spec.num_rounds))
  _assert_same_bits(want, _final(exp, run, spec))
  assert [x.replayed_rounds for x in runners] == [0, 0]
  assert _inner_steps_on_store(run) == {}
  _check_written(k1_run, run, skipped=(H, 2 * H, 3 * H))


def test_a_replay_after_garbage_collection(every_round, tmp_path):
  exp, _, want = every_round
  run = tmp_path / "islands"
  spec = _setup(exp, run, 2)
  runners = [_runner(run, spec, f"w{g}") for g in range(2)]
  _rounds(exp, run, spec, lambda r, g: runners[g], range(3))
  coord = coordinator_lib.Coordinator(run, spec, log=lambda _: None)
  assert coord.frontier == [3, 3]
  # As `tick` does: the state saved before and (next pass) after.
  coord._save_state([])  # pylint: disable=protected-access
  coord.collect_garbage()
  coord._save_state([])  # pylint: disable=protected-access
  # Round 3 replays round 2 from the state of step 2H: version 2 stays
  # (with K = 1 too, as the version 3 was made from), older ones go.
  versions = {p.name for p in run.glob("modules/*/*/v*")}
  assert versions == {"v000002", "v000003"}, versions
  assert layout.committed(layout.inner_dir(run, 0, 2 * H))
  # Round 2's contributions stay with its version.
  assert sorted(p.name for p in (run / "contrib").iterdir()) == ["r000002"]
  fresh = [_runner(run, spec, f"x{g}") for g in range(2)]  # Restarted.
  _rounds(exp, run, spec, lambda r, g: fresh[g], [3])
  assert [x.replayed_rounds for x in fresh] == [1, 1]
  _assert_same_bits(want, _final(exp, run, spec))
  # The coordinator was killed after deleting versions 0 and 1 but before
  # saving that: its restart finds a record two versions behind.
  saved = layout.read_json(layout.control(run, "coordinator.json"))
  saved["collected"]["version"] = 0
  atomic.write_json(layout.control(run, "coordinator.json"), saved)
  coord = coordinator_lib.Coordinator(run, spec, log=lambda _: None)
  assert coord.frontier == [4, 4] and coord.run_done()
  coord.collect_garbage()
  # A finished store holds the final modules and the version before.
  assert {p.name for p in run.glob("modules/*/*/v*")} == {"v000003",
                                                          "v000004"}
  assert coord.garbage.record["version"] == 3
  assert _inner_steps_on_store(run) == {}


class _HeldDeletions:
  """A store after 3 rounds at K = 2 and `serve`'s coordinator, whose
  deletions (`islands/garbage.py`) wait in their first `atomic.remove`
  until `release` is set (always set on leaving, so no thread waits on)."""

  def __init__(self, every_round, tmp_path, monkeypatch):
    exp, _, _ = every_round
    self.run = tmp_path / "islands"
    spec = _setup(exp, self.run, 2)
    runners = [_runner(self.run, spec, f"w{g}") for g in range(2)]
    _rounds(exp, self.run, spec, lambda r, g: runners[g], range(3))
    self.entered, self.release = threading.Event(), threading.Event()
    remove = garbage.atomic.remove

    def held_remove(directory):
      self.entered.set()
      assert self.release.wait(timeout=60), "never released"
      remove(directory)

    monkeypatch.setattr(garbage.atomic, "remove", held_remove)
    self.lines, self.calls = [], []
    self.coord = coordinator_lib.Coordinator(
        self.run, spec, log=self.lines.append, collect_in_background=True)
    collect = self.coord.garbage.collect
    monkeypatch.setattr(self.coord.garbage, "collect",
                        lambda f: (self.calls.append(list(f)), collect(f)))
    self.coord._collector = background.OneAtATime(  # pylint: disable=protected-access
        self.coord.garbage.collect)
    self.slot = exp.topology.slots[0].name

  def saved_version(self) -> int:
    return layout.read_json(layout.control(
        self.run, "coordinator.json"))["collected"]["version"]

  def versions(self) -> set:
    return {p.name for p in self.run.glob("modules/*/*/v*")}

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.release.set()
    self.coord._collector.join()  # pylint: disable=protected-access


def test_the_coordinator_role_deletes_without_holding_up_a_lease(
    every_round, tmp_path, monkeypatch):
  # `serve`'s coordinator deletes in a thread: after a commit round at
  # K = 10 that is ten rounds of keys at once (2 s of idle worker on one
  # H200 when `tick` waited). A deletion held up here leaves `tick` free;
  # the record it saves lags the deletions, never leads them.
  with _HeldDeletions(every_round, tmp_path, monkeypatch) as held:
    assert not held.coord.tick()
    assert held.entered.wait(timeout=60)
    assert not held.coord.tick()  # The first deletion still going: no second.
    assert held.calls == [[3, 3]] and held.saved_version() == 0
    assert len(held.versions()) == 4
    held.release.set()
    held.coord._collector.join()  # pylint: disable=protected-access
    assert not held.coord.tick()
    assert held.saved_version() == 2
    assert held.versions() == {"v000002", "v000003"}


def test_a_repair_is_judged_once_the_deletions_are_through(
    every_round, tmp_path, monkeypatch):
  # Round 0's contribution is damaged while version 0 is being deleted:
  # the tick waits for the deletion, so it finds round 0's inputs gone and
  # stops the run in one line. Judged before, it would re-queue round 0 on
  # a version the thread then deletes.
  with _HeldDeletions(every_round, tmp_path, monkeypatch) as held:
    assert not held.coord.tick()
    assert held.entered.wait(timeout=60)
    key = layout.contrib_dir(held.run, 0, 0, held.slot)
    repair.report(held.run, integrity.DamagedKeyError(key, "a test"),
                  "test", held.lines.append)
    releaser = threading.Timer(0.5, held.release.set)
    releaser.start()
    held.coord.tick()
    releaser.join()
    assert "v000000" not in held.versions()
    failed = layout.read_json(layout.control(held.run, "failed",
                                             "repair-coordinator.json"))
    assert failed and "cannot be rebuilt" in failed["error"], failed
    assert not any(l.startswith("rebuilding") for l in held.lines), (
        held.lines)


def test_a_failed_background_run_fails_the_next_start():
  def fail(x):
    raise OSError(f"disk gone at {x}")
  one = background.OneAtATime(fail)
  one.start(1)
  for _ in range(6000):  # Bounded: a minute.
    if not one.running:
      break
    time.sleep(0.01)
  with pytest.raises(OSError, match="disk gone at 1"):
    one.start(2)
  one.start(3)
  with pytest.raises(OSError, match="disk gone at 3"):
    one.join()
  one.join()  # Nothing left to wait for.


def test_a_replay_advances_the_codec_carry(tmp_path):
  # int4 with error feedback (the residual is carried) and the shared slot
  # low rank (its warm start carried): replays re-encode every round, so
  # the carries, and then the payloads, are the same bits as with K = 1.
  settings = dict(compression="int4", error_feedback=True,
                  compression_block_size=64,
                  per_slot="shared=compression:lowrank+rank_max:2")
  banks = []
  for every in (1, 2):
    exp = test_islands._experiment(tmp_path / f"k{every}", num_steps=4 * H,
                                   **settings)
    run = tmp_path / f"k{every}" / "islands"
    spec = _setup(exp, run, every)
    runners = [_runner(run, spec, f"w{i}") for i in range(2)]
    _rounds(exp, run, spec, lambda r, g: runners[(r + g) % 2],
            range(spec.num_rounds))
    assert sum(x.replayed_rounds for x in runners) == (0 if every == 1
                                                       else 4)
    banks.append(_final(exp, run, spec))
  _assert_same_bits(*banks)


def _delayed_run(tmp_path, delay, every, pick, rounds, name="islands"):
  """A delayed run's store after `rounds`, task (r, g) on `pick(runners,
  r, g)` of two runners, with K = `every`: (exp, run, spec, log lines)."""
  exp = test_islands._experiment(
      tmp_path / f"k{every}", num_steps=4 * H, delay=delay,
      overlap_steps=1 if delay == "overlap" else 0)
  run = tmp_path / f"k{every}" / name
  spec = _setup(exp, run, every)
  lines = []
  runners = [_runner(run, spec, f"w{i}", lines.append) for i in range(2)]
  _rounds(exp, run, spec, lambda r, g: pick(runners, r, g), rounds)
  for x in runners:  # Their next rounds' prefetches wait for nothing.
    if x.prefetch is not None:
      x.prefetch.cancel.set()
  return exp, run, spec, lines


def _own(runners, r, g):
  del r
  return runners[g]


def _alternate(runners, r, g):
  return runners[(r + g) % 2]


# overlap's and eager's replays after a real kill:
# test_islands_processes.py.
@pytest.mark.parametrize("delay", ["one_round", "overlap", "eager"])
def test_delayed_tasks_replay_and_end_with_the_same_bits(tmp_path, delay):
  # One round late, overlapped or eager (islands/delayed.py): the anchor is
  # part of the state a replay rebuilds, from each replayed round's
  # version (overlap: read after tau steps of the replayed round; eager:
  # the view stepped by the worker's own outer optimizer from round
  # j - 1's payloads, its state in the codec carry). K = 1 with each
  # group on its own runner (nothing replayed) against K = 2 with the
  # groups alternating between two runners (rounds 1 and 3 replayed).
  banks, stores = [], []
  for every in (1, 2):
    exp, run, spec, lines = _delayed_run(
        tmp_path, delay, every, _own if every == 1 else _alternate,
        range(4))
    replays = [l for l in lines if "replayed" in l]
    assert len(replays) == (0 if every == 1 else 4), replays
    banks.append(_final(exp, run, spec))
    stores.append(_inner_steps_on_store(run))
  _assert_same_bits(*banks)
  assert stores == [{w: [H, 2 * H, 3 * H] for w in range(4)},
                    {w: [2 * H] for w in range(4)}]


def test_an_eager_replay_after_garbage_collection(tmp_path):
  # Eager with K = 2: round 3 of restarted workers replays round 2 from
  # the state of step 2H, stepping its view from round 1's payloads, so
  # the coordinator keeps round 1's contributions beside round 2's (and
  # a delay without eager's view keeps round 2's only, above).
  exp, run, spec, _ = _delayed_run(tmp_path, "eager", 2, _own, range(3))
  coord = coordinator_lib.Coordinator(run, spec, log=lambda _: None)
  assert coord.frontier == [3, 3]
  coord._save_state([])  # pylint: disable=protected-access
  coord.collect_garbage()
  coord._save_state([])  # pylint: disable=protected-access
  assert {p.name for p in run.glob("modules/*/*/v*")} == {"v000002",
                                                          "v000003"}
  assert sorted(p.name for p in (run / "contrib").iterdir()) == [
      "r000001", "r000002"]
  lines = []
  fresh = [_runner(run, spec, f"x{g}", lines.append) for g in range(2)]
  _rounds(exp, run, spec, lambda r, g: fresh[g], [3])
  assert [x.replayed_rounds for x in fresh] == [1, 1], lines
  k1_exp, k1_run, k1_spec, _ = _delayed_run(tmp_path, "eager", 1, _own,
                                            range(4), name="k1")
  _assert_same_bits(_final(k1_exp, k1_run, k1_spec),
                    _final(exp, run, spec))


def test_a_store_is_continued_only_with_its_own_k(every_round, tmp_path):
  # Replays and garbage collection follow K, so a store of K = 1 (its
  # spec saved) refuses K = 2, naming the flag and the value to use.
  exp, _, _ = every_round
  run = tmp_path / "islands"
  spec = _setup(exp, run, 1)
  launcher.check_spec(run, spec)
  with pytest.raises(UserError, match="--inner_state_every=1, or use"):
    launcher.check_spec(run, dataclasses.replace(spec, inner_state_every=2))


def test_inner_state_every_must_be_positive():
  config = testing.tiny_config("2x2", inner_steps=2, num_steps=4)
  with pytest.raises(UserError, match="inner_state_every .0. must be at"):
    launcher.check_config(config, launcher.IslandOptions(inner_state_every=0))
  config.diloco.delay = "one_round"
  launcher.check_config(config, launcher.IslandOptions(inner_state_every=2))


def test_commit_rounds():
  spec = dataclasses.replace(
      layout.RunSpec("r", {"diloco": {"inner_steps": 2},
                           "train": {"num_steps": 12}}, 0, "", 0, {}, [1.0],
                     1), inner_state_every=4)
  # Every 4 rounds, never at the last (round 5 of 6).
  assert [r for r in range(6) if spec.commits_inner(r)] == [3]
  assert [spec.last_commit_round(r) for r in range(6)] == [0, 0, 0, 0, 4, 4]
  every = dataclasses.replace(spec, inner_state_every=1)
  assert [r for r in range(6) if every.commits_inner(r)] == [0, 1, 2, 3, 4]
  assert [every.last_commit_round(r) for r in range(6)] == list(range(6))
