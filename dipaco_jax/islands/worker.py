r"""The worker role: takes tasks (one round of a group of paths) from the
store and runs them (`islands/task_runner.py`).

  python -m dipaco_jax.islands.worker --store=RUN_DIR --worker_id=NAME \
      [--fake_devices=N] [--slowdown_s=0]

The worker learns its task from `control/assign/{worker_id}.json` (written
by the coordinator alone) and reports liveness in
`control/heartbeat/{worker_id}.json` (written by it alone,
`islands/heartbeat.py`). A task whose keys are all committed is not run
again, and a re-run writes the same bytes, so a worker killed anywhere
costs at most its unfinished task. It records each task's time, phases and
store operations (`timeline.TaskStats`) and its polling loop's store
operations (`timeline.LoopOps`).
"""

import os
import socket
import time

from absl import flags
from etils import epath

from dipaco_jax import config_fields
from dipaco_jax.islands import heartbeat as heartbeat_lib
from dipaco_jax.islands import layout
from dipaco_jax.islands import repair
from dipaco_jax.islands import role_cli
from dipaco_jax.islands import task_runner as runner_lib
from dipaco_jax.islands import timeline
from dipaco_jax.parallel import mesh as mesh_lib
from dipaco_jax.store import atomic
from dipaco_jax.store import integrity
from dipaco_jax.store import items
from dipaco_jax.store import link
from dipaco_jax.train import memory_estimate
from dipaco_jax.train import preemption

# A worker's default budget of host memory for its copies of compressed
# downloads: 1B float32 parameters' worth, more than a task's modules on
# the models here, less than a large bank (a guess at what a worker host
# spares; `--download_cache_mb`).
DOWNLOAD_CACHE_MB = 4096.0
# Exit status of a worker whose task cannot succeed on a re-run (diverged,
# bad data): the launcher stops the run instead of restarting the worker.
EXIT_PERMANENT = 3


def serve(run, worker_id: str, slowdown_s: float = 0.0,
          poll_s: float = 0.02, max_idle_s: float = 3600.0,
          download_cache_mb: float = DOWNLOAD_CACHE_MB) -> int:
  """Takes tasks until the run is done; returns the number run. Waits up
  to `max_idle_s` for the run to start and between tasks.
  `download_cache_mb`: host memory for the copies of compressed downloads
  (0: no limit)."""
  spec = layout.RunSpec.load(run, timeout_s=max_idle_s)
  spec.use_store()
  _check_memory(spec)
  poll_s = layout.poll_interval(run, poll_s)
  log = lambda msg: print(f"[worker {worker_id}] {msg}", flush=True)
  meter = layout.ByteMeter(run, f"worker-{worker_id}")
  runner = runner_lib.TaskRunner(run, spec, meter, slowdown_s, log, trace_dir=(
      epath.Path(run) / "logs" / "profile" / f"worker_{worker_id}"),
                      download_cache_bytes=(
                          int(download_cache_mb * 2**20)
                          if download_cache_mb > 0 else None))
  stats = timeline.TaskStats(run, worker_id)
  assign_path = layout.control(run, "assign", f"{worker_id}.json")
  done_seq, ran, idle_since = -1, 0, time.monotonic()
  # (lease seq, key) of a damaged input this worker reported: the task is
  # run again once the key is rebuilt (a module version, by its executor),
  # or the coordinator leases anew (the task that made it re-queued).
  awaiting = None
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
      if awaiting and lease and lease["seq"] == awaiting[0] and not (
          layout.committed(awaiting[1])):
        lease = None  # Waiting for the rebuild.
      if not lease or lease["seq"] == done_seq or lease["task"] is None:
        loop.end()
        if time.monotonic() - idle_since > max_idle_s:
          raise TimeoutError(f"no task for {max_idle_s:.0f} s")
        time.sleep(poll_s)
        continue
      task = runner_lib.Task(lease["task"]["round"], tuple(lease["task"]["group"]))
      heartbeat.update(task=lease["task"])
      started = time.time()
      ops_before = link.thread_counts().copy()
      try:
        losses = runner.run_task(task)
      except items.NotCommittedError as e:
        if e.key is not None and repair.is_requested(run, e.key):
          awaiting = (lease["seq"], e.key)  # Set aside by another reader.
          loop.end()
          continue
        # Its inputs were collected: the task was done by another worker
        # and the run has moved on (a stale lease, read after a restart).
        log(f"round {task.round_index} workers {list(task.group)}: inputs "
            f"gone ({e}); skipping")
        losses = {}
      except integrity.DamagedKeyError as e:
        # An input is damaged: set aside and rebuilt by what made it
        # (islands/repair.py); the coordinator gives this task again
        # once it is.
        repair.report(run, e, f"worker-{worker_id}", log)
        awaiting = (lease["seq"], e.key)
        loop.end()
        continue
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
  preemption.finished()
  log(f"done: {ran} tasks")
  return ran


def _check_memory(spec) -> None:
  """Refuses, before any lease, a worker whose devices surely cannot hold
  a task's step (`train/memory_estimate.py`: a group of
  `spec.paths_per_task` paths); it would fail on every retry."""
  group = min(len(spec.weights_W), spec.paths_per_task)
  try:
    memory_estimate.check([("island task", spec.config_dict(), group)])
  except config_fields.ConfigError as e:
    raise runner_lib.TaskFailed(
        f"{e} A task trains {group} paths here: give the launcher fewer "
        "--paths_per_task, or this worker more devices.") from e


def _define_flags(flag_values) -> None:
  define = dict(flag_values=flag_values)
  flags.DEFINE_string("store", None, "the run's directory", **define)
  flags.mark_flag_as_required("store", flag_values=flag_values)
  flags.DEFINE_string("worker_id", f"{socket.gethostname()}-{os.getpid()}",
                      "this worker's name in the run's control files",
                      **define)
  flags.DEFINE_integer("fake_devices", 0,
                       "CPU devices to fake (tests, demos); 0: none",
                       **define)
  flags.DEFINE_float("slowdown_s", 0.0,
                     "sleep after each inner step (tests, demos)", **define)
  flags.DEFINE_float("max_idle_s", 3600.0,
                     "give up after waiting this long for the run to start "
                     "or for a task", **define)
  flags.DEFINE_float("download_cache_mb", DOWNLOAD_CACHE_MB,
                     "host memory for the modules' copies with compressed "
                     "downloads (the least recently used goes first, to be "
                     "read whole when needed again); 0 = no limit", **define)


def main(argv=None) -> None:
  import sys  # pylint: disable=g-import-not-at-top
  args = role_cli.parse("worker", __doc__, _define_flags, argv)
  mesh_lib.setup_fake_devices(args.fake_devices)
  try:
    with layout.role_errors(f"worker {args.worker_id}"):
      serve(args.store, args.worker_id, args.slowdown_s,
            max_idle_s=args.max_idle_s,
            download_cache_mb=args.download_cache_mb)
  except runner_lib.TaskFailed as e:
    atomic.write_json(layout.control(args.store, "failed",
                                      f"{args.worker_id}.json"),
                      {"worker": args.worker_id, "error": str(e)})
    print(f"[worker {args.worker_id}] error: {e}", file=sys.stderr)
    sys.exit(EXIT_PERMANENT)


if __name__ == "__main__":
  main()
