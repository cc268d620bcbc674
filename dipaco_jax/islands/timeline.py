"""Where an island run's time went: per task, compute, upload, wait.

Each worker records its tasks (`TaskStats`: start, seconds, losses, peak
device memory) in `control/stats/{worker}.json`; the launcher reads them
back for `stats.json` and this module's plot.

Delayed tasks (islands/delayed.py) record four phases each, adding up to
the task's time: `compute` (the worker's program built, for its first
task, the start state loaded and H inner steps; 0 when the round was
trained ahead), `wait` (for
the module version the round restarts from, and reading it), `next_round`
(the next round trained ahead while this one's uploads run) and
`upload_tail` (uploads still running after that); and, for the record,
the part of `wait` spent on the version (`wait_version`: joining its
prefetch, or reading it); with `overlap`, whose version is read after tau
steps of the round, the part of `compute` spent waiting for it
(`wait_in_compute`, drawn as a wait where the compute bar starts: the
round's last H - tau steps follow it). Tasks without a delay record
`SYNC_PHASES`: `read` (the start state; the first task also builds the
worker's program), `train` (H inner steps) and `write` (the commits).
`plot` draws them per worker on one time axis: with the outer step one
round late and the uploads in the background, a round is about its
compute.
"""

import collections
import time

import jax
import numpy as np

from dipaco_jax import figures
from dipaco_jax.islands import delayed
from dipaco_jax.islands import layout
from dipaco_jax.store import atomic
from dipaco_jax.store import link

PHASES = delayed.PHASES
# A task without a delay: its start state read (and, for the first task,
# the worker's program built), its H inner steps, its contributions (and
# AdamW state, every K rounds) copied and committed.
SYNC_PHASES = ("read", "train", "write")
_COLORS = {"compute": "tab:blue", "wait": "tab:red",
           "next_round": "tab:cyan", "upload_tail": "tab:orange",
           "read": "tab:purple", "train": "tab:blue", "write": "tab:orange",
           "task": "tab:gray"}


def phases_of(phases: dict) -> tuple[str, ...]:
  """The drawn phases of a task's row: a delayed task's or a plain one's."""
  return PHASES if "compute" in phases else SYNC_PHASES


class TaskStats:
  """The worker's task timings and peak device memory, in its own control
  file (`control/stats/{worker_id}.json`), continued after a restart."""

  def __init__(self, run, worker_id: str):
    self.path = layout.control(run, "stats", f"{worker_id}.json")
    self.info = layout.read_json(self.path) or {"tasks": []}

  def add(self, task, started: float, seconds: float,
          losses: dict, phases: dict | None = None,
          store_ops: dict | None = None) -> None:
    """`phases`: seconds per phase (`phases_of`); `store_ops`: the store
    operations the task's own thread made, by kind (store/link.py)."""
    row = {"round": task.round_index, "group": list(task.group),
           "start": started, "seconds": seconds,
           "losses": [losses[w] for w in task.group]}
    if phases:
      row["phases"] = phases
    if store_ops is not None:
      row["store_ops"] = store_ops
    self.info["tasks"].append(row)
    peak = peak_device_bytes()
    if peak is not None:
      self.info["peak_device_bytes"] = max(
          peak, self.info.get("peak_device_bytes", 0))
    atomic.write_json(self.path, self.info, indent=None)


class LoopOps:
  """The store operations of a role's polling loop (store/link.py), per
  iteration, kept in `control/ops/{role}.json`: what one look at the store
  costs a role, the part of a hand-off between roles that a slow store
  charges its latency for. `work` excludes the operations of the work an
  iteration found (a task, an outer step), which their own stats count.

  Saved after the first iteration, every `save_every_s` and when the loop
  ends: the launcher stops the roles still running once the run is done,
  which can be before a role's loop has seen it (a loaded machine), and a
  killed role keeps what it had counted."""

  def __init__(self, run, role: str, save_every_s: float = 10.0):
    self.path = layout.control(run, "ops", f"{role}.json")
    self.iterations, self.ops = 0, collections.Counter()
    self.save_every_s = save_every_s
    self._before, self._saved_at = None, None

  def start(self) -> None:
    self._before = link.thread_counts().copy()

  def end(self, work: dict | None = None) -> None:
    """Closes an iteration; `work`: the operations of the work it did."""
    self.iterations += 1
    self.ops.update(link.since(self._before))
    self.ops.subtract(work or {})
    # Outside the iteration's window (start .. end): not counted in it.
    if (self._saved_at is None
        or time.monotonic() - self._saved_at >= self.save_every_s):
      self.save()

  def save(self) -> None:
    atomic.write_json(self.path, {"iterations": self.iterations,
                                  "ops": dict(+self.ops)}, indent=None)
    self._saved_at = time.monotonic()


def loop_ops(run) -> dict[str, float]:
  """{role kind (coordinator, executor, worker): store operations per
  iteration of its polling loop}, over the roles that saved theirs."""
  sums = collections.defaultdict(lambda: [0, 0])
  for path in layout.control_files(layout.control(run, "ops")):
    info = layout.read_json(path) or {}
    kind = path.stem.split("-")[0].split("_")[0]
    sums[kind][0] += sum(info.get("ops", {}).values())
    sums[kind][1] += info.get("iterations", 0)
  return {k: ops / n for k, (ops, n) in sorted(sums.items()) if n}


def peak_device_bytes() -> int | None:
  """The largest peak memory of this process's devices (None where the
  backend does not say, e.g. CPU)."""
  peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use")
           for d in jax.local_devices()]
  peaks = [p for p in peaks if p is not None]
  return max(peaks) if peaks else None


def worker_tasks(run) -> dict[str, list[dict]]:
  """{worker: its task rows} from the workers' stats files."""
  out = {}
  for path in layout.control_files(layout.control(run, "stats")):
    if not path.stem.startswith("executor"):
      out[path.stem] = (layout.read_json(path) or {}).get("tasks", [])
  return out


def mean_phases(run) -> dict | None:
  """Mean seconds per phase over the tasks of rounds 1.. (round 0's hold
  the compilation; None if no task records phases)."""
  rows = [t["phases"] for tasks in worker_tasks(run).values()
          for t in tasks if "phases" in t and t["round"] > 0]
  if not rows:
    return None
  # The drawn phases first, then any parts of them every row records.
  drawn = phases_of(rows[0])
  keys = list(drawn) + [k for k in rows[0] if k not in drawn
                        and all(k in r for r in rows)]
  return {k: float(np.mean([r[k] for r in rows])) for k in keys}


def plot_parts(phases: dict) -> list[tuple[str, float]]:
  """A task's bar segments in time order: its phases (`phases_of`), with
  the wait inside `compute` (`overlap`) split out in front of it."""
  inside = phases.get("wait_in_compute", 0.0)
  parts = []
  for kind in phases_of(phases):
    seconds = phases[kind]
    if kind == "compute" and inside:
      parts.append(("wait", inside))
      seconds -= inside
    parts.append((kind, seconds))
  return parts


def plot(run, path) -> None:
  """One row per worker, one bar per task (split into its phases)."""
  plt = figures.pyplot()
  tasks = worker_tasks(run)
  starts = [t["start"] for rows in tasks.values() for t in rows]
  if not starts:
    return
  t0 = min(starts)
  fig, ax = plt.subplots(figsize=(10, 1 + 0.5 * len(tasks)))
  seen = set()
  for y, (worker, rows) in enumerate(sorted(tasks.items())):
    for t in rows:
      left = t["start"] - t0
      parts = (plot_parts(t["phases"]) if "phases" in t
               else [("task", t["seconds"])])
      for kind, seconds in parts:
        ax.barh(y, seconds, left=left, color=_COLORS[kind],
                label=None if kind in seen else kind)
        seen.add(kind)
        left += seconds
      ax.text(t["start"] - t0, y + 0.3, f"r{t['round']}", fontsize=6)
  ax.set_yticks(range(len(tasks)), sorted(tasks))
  ax.set_xlabel("seconds since the first task")
  ax.set_title("island tasks: read, compute, upload, wait for the outer step")
  ax.legend(loc="upper right", fontsize=7)
  fig.tight_layout()
  figures.save(fig, path)
