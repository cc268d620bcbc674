r"""The worker role: runs tasks (one round of a group of paths) from the store.

  python -m dipaco_jax.islands.worker --store=RUN_DIR --worker_id=NAME \
      [--fake_devices=N] [--slowdown_s=0]

A task (round r, workers g) loads the modules of g's paths at version r and
each worker's AdamW state at step rH, runs H inner steps of today's jitted,
vmapped SPMD program over g on this process's devices (batches are the
same pure function of seed, run, worker and step as in the SPMD runtime),
then writes each worker's AdamW state at step (r + 1)H and its
contribution of round r (outer - inner, Eq. 1 of `diloco.outer`; with
`config.diloco.compression`, its codec's payload, `islands/wire.py`), one
key per unit (a slot, or one pipeline stage's share of a layer slot,
`islands/units.py`; the stages' keys are written in parallel,
`islands/unit_io.py`). A task whose keys are all committed
is not run again, and a re-run writes the same bytes, so a worker killed
anywhere costs at most its unfinished task. With DiLoCoX's one-round
delay a task is `islands/delayed.py`'s instead (own anchors, uploads in
the background, the next round trained ahead).

With `--inner_state_every=K` > 1 the AdamW states (the largest share of
the bytes a worker writes) are committed only every K rounds (with any
K, not at the last round); a task whose start state this worker does not
keep (moved, or a restart) replays up to K - 1 rounds from the last
commit, writing nothing (`islands/replay.py`; a delayed task's anchor
with them, `delayed._replay`), and the store keeps up to K module
versions.

The worker learns its task from `control/assign/{worker_id}.json` (written
by the coordinator alone) and reports liveness in
`control/heartbeat/{worker_id}.json` (written by it alone,
`islands/heartbeat.py`).
"""

import dataclasses
import os
import socket
import time

from etils import epath
import jax
import numpy as np

from dipaco_jax.data import batches as batches_lib
from dipaco_jax.data import prefetch
from dipaco_jax.data import shards as shards_lib
from dipaco_jax.islands import delayed
from dipaco_jax.islands import downloads as downloads_lib
from dipaco_jax.islands import heartbeat as heartbeat_lib
from dipaco_jax.islands import layout
from dipaco_jax.islands import program as program_lib
from dipaco_jax.islands import replay
from dipaco_jax.islands import timeline
from dipaco_jax.islands import unit_io
from dipaco_jax.islands import units as units_lib
from dipaco_jax.islands import wire as wire_lib
from dipaco_jax.parallel import mesh as mesh_lib
from dipaco_jax.store import atomic
from dipaco_jax.store import items
from dipaco_jax.store import link
from dipaco_jax.train import dispatch
from dipaco_jax.train import profiling

# A worker's default budget of host memory for its copies of compressed
# downloads: 1B float32 parameters' worth, more than a task's modules on
# the models here, less than a large bank (a guess at what a worker host
# spares; `--download_cache_mb`).
DOWNLOAD_CACHE_MB = 4096.0
# Exit status of a worker whose task cannot succeed on a re-run (diverged,
# bad data): the launcher stops the run instead of restarting the worker.
EXIT_PERMANENT = 3


class TaskFailed(RuntimeError):
  """A task that would fail again on any worker."""


@dataclasses.dataclass
class Task:
  round_index: int
  group: tuple[int, ...]


def _seconds(phases: dict) -> str:
  return ", ".join(f"{k} {v:.2f} s" for k, v in phases.items())


class TaskRunner:
  """Runs tasks of one run; keeps compiled programs and shards between
  tasks."""

  def __init__(self, run, spec: layout.RunSpec, meter: layout.ByteMeter,
               slowdown_s: float = 0.0, log=print, trace_dir=None,
               download_cache_bytes: int | None = None):
    self.run, self.spec, self.meter = run, spec, meter
    self.slowdown_s, self.log = slowdown_s, log
    self.config = spec.config_dict()
    # `train.profile_steps` of the run, traced by the worker that runs them
    # (the serving loop closes it); no trace without a folder.
    self.tracer = profiling.StepTracer(
        self.config.train.get("profile_steps", "") if trace_dir else "",
        trace_dir or "", self.config.train.get("profile_python", True))
    self.topology = spec.topology()
    self.slot_names = tuple(s.name for s in self.topology.slots)
    self.stages = units_lib.num_stages(self.config)
    self.num_units = {s.name: units_lib.slot_stages(s, self.stages)
                      for s in self.topology.slots}
    self._programs: dict[int, program_lib.GroupProgram] = {}
    # (group, step, AdamW states on device, codec carry) of the last task:
    # a worker given the same group's next round skips reading them back
    # (they are the bytes it just committed). `kept` is the delayed tasks'
    # (group, step, anchor, AdamW, codec carry).
    self._kept = None
    self.kept = None
    self.replayed_rounds = 0  # Rounds re-run to rebuild a start state.
    self.speculated = None  # A delayed group's next round, trained ahead.
    self.prefetch = None  # delayed._Prefetch: its next module version.
    self.delayed = self.config.diloco.delay in ("one_round", "overlap")
    self.wire = wire_lib.Wire(self.config, self.topology.slots)
    # The workers' copies of the modules last read (compressed downloads),
    # within `download_cache_bytes` of host memory (None: no limit).
    self.downloads = downloads_lib.Downloads(
        self.config, self.topology.slots, download_cache_bytes)
    self._batches: dict[tuple[int, ...], batches_lib.StackedBatches] = {}

  def program(self, size: int) -> program_lib.GroupProgram:
    if size not in self._programs:
      self._programs[size] = program_lib.GroupProgram(self.spec, size)
    return self._programs[size]

  def batches(self, group) -> batches_lib.StackedBatches:
    if group not in self._batches:
      rows = [batches_lib.pack_rows(
          shards_lib.load_shard(self.spec.shard_dir, w),
          self.config.data.seq_len) for w in group]
      self._batches[group] = batches_lib.StackedBatches(
          rows, self.spec.data_seed, self.config.train.batch_size,
          stream_ids=group)
    return self._batches[group]

  def outputs(self, task: Task) -> list:
    """The keys a finished task has committed."""
    h = self.spec.inner_steps
    keys = [layout.inner_dir(self.run, w, (task.round_index + 1) * h)
            for w in task.group
            if self.spec.commits_inner(task.round_index)]
    keys += [k for w in task.group
             for k in unit_io.contribution_keys(self, task.round_index, w)]
    return keys

  def is_done(self, task: Task) -> bool:
    return all(layout.committed(k) for k in self.outputs(task))

  def load_bank(self, task: Task, program: program_lib.GroupProgram):
    """The group's modules at version r as a bank of G rows per slot (the
    experts it uses, then padding), and the local assignment [G, S]."""
    g = len(task.group)
    assignment_GxS = self.topology.assignment_WxS[list(task.group)]
    local_GxS = np.zeros_like(assignment_GxS)
    bank = {}
    for s, name in enumerate(self.slot_names):
      experts = np.unique(assignment_GxS[:, s])
      local_GxS[:, s] = np.searchsorted(experts, assignment_GxS[:, s])
      rows = []
      for e in experts:
        rows.append(unit_io.read_module(
            self, name, self.num_units[name], int(e), task.round_index,
            program.module_like[name], task.round_index))
      rows += [rows[0]] * (g - len(rows))  # Padding rows nobody uses.
      bank[name] = jax.tree.map(lambda *x: np.stack(x), *rows)
    return bank, local_GxS.astype(np.int32)

  def inner_like(self, program: program_lib.GroupProgram):
    """One worker's inner state on the store: its AdamW state, and with a
    codec that carries something between rounds, that too."""
    carry = self.wire.carry_like(program.module_like)
    return ({"opt": program.worker_opt_like, "wire": carry} if carry
            else program.worker_opt_like)

  def _load_inner(self, task: Task, program: program_lib.GroupProgram,
                  inner_params):
    """(AdamW state, codec carry) of the group at the round's start: kept,
    read, or with `inner_state_every` > 1 replayed (`islands/replay.py`)."""
    if replay.needs_replay(self, task, self._kept):
      return replay.replay(self, task, program)
    return self.load_inner_at(task, program, inner_params)

  def load_inner_at(self, task: Task, program: program_lib.GroupProgram,
                    inner_params):
    """(AdamW state, codec carry) of the group at the round's start, kept
    or committed (the fresh init at round 0)."""
    if task.round_index == 0:
      return (program.init_inner_opt(inner_params),
              self.wire.init_carry(inner_params))
    step = task.round_index * self.spec.inner_steps
    if self._kept is not None and self._kept[:2] == (task.group, step):
      return self._kept[2], self._kept[3]
    rows = []
    for w in task.group:
      key = layout.inner_dir(self.run, w, step)
      tree, _ = items.load_tree(key, self.inner_like(program))
      self.meter.add("read", task.round_index, key)
      rows.append(tree)
    stacked = jax.tree.map(lambda *x: np.stack(x), *rows)
    if isinstance(stacked, dict) and "wire" in stacked:
      return stacked["opt"], stacked["wire"]
    return stacked, {}

  def run_task(self, task: Task) -> dict:
    """Runs `task` unless already done; returns {worker: mean loss}."""
    self.phases = None
    if self.is_done(task):
      self.log(f"round {task.round_index} workers {list(task.group)}: "
               "already committed")
      return {}
    t0 = time.monotonic()
    program = self.program(len(task.group))
    if self.delayed:
      losses, self.phases = delayed.run_task(self, task, program, t0)
      self.log(f"round {task.round_index} workers {list(task.group)}: loss "
               f"{np.mean(list(losses.values())):.4f}, "
               f"{time.monotonic() - t0:.1f} s ({_seconds(self.phases)})")
      return losses
    bank, local_GxS = self.load_bank(task, program)
    inner_params = program.gather_workers(bank, local_GxS)
    opt_state, carry = self._load_inner(task, program, inner_params)
    t_read = time.monotonic()
    # Payloads stay on device: each unit's writer copies its own.
    state, losses_HxG, payloads, carry = replay.train_round(
        self, task, program, bank, local_GxS, inner_params, opt_state, carry)
    t_train = time.monotonic()
    carry = jax.device_get(carry)
    self._kept = None
    # Copied to the host only when committed (`RunSpec.commits_inner`).
    opt_state = (jax.device_get(state["inner"]["opt_state"])
                 if self.spec.commits_inner(task.round_index) else None)
    loss_G = losses_HxG.mean(axis=0)
    self._write(task, payloads, opt_state, carry, loss_G)
    self._kept = (task.group, (task.round_index + 1) * self.spec.inner_steps,
                  state["inner"]["opt_state"], carry)
    # Consecutive clock readings: the phases add up to the task's time
    # (`timeline.SYNC_PHASES`; the first task's `read` holds the building
    # of the worker's program).
    self.phases = {"read": t_read - t0, "train": t_train - t_read,
                   "write": time.monotonic() - t_train}
    self.log(f"round {task.round_index} workers {list(task.group)}: loss "
             f"{loss_G.mean():.4f}, {time.monotonic() - t0:.1f} s "
             f"({_seconds(self.phases)})")
    return {w: float(l) for w, l in zip(task.group, loss_G)}

  def inner_steps(self, task: Task, runtime, state,
                  after_first_dispatch=None, first=None, steps=None):
    """The round's H inner steps (or `steps` from step `first`: a part of
    it, `delay=overlap`), `train.steps_per_dispatch` per call, the batches
    built and placed by a prefetch thread (as the SPMD loop);
    `after_first_dispatch()` is called once the first call is queued."""
    h, c = self.spec.inner_steps, runtime.config
    batches = self.batches(task.group)
    first = task.round_index * h if first is None else first
    steps = h if steps is None else steps
    dispatches = dispatch.plan(first, first + steps,
                               c.train.steps_per_dispatch, lambda done: False)

    def device_batch(i):
      step, n = dispatches[i]
      return step, n, runtime.worker_rows(dispatch.host_rows(batches.batch,
                                                             step, n))

    losses = []
    with prefetch.Prefetcher(device_batch, 0, len(dispatches),
                             c.data.prefetch) as batch_iter:
      for _, (step, n, batch) in batch_iter:
        self.tracer.before(step, n)
        step_fn = runtime.inner_step if n == 1 else runtime.inner_k_steps
        state, metrics = step_fn(state, batch)
        self.tracer.after(step, n, state)
        losses.append(metrics["loss"])  # [G], or [n, G]
        if after_first_dispatch is not None:
          after_first_dispatch()
          after_first_dispatch = None
        if self.slowdown_s:
          time.sleep(self.slowdown_s * n)
    # Read once the round is queued: no host sync between its steps.
    losses_HxG = np.concatenate([np.zeros((0, len(task.group)))] + [
        np.asarray(x).reshape(-1, x.shape[-1])
        for x in jax.device_get(losses)])
    if not np.isfinite(losses_HxG).all():
      raise TaskFailed(
          f"non-finite loss in round {task.round_index} of workers "
          f"{list(task.group)}; lower config.inner_opt.learning_rate")
    return state, losses_HxG

  def _write(self, task: Task, payloads, opt_state, carry, loss_G) -> None:
    r, h = task.round_index, self.spec.inner_steps
    # Contributions first: the executors start while the AdamW states are
    # written. A worker killed in between leaves its task undone (the
    # coordinator re-runs it from round r, whose modules are kept until
    # then); the re-run's contributions are the committed bytes.
    self.write_contributions(task, payloads, loss_G)
    inner = {"opt": opt_state, "wire": carry} if carry else opt_state
    for i, w in enumerate(task.group if opt_state is not None else ()):
      key = layout.inner_dir(self.run, w, (r + 1) * h)
      items.save_tree(key, items.worker_of(inner, i),
                      {"round": r, "worker": w})
      self.meter.add("written", r, key)
    self.meter.flush()

  def write_contributions(self, task: Task, payloads, loss_G) -> None:
    """Each worker's contribution of the round, one key per unit
    (`unit_io.write_contributions`)."""
    unit_io.write_contributions(self, task, payloads, loss_G)


def serve(run, worker_id: str, slowdown_s: float = 0.0,
          poll_s: float = 0.02, max_idle_s: float = 3600.0,
          download_cache_mb: float = DOWNLOAD_CACHE_MB) -> int:
  """Takes tasks until the run is done; returns the number run. Waits up
  to `max_idle_s` for the run to start and between tasks.
  `download_cache_mb`: host memory for the copies of compressed downloads
  (0: no limit)."""
  spec = layout.RunSpec.load(run, timeout_s=max_idle_s)
  spec.use_store()
  log = lambda msg: print(f"[worker {worker_id}] {msg}", flush=True)
  meter = layout.ByteMeter(run, f"worker-{worker_id}")
  runner = TaskRunner(run, spec, meter, slowdown_s, log, trace_dir=(
      epath.Path(run) / "logs" / "profile" / f"worker_{worker_id}"),
                      download_cache_bytes=(
                          int(download_cache_mb * 2**20)
                          if download_cache_mb > 0 else None))
  stats = timeline.TaskStats(run, worker_id)
  assign_path = layout.control(run, "assign", f"{worker_id}.json")
  done_seq, ran, idle_since = -1, 0, time.monotonic()
  loop = timeline.LoopOps(run, f"worker_{worker_id}")
  with heartbeat_lib.Heartbeat(run, worker_id, spec.heartbeat_s) as (
      heartbeat), runner.tracer:
    while True:
      loop.start()
      if layout.is_done(run):
        break
      lease = layout.read_json(assign_path)
      if lease and lease.get("stop"):
        break
      if not lease or lease["seq"] == done_seq or lease["task"] is None:
        loop.end()
        if time.monotonic() - idle_since > max_idle_s:
          raise TimeoutError(f"no task for {max_idle_s:.0f} s")
        time.sleep(poll_s)
        continue
      task = Task(lease["task"]["round"], tuple(lease["task"]["group"]))
      heartbeat.update(task=lease["task"])
      started = time.time()
      ops_before = link.thread_counts().copy()
      try:
        losses = runner.run_task(task)
      except items.NotCommittedError as e:
        # Its inputs were collected: the task was done by another worker
        # and the run has moved on (a stale lease, read after a restart).
        log(f"round {task.round_index} workers {list(task.group)}: inputs "
            f"gone ({e}); skipping")
        losses = {}
      task_ops = link.since(ops_before)
      if losses:
        stats.add(task, started, time.time() - started, losses,
                  runner.phases, task_ops)
      ran += 1
      done_seq = lease["seq"]
      heartbeat.update(task=None, done_seq=done_seq)
      idle_since = time.monotonic()
      loop.end(work=task_ops)
    loop.end()
  loop.save()
  log(f"done: {ran} tasks")
  return ran


def main(argv=None) -> None:
  import argparse  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--store", required=True, help="the run's directory")
  parser.add_argument("--worker_id",
                      default=f"{socket.gethostname()}-{os.getpid()}")
  parser.add_argument("--fake_devices", type=int, default=0)
  parser.add_argument("--slowdown_s", type=float, default=0.0,
                      help="sleep after each inner step (tests, demos)")
  parser.add_argument("--max_idle_s", type=float, default=3600.0,
                      help="give up after waiting this long for the run to "
                      "start or for a task")
  parser.add_argument("--download_cache_mb", type=float,
                      default=DOWNLOAD_CACHE_MB,
                      help="host memory for the modules' copies with "
                      "compressed downloads (the least recently used "
                      "goes first, to be read whole when needed again); "
                      "0 = no limit")
  args = parser.parse_args(argv)
  mesh_lib.setup_fake_devices(args.fake_devices)
  try:
    serve(args.store, args.worker_id, args.slowdown_s,
          max_idle_s=args.max_idle_s,
          download_cache_mb=args.download_cache_mb)
  except TaskFailed as e:
    atomic.write_json(layout.control(args.store, "failed",
                                      f"{args.worker_id}.json"),
                      {"worker": args.worker_id, "error": str(e)})
    print(f"[worker {args.worker_id}] error: {e}", file=sys.stderr)
    sys.exit(EXIT_PERMANENT)


if __name__ == "__main__":
  main()
