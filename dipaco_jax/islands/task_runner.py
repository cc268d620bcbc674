r"""One task of the worker role: a round of a group of paths, run on this
process's devices from the store (`islands/worker.py` takes the tasks).

A task (round r, workers g) loads the modules of g's paths at version r and
each worker's AdamW state at step rH, runs H inner steps of today's jitted,
vmapped SPMD program over g (batches are the same pure function of seed,
run, worker and step as in the SPMD runtime), then writes each worker's
AdamW state at step (r + 1)H and its contribution of round r (outer -
inner, Eq. 1 of `diloco.outer`; with `config.diloco.compression`, its
codec's payload, `islands/wire.py`), one key per unit (a slot, or one
pipeline stage's share of a layer slot, `islands/units.py`; the stages'
keys are written in parallel, `islands/unit_io.py`). A task whose keys are
all committed is not run again, and a re-run writes the same bytes. With
DiLoCoX's one-round delay a task is `islands/delayed.py`'s instead (own
anchors, uploads in the background, the next round trained ahead).

With `--inner_state_every=K` > 1 the AdamW states are committed only every
K rounds (not at the last round); a task whose start state the runner does
not keep (moved, or a restart) replays up to K - 1 rounds from the last
commit, writing nothing (`islands/replay.py`; a delayed task's anchor with
them, `delayed._replay`).
"""

import dataclasses
import time

import jax
import numpy as np

from dipaco_jax.data import batches as batches_lib
from dipaco_jax.data import prefetch
from dipaco_jax.data import shards as shards_lib
from dipaco_jax.islands import delayed
from dipaco_jax.islands import downloads as downloads_lib
from dipaco_jax.islands import eager as eager_lib
from dipaco_jax.islands import layout
from dipaco_jax.islands import program as program_lib
from dipaco_jax.islands import replay
from dipaco_jax.islands import unit_io
from dipaco_jax.islands import units as units_lib
from dipaco_jax.islands import wire as wire_lib
from dipaco_jax.store import items
from dipaco_jax.train import dispatch
from dipaco_jax.train import profiling


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
    # (group, step, anchor, AdamW, codec carry, eager's decoded payloads).
    self._kept = None
    self.kept = None
    self.replayed_rounds = 0  # Rounds re-run to rebuild a start state.
    self.speculated = None  # A delayed group's next round, trained ahead.
    self.prefetch = None  # delayed._Prefetch: its next module version.
    self.delayed = self.config.diloco.delay in ("one_round", "overlap",
                                                "eager")
    # `eager`'s own outer step on each worker's view (islands/eager.py).
    self.eager = (eager_lib.EagerViews(spec, self.config)
                  if self.config.diloco.delay == "eager" else None)
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
