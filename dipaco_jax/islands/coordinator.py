r"""The coordinator role: tasks, leases, re-queues, all through the store.

  python -m dipaco_jax.islands.coordinator --store=RUN_DIR

A run is a grid of tasks: round r x group g of workers (paths x replicas).
Task (r, g) is ready when every module g uses is committed at version r
(its outer step of round r - 1 is done); with DiLoCoX's one-round delay,
when every task of round r - 1 is done (the outer step then runs while
round r trains); it is done when its outputs (each
worker's contributions, and AdamW state: with `inner_state_every` = K only
every K rounds, `islands/replay.py`) are committed. Workers pull: a
live worker without a task gets the oldest ready one, so a faster worker
does more tasks and a worker started mid-run simply joins. A worker is live
while its heartbeat file changes; one silent for `lease_timeout_s` loses
its task, which goes to another worker (if it was only slow, its late
writes are the same bytes and the first commit wins).

Nothing lives only in the coordinator's memory: which tasks are done is
read from the store, the leases it gave are its own `control/assign` files,
and its counts are in `control/coordinator.json`. A killed coordinator is
restarted and carries on from those. When every module reaches the last
version it writes `DONE.json` and stop leases.
"""

import time

from absl import flags
import numpy as np

from dipaco_jax.islands import background
from dipaco_jax.islands import garbage
from dipaco_jax.islands import layout
from dipaco_jax.islands import repair
from dipaco_jax.islands import role_cli
from dipaco_jax.islands import timeline
from dipaco_jax.islands import units as units_lib
from dipaco_jax.store import atomic
from dipaco_jax.train import preemption


class Coordinator:
  """The scheduling state of one run, rebuilt from the store."""

  def __init__(self, run, spec: layout.RunSpec, log=print, clock=None,
               before_done=lambda: None, collect_in_background=False):
    """`before_done()` runs once the run is finished, before DONE.json is
    written (the launcher stops the roles once it exists).
    `collect_in_background`: `tick` deletes in a thread (`serve`'s), so a
    long deletion (K rounds at once after a commit round, with
    `inner_state_every` = K) delays no lease; else before it returns."""
    self.run, self.spec, self.log = run, spec, log
    self.before_done = before_done
    self.clock = clock or time.monotonic
    topology = spec.topology()
    self.assignment_WxS = topology.assignment_WxS
    self.slot_names = [s.name for s in topology.slots]
    # Each slot's unit keys (`islands/units.py`): its name, or one per
    # pipeline stage.
    stages = units_lib.num_stages(spec.config)
    self.unit_keys = [units_lib.keys_of_slot(s, stages)
                      for s in topology.slots]
    self.groups = spec.groups()
    self.num_rounds = spec.num_rounds
    delay = spec.config["diloco"].get("delay")
    self.delayed = delay in ("one_round", "overlap", "eager")
    saved = layout.read_json(layout.control(run, "coordinator.json")) or {}
    # The next round of each group that is not known to be done: from the
    # saved frontier on (the keys of earlier rounds may be collected).
    start = saved.get("frontier", [0] * len(self.groups))
    self.frontier = [self._first_undone(g, start[g])
                     for g in range(len(self.groups))]
    self.leases = {}  # worker id -> {"seq", "task"} (its assign file)
    self.seen = {}  # worker id -> (beat, when its beat last changed)
    self.dead = set()
    self.last_group = {}  # worker id -> the group of its last task
    self.tasks_done = dict(saved.get("tasks_done", {}))
    self.requeued = int(saved.get("requeued", 0))
    # Contributions are kept a round beyond their version's for eager's
    # replays: one from commit round c mixes round c - 1's (eager.py).
    self.garbage = garbage.Collector(
        run, spec, self.groups, self._units(slice(None)),
        int(delay == "eager" and spec.inner_state_every > 1),
        saved.get("collected"))
    self._collector = (background.OneAtATime(self.garbage.collect)
                       if collect_in_background else None)
    self._load_leases()

  # --- The store's view ---------------------------------------------------

  def task_done(self, round_index: int, group: int) -> bool:
    h = self.spec.inner_steps
    workers = self.groups[group]
    # With `inner_state_every` > 1, inner states only on commit rounds.
    inner = workers if self.spec.commits_inner(round_index) else ()
    return all(layout.committed(layout.inner_dir(
        self.run, w, (round_index + 1) * h)) for w in inner) and all(
            layout.committed(layout.contrib_dir(self.run, round_index, w, k))
            for w in workers for keys in self.unit_keys for k in keys)

  def task_ready(self, round_index: int, group: int) -> bool:
    if self.delayed and round_index > 0:
      # One round late, overlapped or eager (islands/delayed.py): a task
      # starts from its group's own anchors and waits for version r only
      # at its end (one_round) or after tau steps (overlap), while the
      # executors make it; eager reads round r - 1's contributions
      # instead. It starts once every task of round r - 1 is
      # done: their contributions make version r, so no task can wait on
      # a task that no free worker would run.
      return min(self.frontier) >= round_index
    return all(layout.committed(layout.module_dir(self.run, k, e, round_index))
               for k, e in self._units(list(self.groups[group])))

  def _units(self, workers) -> list[tuple[str, int]]:
    """(unit key, expert) of every unit `workers` use."""
    return [(k, int(e)) for s, keys in enumerate(self.unit_keys)
            for e in np.unique(self.assignment_WxS[workers, s])
            for k in keys]

  def _first_undone(self, group: int, r: int = 0) -> int:
    while r < self.num_rounds and self.task_done(r, group):
      r += 1
    return r

  def run_done(self) -> bool:
    return all(layout.committed(layout.module_dir(
        self.run, k, e, self.num_rounds))
               for k, e in self._units(slice(None)))

  def _load_leases(self) -> None:
    for path in layout.control_files(layout.control(self.run, "assign")):
      lease = layout.read_json(path)
      if lease is not None:
        self.leases[path.stem] = lease

  # --- Workers --------------------------------------------------------------

  def live_workers(self) -> list[str]:
    """Workers whose heartbeat changed within the lease timeout (measured
    on this process's clock, so machines' clocks need not agree)."""
    now = self.clock()
    live = []
    for path in layout.control_files(layout.control(self.run, "heartbeat")):
      beat = layout.read_json(path)
      if beat is None:
        continue
      worker = path.stem
      last = self.seen.get(worker)
      if beat.get("leaving"):  # Preempted: its task goes back at once.
        if worker not in self.dead:
          self._declare_dead(worker, None)
        self.seen[worker] = (beat["beat"], now)
        continue
      if last is None:
        # First sight (this coordinator may have just restarted): live
        # only once the beat is seen to change, so a dead worker's old
        # file gets no task. Its lease stands until then.
        self.seen[worker] = (beat["beat"], now)
        continue
      if last[0] != beat["beat"]:
        self.seen[worker] = (beat["beat"], now)
        if worker in self.dead:
          self.log(f"worker {worker} is back")
          self.dead.discard(worker)
      elif now - last[1] > self.spec.lease_timeout_s:
        if worker not in self.dead:
          self._declare_dead(worker, now - last[1])
        continue
      if worker not in self.dead:
        live.append(worker)
    return live

  def _declare_dead(self, worker: str, silent_s: float | None) -> None:
    """`silent_s` None: the worker said it left (preempted)."""
    self.dead.add(worker)
    lease = self.leases.get(worker)
    task = lease and lease.get("task")
    why = ("left (preempted)" if silent_s is None else
           f"silent for {silent_s:.0f} s")
    if task is not None:
      self.requeued += 1
      self.log(f"worker {worker} {why}: round {task['round']} workers "
               f"{task['group']} re-queued")
      self._write_lease(worker, None)
    else:
      self.log(f"worker {worker} {why}")

  def _write_lease(self, worker: str, task, stop: bool = False) -> None:
    seq = self.leases.get(worker, {}).get("seq", -1) + 1
    lease = {"seq": seq, "task": task, "stop": stop}
    atomic.write_json(layout.control(self.run, "assign", f"{worker}.json"),
                      lease, indent=None)
    self.leases[worker] = lease

  # --- Scheduling ---------------------------------------------------------

  def _advance_frontier(self) -> None:
    for g in range(len(self.groups)):
      while (self.frontier[g] < self.num_rounds
             and self.task_done(self.frontier[g], g)):
        self.frontier[g] += 1

  def _leased(self, live) -> dict:
    """{(round, group): worker} of the live workers' unfinished tasks."""
    out = {}
    for worker in live:
      task = self.leases.get(worker, {}).get("task")
      if task is not None:
        out[(task["round"], self.groups.index(tuple(task["group"])))] = worker
    return out

  def collect_garbage(self) -> None:
    """Deletes what no task, outer step or rebuild can read again, up to
    the frontier (`islands/garbage.py`)."""
    self.garbage.collect(self.frontier)

  def tick(self) -> bool:
    """One scheduling pass; True once the run is done."""
    live = self.live_workers()
    self._requeue_damaged(live)
    self._advance_frontier()
    # Free the workers whose task is done (counted once, to the holder);
    # the frontier says so even once its keys are collected.
    for worker in live:
      task = self.leases.get(worker, {}).get("task")
      if task is not None and task["round"] < self.frontier[
          self.groups.index(tuple(task["group"]))]:
        self.tasks_done[worker] = self.tasks_done.get(worker, 0) + 1
        self.last_group[worker] = self.groups.index(tuple(task["group"]))
        self._write_lease(worker, None)
    if all(r == self.num_rounds for r in self.frontier) and self.run_done():
      if self.spec.collect_garbage:
        self._save_state(live)
        if self._collector is not None:
          self._collector.join()
        self.collect_garbage()
      self._finish(live)
      return True
    leased = self._leased(live)
    pending = sorted((r, g) for g, r in enumerate(self.frontier)
                     if r < self.num_rounds and (r, g) not in leased
                     and self.task_ready(r, g))
    idle = [w for w in live if self.leases.get(w, {}).get("task") is None]
    for worker in idle:
      if not pending:
        break
      # Sticky: the group a worker trained last is its first choice (its
      # AdamW states are still on its devices), else the oldest task.
      same = [t for t in pending if t[1] == self.last_group.get(worker)]
      r, g = same[0] if same else pending[0]
      pending.remove((r, g))
      self._write_lease(worker, {"round": r, "group": list(self.groups[g])})
    self._save_state(live)
    if self.spec.collect_garbage:
      # After the leases (deleting a round's keys takes time no worker
      # should wait for) and after the state that says what is done is
      # saved (a restarted coordinator must not look for what was deleted).
      if self._collector is not None:
        self._collector.start(list(self.frontier))
      else:
        self.collect_garbage()
    return False

  def _requeue_damaged(self, live) -> None:
    """Re-queues the task that made each damaged contribution or AdamW
    state (`islands/repair.py`), once its own inputs are on the store;
    stops the run in one line when they are not."""
    for path, key in repair.requests(self.run):
      if key.kind not in ("contrib", "inner"):
        continue  # A module version: its executor's.
      if self._collector is not None:
        self._collector.join()  # What it deletes decides what is missing.
      r = (key.round_index if key.kind == "contrib"
           else key.step // self.spec.inner_steps - 1)
      g = next(i for i, ws in enumerate(self.groups) if key.worker in ws)
      missing = self._missing_inputs(r, g)
      if missing:
        repair.fail(self.run, key, f"task round {r} of workers "
                    f"{list(self.groups[g])} would remake it, but its input "
                    f"{missing} is gone too; restart the run in a fresh "
                    "--workdir", "coordinator", self.log)
        continue  # The request stays: the launcher stops the run.
      self.log(f"rebuilding {key.relative}: round {r} of workers "
               f"{list(self.groups[g])} re-queued")
      self.frontier[g] = min(self.frontier[g], r)
      # Leases of the group's later rounds go: their holders may have
      # dropped them on the damage, and the rounds come again in order.
      for worker, lease in list(self.leases.items()):
        task = lease.get("task")
        if task is not None and tuple(task["group"]) == self.groups[g]:
          self._write_lease(worker, None)
      self._save_state(live)
      repair.done(path)

  def _missing_inputs(self, r: int, g: int) -> str | None:
    """The first input of task (r, g) that is not committed: its modules
    at version r, the AdamW states it starts or replays from."""
    for k, e in self._units(list(self.groups[g])):
      if not layout.committed(layout.module_dir(self.run, k, e, r)):
        return str(layout.module_dir(self.run, k, e, r).relative_to(
            self.run))
    start = self.spec.last_commit_round(r) * self.spec.inner_steps
    for w in self.groups[g] if start else ():
      if not layout.committed(layout.inner_dir(self.run, w, start)):
        return str(layout.inner_dir(self.run, w, start).relative_to(
            self.run))
    return None

  def _save_state(self, live) -> None:
    atomic.write_json(layout.control(self.run, "coordinator.json"), {
        "tasks_done": self.tasks_done, "requeued": self.requeued,
        "live": live, "frontier": self.frontier,
        "collected": self.garbage.record, "time": time.time()},
                      indent=None)

  def _finish(self, live) -> None:
    self._save_state(live)
    self.before_done()
    atomic.write_json(layout.done_path(self.run), {
        "tasks_done": self.tasks_done, "requeued": self.requeued,
        "rounds": self.num_rounds})
    for worker in self.leases:
      self._write_lease(worker, None, stop=True)
    counts = ", ".join(f"{w} {n}" for w, n in sorted(self.tasks_done.items()))
    self.log(f"done: {self.num_rounds} rounds; tasks per worker: {counts}; "
             f"{self.requeued} re-queued")


def serve(run, poll_s: float = 0.05, timeout_s: float = 24 * 3600.0) -> None:
  spec = layout.RunSpec.load(run)
  spec.use_store()
  log = lambda msg: print(f"[coordinator] {msg}", flush=True)
  loop = timeline.LoopOps(run, "coordinator")
  coordinator = Coordinator(run, spec, log, before_done=loop.save,
                            collect_in_background=True)
  deadline = time.monotonic() + timeout_s
  poll_s = layout.poll_interval(run, poll_s)
  while True:
    loop.start()
    if layout.is_done(run):
      break
    finished = coordinator.tick()
    loop.end()
    if finished:
      break
    if time.monotonic() > deadline:
      raise TimeoutError(f"run not finished in {timeout_s:.0f} s")
    time.sleep(poll_s)
  preemption.finished()


def _define_flags(flag_values) -> None:
  flags.DEFINE_string("store", None, "the run's directory",
                      flag_values=flag_values)
  flags.mark_flag_as_required("store", flag_values=flag_values)


def main(argv=None) -> None:
  args = role_cli.parse("coordinator", __doc__, _define_flags, argv)
  with layout.role_errors("coordinator"):
    serve(args.store)


if __name__ == "__main__":
  main()
