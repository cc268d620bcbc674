"""The island runtime in one process: tasks, outer executors and the
coordinator's scheduling against the SPMD runtime, and the coordinator's
leases with simulated workers. (The multi-process runs with kills are in
test_islands_processes.py.)"""

import dataclasses
import json
import pathlib
import time
import types

import jax
import numpy as np
import pytest

from dipaco_jax import paths as paths_lib
from dipaco_jax import testing
from dipaco_jax.data import shards as shards_lib
from dipaco_jax.data import token_store
from dipaco_jax.errors import UserError
from dipaco_jax.islands import coordinator as coordinator_lib
from dipaco_jax.islands import delayed as delayed_lib
from dipaco_jax.islands import downloads as downloads_lib
from dipaco_jax.islands import executor as executor_lib
from dipaco_jax.islands import launcher
from dipaco_jax.islands import layout
from dipaco_jax.islands import roles as roles_lib
from dipaco_jax.islands import run_stats
from dipaco_jax.islands import task_runner as runner_lib
from dipaco_jax.islands import timeline
from dipaco_jax.islands import unit_io
from dipaco_jax.stages import experiment as experiment_lib
from dipaco_jax.store import atomic
from dipaco_jax.store import items
from dipaco_jax.store import link


@dataclasses.dataclass
class _Data:
  """The part of a DataBundle an Experiment reads."""
  vocab_size: int
  hashes: dict


def _experiment(tmp_path, shape="2x2", replicas=1, num_steps=6, h=2,
                delay="none", stages=1, **diloco):
  config = testing.tiny_config(shape, replicas=replicas, inner_steps=h,
                               num_steps=num_steps)
  config.pipeline.stages = stages
  config.pipeline.microbatches = stages
  config.ckpt.async_save = False
  config.diloco.delay = delay
  config.diloco.update(diloco)
  rng = np.random.default_rng(0)
  lengths = rng.integers(30, 200, 60)
  docs = token_store.TokenDocs(
      rng.integers(4, testing.TINY_VOCAB, lengths.sum()).astype(np.int32),
      np.concatenate([[0], np.cumsum(lengths)]))
  workers = len(testing.tiny_runtime(config).outer_weights_W)
  ids = [np.arange(w, 60, workers) for w in range(workers)]
  shard_dir = tmp_path / "shards"
  manifest = shards_lib.write_shards(str(shard_dir), docs, ids, {"t": "0"})
  data = _Data(testing.TINY_VOCAB, {"corpus": "c0", "tokenizer": "t0"})
  return experiment_lib.Experiment(config, data, tmp_path, "dipaco",
                                   shard_dir, manifest)


def _spec(exp, paths_per_task, steps_per_dispatch=1):
  config = layout.config_to_json_dict(exp.config)
  config["train"]["steps_per_dispatch"] = steps_per_dispatch
  return layout.RunSpec(
      name=exp.name, config=config,
      vocab_size=exp.data.vocab_size, shard_dir=str(exp.shard_dir),
      data_seed=exp.data_seed, hashes=exp.hashes,
      weights_W=[float(w) for w in exp.runtime.outer_weights_W],
      paths_per_task=paths_per_task)


# The worker's compiled programs (`TaskRunner.program`) of the last spec
# run in this process: a test's island runs of one spec (kept and
# forgotten) share them, as one worker process does across its tasks, so
# only the first traces them. The executors still build their own. One
# spec at a time, so a test module does not hold every test's programs.
_PROGRAMS = {"spec": None, "programs": {}}


def _shared_programs(spec) -> dict:
  key = json.dumps(dataclasses.asdict(spec), sort_keys=True)
  if _PROGRAMS["spec"] != key:
    _PROGRAMS.update(spec=key, programs={})
  return _PROGRAMS["programs"]


def _islands_in_process(exp, run, paths_per_task, forget=False,
                        steps_per_dispatch=1, trace_dir=None,
                        restart_executor=False):
  """Every task and outer step of the run, in order, in this process.
  With `forget`, the worker keeps nothing between tasks (as if each were
  another worker's): every round reads its inner state from the store.
  With `trace_dir`, the worker traces `train.profile_steps` there. With
  `restart_executor`, each round's outer steps are a new executor's (as
  after a kill: it carries on from the store)."""
  spec = _spec(exp, paths_per_task, steps_per_dispatch)
  launcher.write_version_zero(run, exp.runtime, None, exp.config.seed)
  spec.save(run)
  runner = runner_lib.TaskRunner(run, spec, layout.ByteMeter(run, "w"),
                                 log=lambda _: None, trace_dir=trace_dir)
  runner._programs = _shared_programs(spec)  # pylint: disable=protected-access
  with runner.tracer:
    return _run_every_task(exp, run, spec, runner, forget, restart_executor)


def _run_every_task(exp, run, spec, runner, forget, restart_executor=False):
  new_executor = lambda: executor_lib.Executor(
      run, spec, executor_lib.owned_modules(spec, 0, 1), "executor",
      log=lambda _: None)
  executor = new_executor()
  likes = executor_lib.module_likes(spec)
  for r in range(spec.num_rounds):
    if restart_executor:
      executor = new_executor()
    stepped = 0
    for group in spec.groups():
      stepped += executor.poll(likes)  # A module waits for all its users.
      if forget:
        runner._kept = runner.kept = runner.speculated = None  # pylint: disable=protected-access
        if runner.prefetch is not None:  # Overlap's read of the next version.
          runner.prefetch.cancel.set()
          runner.prefetch.thread.join()
          runner.prefetch = None
        runner.downloads.forget()
      runner.run_task(runner_lib.Task(r, group))
    assert stepped + executor.poll(likes) == len(executor.modules)
  assert executor.finished()
  return launcher.read_final_bank(run, exp.runtime, spec.num_rounds)


def _max_abs_diff(a, b):
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.fixture(scope="module")
def spmd_run(tmp_path_factory):
  """The experiment and its bank trained by the SPMD runtime, once."""
  tmp_path = tmp_path_factory.mktemp("spmd")
  exp = _experiment(tmp_path)
  return exp, jax.device_get(exp.train().state["outer"]["params"])


@pytest.mark.parametrize("paths_per_task,steps_per_dispatch",
                         [(4, 1), (1, 1), (4, 2)])
def test_islands_equal_the_spmd_runtime(spmd_run, tmp_path, paths_per_task,
                                        steps_per_dispatch):
  """(With 2 steps per dispatch, a worker's round of H = 2 is one call.)"""
  exp, spmd = spmd_run
  bank = _islands_in_process(exp, tmp_path / "islands", paths_per_task,
                             steps_per_dispatch=steps_per_dispatch)
  diff = _max_abs_diff(spmd, bank)
  # Not bit for bit: the per-module outer step is a program of its own
  # (other XLA fusions of the same float32 formulas), and one path per task
  # runs on a mesh of another shape (data-parallel over 8 devices instead
  # of 2: reductions in another order). Measured: 1.2e-7 with every path in
  # one task, i.e. one float32 rounding step.
  assert diff < (1e-6 if paths_per_task == 4 else 1e-5), diff


def test_a_worker_traces_the_profile_steps_of_its_rounds(spmd_run, tmp_path):
  # Steps 3-4 are round 1 (H = 2): traced by the worker that runs them,
  # without changing a number.
  exp, spmd = spmd_run
  exp.config.train.profile_steps = "3:2"
  try:
    bank = _islands_in_process(exp, tmp_path / "islands", 4,
                               trace_dir=tmp_path / "trace")
  finally:
    exp.config.train.profile_steps = ""
  assert _max_abs_diff(spmd, bank) < 1e-6
  assert list((tmp_path / "trace").rglob("*.xplane.pb"))


@pytest.mark.parametrize("delay,tau,factor_bits,codec", [
    ("none", 0, 0, "int4"), ("one_round", 0, 0, "int4"),
    ("overlap", 1, 0, "int4"), ("overlap", 2, 0, "int4"),
    ("none", 0, 4, "int4"), ("none", 0, 4, "int4_per_layer"),
    ("none", 0, 0, "topk_senders"), ("none", 0, 0, "topk_elias_fano"),
    ("eager", 0, 0, "int4"), ("eager", 0, 0, "none")])
def test_compressed_islands_equal_the_spmd_simulation(tmp_path, monkeypatch,
                                                      delay, tau,
                                                      factor_bits, codec):
  # DiLoCoX on islands (islands/delayed.py: one_round; overlap at tau = 1
  # of H = 2, version 1 applied after round 1's first step, and at tau =
  # H, after its last) and compression for real (islands/wire.py):
  # workers write int4 payloads
  # with error feedback (the residual travels with the AdamW state), the
  # shared slot low rank (its warm start carried too), and the executors
  # decode them (with factor_bits 4, the low-rank factors as int4 too);
  # against the SPMD runtime's simulation, 2 rounds, every round's inner
  # state read back from the store. topk_senders: every slot top-k with
  # error feedback, each coordinate averaged over the workers that sent it
  # (diloco.sparse_aggregate=senders, in the executors too). eager
  # (islands/eager.py): each worker's own outer step on its view from
  # round r - 1's payloads, which it reads and mixes itself; with int4 and
  # the low rank, and in float32.
  settings = dict(delay=delay, compression="int4", error_feedback=True,
                  compression_block_size=64,
                  per_slot=("shared=compression:lowrank+rank_max:2"
                            f"+factor_bits:{factor_bits}"),
                  overlap_steps=tau)
  if codec == "int4_per_layer":
    # The low rank on a slot of two stacked layers, each layer coded alone
    # (per-layer payloads on the wire), the embedding int4.
    settings.update(compression_matrix="per_layer", per_slot=(
        "layers_00_01=compression:lowrank+rank_max:2+factor_bits:4"))
  if codec in ("topk_senders", "topk_elias_fano"):
    settings.update(compression="topk", compression_topk_fraction=0.1,
                    sparse_aggregate="senders", per_slot="")
  if codec == "topk_elias_fano":  # Chunked, indices as Elias-Fano streams.
    settings.update(compression_topk_chunk=64,
                    compression_index_code="elias_fano")
  if codec == "none":  # float32 contributions, no carry but eager's own.
    settings.update(compression="none", error_feedback=False, per_slot="")
  exp = _experiment(tmp_path / "spmd", num_steps=4, **settings)
  spmd = jax.device_get(exp.train().state["outer"]["params"])
  run = tmp_path / "islands"
  # Contribution rows the worker reads (its meter is `w`'s; the executor
  # reads them all).
  worker_reads = []
  read_contributions = unit_io.read_contributions

  def counted(run_, wire, meter, round_index, users, *rest):
    if meter.path.name == "w.json":
      worker_reads.append(len(users))
    return read_contributions(run_, wire, meter, round_index, users, *rest)
  monkeypatch.setattr(unit_io, "read_contributions", counted)
  # All paths in one task: the SPMD run's mesh, so the same roundings (on
  # another mesh a 1e-7 difference can flip an int4 code: one step).
  bank = _islands_in_process(exp, run, 4, forget=True)
  assert _max_abs_diff(spmd, bank) < 1e-6, _max_abs_diff(spmd, bank)
  # Eager from the store: round 1 reads every user's payload of round 0.
  assert sum(worker_reads) == (4 * 3 if delay == "eager" else 0), (
      worker_reads)
  if delay == "overlap" or (delay, codec) == ("eager", "int4"):
    # Kept between tasks: round 1's first tau steps (eager: all of round
    # 1, from the view kept on device) trained beside round 0's uploads
    # (`delayed.train(..., partial=True)`), finished once the task is
    # handed over; the same numbers. Eager then mixes its own payloads of
    # round 0 as it kept them: one task holds every path, so it reads none.
    worker_reads.clear()
    kept = _islands_in_process(exp, tmp_path / "kept", 4)
    assert _max_abs_diff(spmd, kept) < 1e-6, _max_abs_diff(spmd, kept)
    assert sum(worker_reads) == 0, worker_reads
  # What went on the wire: the payloads' bytes (commit markers), against
  # float32 contributions (4 workers x one module per slot x 2 rounds).
  sent = sum(atomic.read_commit(d)["bytes"] for d in
             (run / "contrib").glob("r*/*/*"))
  floats = 4 * 2 * sum(x.size // x.shape[0] for x in jax.tree.leaves(spmd))
  if codec == "none":
    assert sent == 4 * floats, (sent, 4 * floats)
  else:
    assert 0 < sent < 4 * floats / 5, (sent, 4 * floats)


def test_eager_islands_with_a_group_per_path_equal_the_spmd_simulation(
    tmp_path):
  # One path per task (four groups, DiPaCo 2x2), each worker's state kept
  # between its tasks: a group's thread reads and mixes round r - 1 while
  # round r trains (islands/eager.py's prefetch), waiting on the other
  # groups' payloads of modules they share. Another mesh than the SPMD
  # run's, so not to the last bit (as test_islands_equal_the_spmd_runtime;
  # measured: 1.2e-7 after 3 rounds).
  exp = _experiment(tmp_path / "spmd", delay="eager", outer_lr=0.35)
  spmd = jax.device_get(exp.train().state["outer"]["params"])
  bank = _islands_in_process(exp, tmp_path / "islands", 1)
  assert _max_abs_diff(spmd, bank) < 1e-5, _max_abs_diff(spmd, bank)


# Delay none takes overlap's reads without the prefetch thread; it runs
# top-k both ways (the sparse aggregate up). strided both ways: the
# executors' download phase is their round's, the workers' upload phase
# their carried round count's; they must agree with the SPMD run's.
@pytest.mark.parametrize("delay,tau,codec", [
    ("overlap", 1, "int4"), ("none", 0, "topk"), ("overlap", 1, "strided")])
def test_compressed_downloads_on_islands_equal_the_spmd_simulation(
    tmp_path, monkeypatch, delay, tau, codec):
  # diloco.download_compression for real (islands/downloads.py): the
  # executors publish each version's change for the workers' copy (int4,
  # or top-k at its own download_topk_fraction); a worker that holds its
  # copy reads the change, one that does not (every task as another
  # worker's) reads the copy whole, as does a restarted executor; all
  # train from the same bits as the SPMD simulation's copy.
  # Under overlap (tau = 1 of H = 2): its apply and its prefetch read the
  # copies too.
  settings = dict(delay=delay, overlap_steps=tau, compression=codec,
                  error_feedback=True, compression_block_size=64,
                  compression_topk_fraction=0.05, compression_topk_chunk=64,
                  sparse_aggregate="senders", download_compression=codec,
                  download_topk_fraction=0.1 if codec == "topk" else 0.0)
  if codec == "strided":
    settings.update(compression_stride=2, sparse_aggregate="mean")
  exp = _experiment(tmp_path / "spmd", num_steps=4, **settings)
  spmd = jax.device_get(exp.train().state["outer"]["params"])
  reads = []
  add = layout.ByteMeter.add
  monkeypatch.setattr(layout.ByteMeter, "add", lambda self, kind, r, d: (
      reads.append((self.path.stem, kind, d)), add(self, kind, r, d)))

  def read_keys(role, kind):
    return [d.relative_to(tmp_path).parts[1]
            for stem, k, d in reads if stem == role and k == "read"
            and d.relative_to(tmp_path).parts[1] in kind]
  for forget in (False, True):
    run = tmp_path / f"islands_forget{forget}"
    reads.clear()
    bank = _islands_in_process(exp, run, 4, forget=forget,
                               restart_executor=forget)
    assert _max_abs_diff(spmd, bank) < 1e-6, _max_abs_diff(spmd, bank)
    # Version 1 of each of the 2 x 2 + 1 modules (version 0 is the module
    # itself; a DiPaCo 2x2 task's group uses every module): the changes, or
    # when forgotten the copies whole (under overlap the worker may also
    # have read the changes ahead, in its prefetch before it forgot). The
    # executor keeps its copies and reads none back, unless restarted: then
    # round 1's outer step reads the copies of version 1 whole.
    read = read_keys("w", ("download", "published"))
    if forget:
      assert read.count("published") == 5, read
    else:
      assert read == ["download"] * 5, read
    assert read_keys("executor", ("download", "published")) == (
        ["published"] * 5 if forget else [])
  change = atomic.read_commit(run / "download" / "embed_head" / "00000" /
                              "v000001")["bytes"]
  whole = atomic.read_commit(run / "published" / "embed_head" / "00000" /
                             "v000001")["bytes"]
  assert 0 < change < whole / 5, (change, whole)


def test_a_workers_copies_stay_within_its_download_cache():
  # --download_cache_mb: copies beyond the budget go, the least recently
  # used first (reading a copy counts as a use); one that went is read
  # whole at its next use, so only bytes change, never the numbers.
  config = testing.tiny_config("2x2")
  config.diloco.download_compression = "int4"
  slots = paths_lib.topology_from_config(config).slots
  copy = {"w": np.zeros((256,), np.float32)}  # 1 kB a copy.
  downloads = downloads_lib.Downloads(config, slots, max_bytes=2048)
  downloads.remember("a", 0, 1, copy)
  downloads.remember("a", 1, 1, copy)
  assert downloads.held("a", 0, 1) is copy  # Now the most recent.
  downloads.remember("b", 0, 1, copy)  # Over 2 kB: ("a", 1) goes.
  assert downloads.held("a", 1, 1) is None
  assert downloads.held("a", 0, 1) is copy
  assert downloads.held("b", 0, 1) is copy
  assert downloads.held_bytes() == 2048
  # A copy larger than the budget is still kept, alone, until the next.
  downloads.remember("c", 0, 1, {"w": np.zeros((1024,), np.float32)})
  assert downloads.held_bytes() == 4096
  assert downloads.held("a", 0, 1) is None
  unlimited = downloads_lib.Downloads(config, slots)
  for e in range(8):
    unlimited.remember("a", e, 1, copy)
  assert unlimited.held_bytes() == 8 * 1024
  # The launcher hands the budget to the workers it starts.
  options = launcher.IslandOptions(num_workers=1, download_cache_mb=64.0)
  worker = [r for r in roles_lib.make_roles("RUN", options, 5)
            if r.name.startswith("worker")][0]
  assert "--download_cache_mb=64.0" in worker.command


@pytest.mark.parametrize("delay", ["one_round", "overlap"])
def test_a_delayed_tasks_phases_add_up_to_its_time(tmp_path, monkeypatch,
                                                  delay):
  # The launcher's steady-state clock starts at the first task's start
  # plus its `compute` (run_stats._after_round0), so round 0's `compute`
  # must hold the building of the worker's program too: the task's clock
  # starts before the program is asked for.
  exp = _experiment(tmp_path / "spmd", num_steps=4, delay=delay,
                    overlap_steps=1 if delay == "overlap" else 0)
  seen, programs_asked = [], []
  run_delayed = delayed_lib.run_task
  program = runner_lib.TaskRunner.program

  def asked(self, size):
    programs_asked.append(time.monotonic())
    return program(self, size)

  def timed(runner, task, program, t0):
    losses, phases = run_delayed(runner, task, program, t0)
    seen.append((t0, time.monotonic() - t0, phases))
    return losses, phases
  monkeypatch.setattr(runner_lib.TaskRunner, "program", asked)
  monkeypatch.setattr(delayed_lib, "run_task", timed)
  _islands_in_process(exp, tmp_path / "islands", 4)
  assert len(seen) == 2  # Two rounds of one task.
  assert programs_asked and min(programs_asked) >= seen[0][0]
  for _, elapsed, phases in seen:
    # wait_version and wait_in_compute are parts of wait and compute.
    accounted = sum(v for k, v in phases.items()
                    if k not in ("wait_version", "wait_in_compute"))
    # Consecutive clock readings: only the return lies outside them (a
    # bound that a loaded 2-core machine's scheduling cannot break; a
    # missing phase, such as the uploads' tail, is tenths of a second).
    assert 0 <= elapsed - accounted < 0.05, (elapsed, phases)
    # The plot's bar: the same total, the mid-round wait split out.
    parts = timeline.plot_parts(phases)
    assert sum(v for _, v in parts) == pytest.approx(accounted)
    assert ("wait_in_compute" in phases) == (delay == "overlap")


def test_a_plain_tasks_phases_and_the_outer_steps_phases(tmp_path,
                                                       monkeypatch):
  # Without a delay a task reads, trains and writes; the executor reads,
  # steps and writes each unit; both sum to their totals.
  exp = _experiment(tmp_path / "spmd", num_steps=4)
  seen = []
  run_task = runner_lib.TaskRunner.run_task

  def timed(self, task):
    t0 = time.monotonic()
    losses = run_task(self, task)
    seen.append((time.monotonic() - t0, dict(self.phases)))
    return losses
  monkeypatch.setattr(runner_lib.TaskRunner, "run_task", timed)
  _islands_in_process(exp, tmp_path / "islands", 4)
  assert len(seen) == 2
  for elapsed, phases in seen:
    assert tuple(phases) == timeline.SYNC_PHASES
    assert all(v >= 0 for v in phases.values())
    assert sum(phases.values()) <= elapsed
    assert [k for k, _ in timeline.plot_parts(phases)] == list(phases)
  stats = layout.read_json(layout.control(tmp_path / "islands", "stats",
                                          "executor.json"))
  assert tuple(stats["phases_s"]) == executor_lib.EXECUTOR_PHASES
  assert sum(stats["phases_s"].values()) == pytest.approx(stats["seconds"])
  mean = run_stats._mean_outer_step_phases({"executor": stats})  # pylint: disable=protected-access
  assert sum(mean.values()) == pytest.approx(
      stats["seconds"] / stats["outer_steps"])
  # Each outer step writes its module and its outer optimizer state (two
  # array transfers) and reads at least one contribution.
  assert stats["store_ops"]["put"] == 2 * stats["outer_steps"]
  assert stats["store_ops"]["get"] >= stats["outer_steps"]


def test_a_roles_loop_ops_are_saved_before_its_loop_ends(tmp_path):
  # The launcher stops the roles still running once the run is done: a
  # role stopped before its loop saw it still left its count, from its
  # first iteration on, and each save stays out of the counted window.
  loop = timeline.LoopOps(tmp_path, "worker_w0", save_every_s=3600.0)
  saved = lambda: layout.read_json(loop.path)
  for gets in (2, 4):
    loop.start()
    for _ in range(gets):
      link.operation("get")
    loop.end()
  assert saved() == {"iterations": 1, "ops": {"get": 2}}
  loop.save_every_s = 0.0
  loop.start()
  link.operation("exists")
  link.operation("get")
  loop.end(work={"get": 1})  # A task's own operation.
  assert saved() == {"iterations": 3, "ops": {"exists": 1, "get": 6}}
  assert timeline.loop_ops(tmp_path) == {"worker": 7 / 3}


def test_an_executor_holds_its_newest_versions_within_its_bound(tmp_path):
  # Oldest out once the held bytes pass the bound; a key's bytes read from
  # its marker equal the walk of its files and the marker.
  held = types.SimpleNamespace(held={}, hold_bytes=3 * 4096)
  tree = {"w": np.zeros((1024,), np.float32)}  # 4096 B
  for unit in ("a", "b"):
    executor_lib.Executor._hold(held, unit, 1, tree, tree)  # pylint: disable=protected-access
  assert list(held.held) == ["b"]  # "a" and "b" together: 16 kB > 12 kB.
  held.hold_bytes = 4 * 4096
  executor_lib.Executor._hold(held, "c", 2, tree, tree)  # pylint: disable=protected-access
  assert list(held.held) == ["b", "c"] and held.held["c"][0] == 2
  key = tmp_path / "key"
  items.save_tree(key, tree)
  assert layout.key_bytes(key) == layout.directory_bytes(key)


def _fresh_store(tmp_path, paths_per_task, num_steps=2):
  """A run's store at version 0, its spec and a task runner on it."""
  exp = _experiment(tmp_path, num_steps=num_steps)
  run = tmp_path / "islands"
  spec = _spec(exp, paths_per_task)
  launcher.write_version_zero(run, exp.runtime, None, 0)
  spec.save(run)
  runner = runner_lib.TaskRunner(run, spec, layout.ByteMeter(run, "w"),
                                 log=lambda _: None)
  return run, spec, runner


def test_rerunning_a_task_writes_nothing_new(tmp_path):
  run, _, runner = _fresh_store(tmp_path, 2)
  task = runner_lib.Task(0, (0, 1))
  assert runner.run_task(task)
  key = layout.contrib_dir(run, 0, 0, runner.slot_names[0])
  files = lambda: {p: p.read_bytes()
                   for p in pathlib.Path(key).rglob("*") if p.is_file()}
  before = files()
  assert runner.run_task(task) == {}  # Already committed: not run again.
  assert before == files()


def test_a_half_written_contribution_is_never_used(tmp_path):
  run, spec, runner = _fresh_store(tmp_path, 4)
  runner.run_task(runner_lib.Task(0, (0, 1, 2, 3)))
  # Worker 3's contribution to every slot loses its commit marker, as if
  # its writer died between the item and the marker.
  for name in runner.slot_names:
    (layout.contrib_dir(run, 0, 3, name) / atomic.COMMIT_MARKER).unlink()
  executor = executor_lib.Executor(
      run, spec, executor_lib.owned_modules(spec, 0, 1), "executor",
      log=lambda _: None)
  likes = executor_lib.module_likes(spec)
  executor.poll(likes)
  # Modules worker 3 uses wait; the others (not used by it) step.
  topology = spec.topology()
  for s, slot in enumerate(topology.slots):
    for e in range(slot.num_experts):
      uses = e in topology.assignment_WxS[3:4, s]
      assert layout.committed(layout.module_dir(run, slot.name, e, 1)) == (
          not uses), (slot.name, e)


class _FakeClock:
  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


def _beat(run, worker, beat):
  atomic.write_json(layout.control(run, "heartbeat", f"{worker}.json"),
                    {"beat": beat})


def test_coordinator_leases_requeues_and_restarts(tmp_path):
  exp = _experiment(tmp_path, num_steps=4)
  run = tmp_path / "islands"
  spec = dataclasses.replace(_spec(exp, 2), lease_timeout_s=5.0)
  launcher.write_version_zero(run, exp.runtime, None, 0)
  spec.save(run)
  clock = _FakeClock()
  coord = coordinator_lib.Coordinator(run, spec, log=lambda _: None,
                                      clock=clock)
  _beat(run, "a", 1)
  _beat(run, "b", 1)
  # A heartbeat write in progress is not a worker.
  (layout.control(run, "heartbeat") / ".a.json.tmp-123").write_text("{}")
  assert not coord.tick()  # First sight: not live before a beat changes.
  assert not coord.leases
  clock.now = 1.0
  _beat(run, "a", 2)
  _beat(run, "b", 2)
  assert not coord.tick()
  assert sorted(coord.leases) == ["a", "b"]
  lease = lambda w: layout.read_json(layout.control(run, "assign",
                                                    f"{w}.json"))
  assert lease("a")["task"] == {"round": 0, "group": [0, 1]}
  assert lease("b")["task"] == {"round": 0, "group": [2, 3]}
  # "b" goes silent past the lease timeout: its task goes to "c".
  clock.now = 3.0
  _beat(run, "a", 3)
  _beat(run, "c", 1)
  coord.tick()
  clock.now = 9.0
  _beat(run, "a", 4)
  _beat(run, "c", 2)
  coord.tick()
  assert lease("b")["task"] is None
  assert lease("c")["task"] == {"round": 0, "group": [2, 3]}
  # A restarted coordinator keeps the leases it gave.
  again = coordinator_lib.Coordinator(run, spec, log=lambda _: None,
                                      clock=clock)
  assert again.leases["c"]["task"] == {"round": 0, "group": [2, 3]}
  # Round 1 of a group is not ready before round 0's outer steps.
  assert not again.task_ready(1, 0)


def _unit_bytes(run, kind, slot, expert, version, stage=None):
  key = f"{slot}/stage{stage}" if stage is not None else slot
  directory = getattr(layout, kind)(run, key, expert, version)
  assert atomic.is_committed(directory), directory
  return atomic.read_commit(directory)["bytes"]


# (The plain case, no delay and float32, is run with kills by
# test_islands_processes.test_pipelined_units_survive_kills.)
@pytest.mark.parametrize("delay,compression", [
    ("one_round", "int4"), ("overlap", "none")])
def test_pipelined_islands_store_stages_and_equal_the_spmd_runtime(
    tmp_path, delay, compression):
  # 2 pipeline stages: every layer slot's module, outer state and
  # contribution is 2 keys of half its bytes (DiLoCoX's dual optimizer
  # policy), the 4 paths of each task vmapped, 2 rounds. With a delay
  # (one_round; overlap at tau = 1 of H = 2) and int4 (blocks of 32
  # values: no block spans two stages), the stages' payloads are encoded
  # apart and their residuals carried on.
  settings = dict(delay=delay, compression=compression,
                  error_feedback=compression != "none",
                  compression_block_size=32,
                  overlap_steps=1 if delay == "overlap" else 0)
  exp = _experiment(tmp_path / "spmd", num_steps=4, stages=2, **settings)
  spmd = jax.device_get(exp.train().state["outer"]["params"])
  run = tmp_path / "islands"
  bank = _islands_in_process(exp, run, 4, forget=True)
  # The same tolerance as the unpipelined runs with every path in a task.
  assert _max_abs_diff(spmd, bank) < 1e-6, _max_abs_diff(spmd, bank)
  spec = _spec(exp, 4)
  topology = spec.topology()
  final = spec.num_rounds
  for slot in topology.slots:
    stages = (0, 1) if slot.layers else (None,)
    if slot.layers:  # Only the stage level under the slot's directory.
      assert sorted(p.name for p in (run / "modules" / slot.name).iterdir()
                    ) == ["stage0", "stage1"]
    module_bytes = 4 * sum(x.size // x.shape[0]
                           for x in jax.tree.leaves(spmd[slot.name]))
    for e in range(slot.num_experts):
      sizes = [_unit_bytes(run, "module_dir", slot.name, e, final, s)
               for s in stages]
      assert sizes == [module_bytes // len(stages)] * len(stages), (
          slot.name, sizes, module_bytes)
      states = [_unit_bytes(run, "outer_state_dir", slot.name, e, final, s)
                for s in stages]
      assert len(set(states)) == 1, states
    contribs = [atomic.read_commit(layout.contrib_dir(
        run, final - 1, 0, f"{slot.name}/stage{s}" if s is not None
        else slot.name))["bytes"] for s in stages]
    assert len(set(contribs)) == 1, contribs
    if compression == "none":
      assert contribs[0] == module_bytes // len(stages)
  # A restarted executor finds every unit at its last version; the
  # coordinator sees every task done and collects all but the final units.
  again = executor_lib.Executor(run, spec,
                                executor_lib.owned_modules(spec, 0, 1),
                                "executor", log=lambda _: None)
  assert len(again.modules) == sum(
      s.num_experts * (2 if s.layers else 1) for s in topology.slots)
  assert again.finished()
  coord = coordinator_lib.Coordinator(run, spec, log=lambda _: None)
  assert coord.frontier == [final] and coord.run_done()
  coord.collect_garbage()
  # Left: the final units and the version and contributions they were
  # made from (to rebuild a damaged one, islands/repair.py).
  left = sorted(str(p.relative_to(run)) for p in run.glob("modules/*/**/v*"))
  assert left and all(p.endswith((f"v{final:06d}", f"v{final - 1:06d}"))
                      for p in left), left
  assert [p.name for p in run.glob("contrib/r*")] == [f"r{final - 1:06d}"]


def test_islands_refuse_codecs_that_need_a_whole_pipelined_leaf():
  config = testing.tiny_config("2x2", inner_steps=2, num_steps=4)
  config.pipeline.stages = config.pipeline.microbatches = 2
  for whole_leaf in ("lowrank", "strided"):
    config.diloco.compression = whole_leaf
    with pytest.raises(UserError, match="compression/pipeline.stages: .* "
                       f"and {whole_leaf} needs the whole leaf"):
      launcher.check_config(config)
  config.diloco.compression = "int4"  # Norm scales: 32 values per stage.
  config.diloco.compression_block_size = 64
  with pytest.raises(UserError, match="compression_block_size/pipeline"):
    launcher.check_config(config)
  config.diloco.compression_block_size = 32
  launcher.check_config(config)
  config.pipeline.stages = 1
  config.diloco.compression = "lowrank"
  launcher.check_config(config)


def test_islands_refuse_what_eager_does_not_combine_with():
  # Eager workers read round r - 1's payloads of whole modules, not a
  # version (islands/eager.py); their view replays as any start state.
  config = testing.tiny_config("2x2", inner_steps=2, num_steps=4)
  config.diloco.delay = "eager"
  launcher.check_config(config)
  launcher.check_config(config, launcher.IslandOptions(inner_state_every=2))
  config.diloco.download_compression = "int4"
  with pytest.raises(UserError, match="download_compression: eager"):
    launcher.check_config(config)
  config.diloco.download_compression = "none"
  config.pipeline.stages = config.pipeline.microbatches = 2
  with pytest.raises(UserError, match="delay: eager on islands .* "
                     "config.pipeline.stages to 1"):
    launcher.check_config(config)
  config.diloco.delay = "naive"  # A lower bound, simulated only.
  config.pipeline.stages = config.pipeline.microbatches = 1
  with pytest.raises(UserError, match="none, one_round, overlap or eager"):
    launcher.check_config(config)


def test_a_stage_share_is_copied_from_the_shards_that_hold_it():
  from dipaco_jax.islands import units  # pylint: disable=g-import-not-at-top
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 2, 2),
                           ("path", "stage", "data"))
  x_GxNxD = np.arange(4 * 6 * 3, dtype=np.float32).reshape(4, 6, 3)
  # Replicated over `data`: each row is held twice and copied once.
  placed = jax.device_put(x_GxNxD, jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec("path", "stage")))
  for stage in range(2):
    np.testing.assert_array_equal(
        units.host_share(placed, stage, 2, axis=1),
        x_GxNxD[:, 3 * stage:3 * stage + 3])
  # Sharded on another axis than the stage's: rows from every shard.
  other = jax.device_put(x_GxNxD, jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec(None, None, None)))
  np.testing.assert_array_equal(units.host_share(other, 1, 3, axis=1),
                                x_GxNxD[:, 2:4])


def test_workers_keep_to_the_launchers_visible_gpus():
  # Two island runs on disjoint GPUs of one machine: worker i gets the
  # (i % n)-th of the launcher's CUDA_VISIBLE_DEVICES, else GPU i % n.
  assert [roles_lib.worker_gpu(i, 2, None) for i in range(4)] == [
      "0", "1", "0", "1"]
  assert [roles_lib.worker_gpu(i, 2, "2,3") for i in range(3)] == [
      "2", "3", "2"]
  with pytest.raises(UserError, match="lists 1 GPU"):
    roles_lib.worker_gpu(0, 2, "3")
