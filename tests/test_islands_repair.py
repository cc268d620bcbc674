"""A damaged island key of each kind (module, outer state, contribution,
AdamW state, download copy) is detected by its reader, set aside and
rebuilt by what made it to the same bytes (`islands/repair.py`); what
cannot be rebuilt stops the run in one line; a store of other code is
refused."""

import dataclasses
import pathlib

import pytest

from dipaco_jax import code_version
from dipaco_jax.errors import UserError
from dipaco_jax.islands import coordinator as coordinator_lib
from dipaco_jax.islands import executor as executor_lib
from dipaco_jax.islands import launcher
from dipaco_jax.islands import layout
from dipaco_jax.islands import repair
from dipaco_jax.islands import task_runner as runner_lib
from dipaco_jax.store import atomic
from dipaco_jax.store import integrity
from dipaco_jax.store import items
import test_islands
import test_islands_replay as harness

H = harness.H


@pytest.fixture(scope="module")
def exp(tmp_path_factory):
  """A run of 2 rounds, 2 groups of 2 workers (`test_islands`)."""
  return test_islands._experiment(tmp_path_factory.mktemp("exp"),
                                  num_steps=2 * H)


def _start(exp, tmp_path, rounds):
  """A store that has run `rounds` whole rounds, with its runners."""
  run = tmp_path / "islands"
  spec = harness._setup(exp, run, 1)
  runners = [harness._runner(run, spec, f"w{g}") for g in range(2)]
  harness._rounds(exp, run, spec, lambda r, g: runners[g], range(rounds))
  return run, spec, runners


def _flip(key) -> None:
  """Flips a bit in the largest data file of a committed key."""
  files = [p for p in pathlib.Path(items.item_dir(key)).rglob("*") if p.is_file()
           and not p.name.startswith(".") and p.parent.name != "item"]
  path = max(files, key=lambda p: p.stat().st_size)
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0x01
  path.write_bytes(bytes(data))


def _collect(run, spec):
  """The coordinator's garbage collection, as `tick` runs it."""
  coord = coordinator_lib.Coordinator(run, spec, log=lambda _: None)
  coord._save_state([])  # pylint: disable=protected-access
  coord.collect_garbage()
  return coord


def _report(run, read, lines):
  with pytest.raises(integrity.DamagedKeyError) as e:
    read()
  return repair.report(run, e.value, "test", lines.append)


def _executor(run, spec):
  return executor_lib.Executor(run, spec,
                               executor_lib.owned_modules(spec, 0, 1),
                               "executor", log=lambda _: None)


def test_damaged_module_versions_are_rebuilt_by_their_executor(
    exp, tmp_path):
  run, spec, runners = _start(exp, tmp_path, 1)
  _collect(run, spec)
  slots = [s.name for s in exp.topology.slots]
  keys = [layout.module_dir(run, slots[0], 0, 1),
          layout.outer_state_dir(run, slots[-1], 0, 1)]
  before = [atomic.read_commit(k)["digests"] for k in keys]
  for key in keys:
    _flip(key)
  lines = []
  # Their readers: a worker's task of round 1; an executor's step of it.
  damaged = [_report(run, lambda: runners[0].run_task(
      runner_lib.Task(1, (0, 1))), lines)]
  likes = executor_lib.module_likes(spec)
  damaged.append(_report(run, lambda: items.load_tree(
      keys[1], likes((len(slots) - 1, 0, 0))[1]), lines))
  assert [(k.kind, k.version) for k in damaged] == [("modules", 1),
                                                     ("outer_state", 1)]
  assert not any(layout.committed(k) for k in keys)
  assert "damaged key modules/" in lines[0] and "\n" not in lines[0]
  assert (run / "damaged" / damaged[0].relative).exists()
  repair.rebuild_versions(_executor(run, spec), likes, "executor")
  # The same bytes, committed again; nothing left to do.
  assert [atomic.read_commit(k)["digests"] for k in keys] == before
  assert not repair.requests(run)
  runners[0].run_task(runner_lib.Task(1, (0, 1)))


@pytest.mark.parametrize("kind", ["contrib", "inner"])
def test_a_damaged_contribution_or_adamw_state_reruns_its_task(
    exp, tmp_path, kind):
  lines = []
  if kind == "contrib":
    # Round 1's tasks done, its outer step not yet: the executor reads
    # the contribution.
    run, spec, runners = _start(exp, tmp_path, 1)
    for g, group in enumerate(spec.groups()):
      runners[g].run_task(runner_lib.Task(1, group))
    key = layout.contrib_dir(run, 1, 0, exp.topology.slots[0].name)
    rerun = 1
    before = atomic.read_commit(key)["digests"]
    _flip(key)
    executor = _executor(run, spec)
    executor.poll(executor_lib.module_likes(spec), "executor")  # Reports.
    assert executor.next_version[(0, 0, 0)] == 2  # Waits for it.
  else:
    # Worker 0's AdamW state after round 0, read by a fresh worker's task
    # of round 1 (nothing kept in memory).
    run, spec, _ = _start(exp, tmp_path, 1)
    _collect(run, spec)
    key, rerun = layout.inner_dir(run, 0, H), 0
    before = atomic.read_commit(key)["digests"]
    _flip(key)
    fresh = harness._runner(run, spec, "x0")
    _report(run, lambda: fresh.run_task(runner_lib.Task(1, (0, 1))), lines)
  assert not layout.committed(key)
  coord = coordinator_lib.Coordinator(run, spec, log=lines.append)
  coord.tick()
  assert coord.frontier[0] == rerun and "re-queued" in lines[-1], lines
  assert not repair.requests(run)
  # The task runs again from its kept start state, and writes the bytes
  # that were damaged.
  harness._runner(run, spec, "y0").run_task(runner_lib.Task(rerun, (0, 1)))
  assert atomic.read_commit(key)["digests"] == before


def test_after_the_run_a_damaged_final_module_is_rebuilt_on_read(
    exp, tmp_path):
  run, spec, _ = _start(exp, tmp_path, 2)
  _collect(run, spec)  # Finished: version 2, and 1 to rebuild it from.
  assert {p.name for p in run.glob("modules/*/*/v*")} == {"v000001",
                                                          "v000002"}
  want = launcher.read_final_bank(run, exp.runtime, 2)
  _flip(layout.module_dir(run, exp.topology.slots[-1].name, 0, 2))
  lines = []
  bank = launcher.read_verified_bank(run, spec, exp.runtime, lines.append)
  harness._assert_same_bits(want, bank)
  assert any("rebuilt modules/" in l for l in lines), lines


def test_version_zero_is_refused_in_one_line_until_a_relaunch(exp, tmp_path):
  run = tmp_path / "islands"
  spec = harness._setup(exp, run, 1)
  key = layout.module_dir(run, exp.topology.slots[0].name, 0, 0)
  _flip(key)
  lines = []
  _report(run, lambda: harness._runner(run, spec, "w0").run_task(
      runner_lib.Task(0, (0, 1))), lines)
  repair.rebuild_versions(_executor(run, spec),
                          executor_lib.module_likes(spec), "executor")
  failed = layout.control_files(layout.control(run, "failed"))
  error = layout.read_json(failed[0])["error"]
  assert "modules/" in error and "run the same command again" in error
  assert "\n" not in error
  # A relaunch clears the refusal and rewrites version 0 from the seed.
  assert repair.on_relaunch(run)
  launcher.write_version_zero(run, exp.runtime, None, exp.config.seed)
  assert layout.committed(key)
  assert not layout.control_files(layout.control(run, "failed"))


def test_a_store_of_other_code_is_refused_in_one_line(exp, tmp_path):
  run = tmp_path / "islands"
  spec = dataclasses.replace(harness._setup(exp, run, 1),
                             code=code_version.code_version())
  spec.save(run)
  assert layout.RunSpec.load(run).code == code_version.code_version()
  dataclasses.replace(spec, code={"version": "0.0.9",
                                  "sha256": "0123456789abcdef"}).save(run)
  for join in (lambda: layout.RunSpec.load(run),
               lambda: launcher.check_spec(run, spec)):
    with pytest.raises(UserError, match=(
        r"written by dipaco_jax 0\.0\.9 \(code 0123456789abcdef\); this "
        r"is .*: join it with the same code")) as e:
      join()
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kind", ["download", "published"])
def test_a_damaged_download_copy_is_rebuilt_by_its_executor(tmp_path, kind):
  # Compressed downloads: version 1's change (read by a worker holding
  # version 0's copy) and its whole copy (read by a worker holding none).
  exp = test_islands._experiment(tmp_path / "exp", num_steps=2 * H,
                                 download_compression="int4")
  run, spec, runners = _start(exp, tmp_path, 1)
  _collect(run, spec)
  key = getattr(layout, f"{kind}_dir")(run, exp.topology.slots[0].name, 0, 1)
  before = atomic.read_commit(key)["digests"]
  _flip(key)
  reader = runners[0] if kind == "download" else harness._runner(
      run, spec, "x0")
  damaged = _report(run, lambda: reader.run_task(runner_lib.Task(1, (0, 1))),
                    [])
  assert damaged.kind == kind and damaged.version == 1
  repair.rebuild_versions(_executor(run, spec),
                          executor_lib.module_likes(spec), "executor")
  assert atomic.read_commit(key)["digests"] == before
  reader.run_task(runner_lib.Task(1, (0, 1)))
