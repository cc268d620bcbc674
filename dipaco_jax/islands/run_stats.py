"""What an island run did, from its store: bytes per role and round, and
the tasks' and outer steps' times, phases and store operations (the
workers' and executors' stats files), as the launcher prints and
`stats.json` keeps them.
"""

from dipaco_jax.islands import layout


def store_bytes(run) -> dict:
  """Bytes the roles wrote to and read from the store: per role and per
  round (summed over roles), and in all (written + read: every byte
  crosses the network once up and once per reader)."""
  counts = layout.read_byte_counts(run)
  kinds = ("written", "read")
  per_role = {role: {k: int(sum(c.get(k, {}).values())) for k in kinds}
              for role, c in counts.items()}
  per_round = {}
  for c in counts.values():
    for k in kinds:
      for r, n in c.get(k, {}).items():
        per_round.setdefault(r, dict.fromkeys(kinds, 0))[k] += int(n)
  total = sum(v for role in per_role.values() for v in role.values())
  return {"per_role": per_role,
          "per_round": dict(sorted(per_round.items(), key=lambda x: int(x[0]))),
          "total": total}


def task_stats(run, spec: layout.RunSpec) -> dict:
  """Per round: its wall time (first task start to last task end) against
  the sum of its tasks' times; per worker: tasks run and peak device
  memory. From the workers' stats files (a task re-run after a kill counts
  its last run)."""
  files = {p.stem: layout.read_json(p) or {}
           for p in layout.control_files(layout.control(run, "stats"))}
  workers = {k: v for k, v in files.items() if not k.startswith("executor")}
  executors = {k: v for k, v in files.items() if k.startswith("executor")}
  last = {}
  for worker, info in workers.items():
    for t in info.get("tasks", []):
      last[(t["round"], tuple(t["group"]))] = {**t, "worker": worker}
  rounds = []
  for r in range(spec.num_rounds):
    tasks = [t for (tr, _), t in last.items() if tr == r]
    if tasks:
      start = min(t["start"] for t in tasks)
      end = max(t["start"] + t["seconds"] for t in tasks)
      rounds.append({"round": r, "wall_s": end - start,
                     "sum_of_tasks_s": sum(t["seconds"] for t in tasks)})
  tokens_per_task_path = (spec.inner_steps
                          * spec.config["train"]["batch_size"]
                          * spec.config["data"]["seq_len"])
  steady = None
  if last:
    start = min(t["start"] for t in last.values())
    end = max(t["start"] + t["seconds"] for t in last.values())
    steady = (tokens_per_task_path * sum(len(g) for _, g in last)
              / max(end - start, 1e-9))
  return {"rounds": rounds, "tasks": sorted(
      last.values(), key=lambda t: (t["round"], t["group"])),
          # Tokens of all tasks over first task start to last task end:
          # throughput without the processes' start.
          "tokens_per_s_tasks": steady,
          "tokens_per_s_after_round0": _after_round0(
              last.values(), tokens_per_task_path),
          "outer_step_seconds": sum(e.get("seconds", 0.0)
                                    for e in executors.values()),
          "mean_outer_step_phases_s": _mean_outer_step_phases(executors),
          # Store operations (store/link.py): a task's own, and an outer
          # step's, mean over rounds 1.. / over every step.
          "mean_task_store_ops": _mean_task_store_ops(last.values()),
          "mean_outer_step_store_ops": _mean_outer_step_store_ops(
              executors),
          # The busiest executor's outer steps a round (one after another).
          "outer_steps_per_executor_round": max(
              [e.get("outer_steps", 0) / spec.num_rounds
               for e in executors.values()], default=0.0),
          "workers": {
      w: {"tasks": len(info.get("tasks", [])),
          "peak_device_bytes": info.get("peak_device_bytes")}
      for w, info in sorted(workers.items())}}


def _mean_outer_step_phases(executors) -> dict | None:
  """Mean seconds per outer step of each of its phases
  (`executor.EXECUTOR_PHASES`), over every executor's steps."""
  steps = sum(e.get("outer_steps", 0) for e in executors.values())
  sums = [e["phases_s"] for e in executors.values() if "phases_s" in e]
  if not steps or not sums:
    return None
  return {k: sum(p.get(k, 0.0) for p in sums) / steps for k in sums[0]}


def _mean_task_store_ops(tasks) -> dict | None:
  """Mean store operations of a task of rounds 1.., by kind."""
  rows = [t["store_ops"] for t in tasks
          if t["round"] > 0 and "store_ops" in t]
  return _mean_counts(rows, len(rows))


def _mean_outer_step_store_ops(executors) -> dict | None:
  """Mean store operations of one outer step, by kind."""
  rows = [e["store_ops"] for e in executors.values() if "store_ops" in e]
  return _mean_counts(rows, sum(e.get("outer_steps", 0)
                                for e in executors.values()))


def _mean_counts(rows: list[dict], n: int) -> dict | None:
  if not rows or not n:
    return None
  kinds = sorted({k for r in rows for k in r})
  return {k: sum(r.get(k, 0) for r in rows) / n for k in kinds}


def _after_round0(tasks, tokens_per_task_path: int) -> float | None:
  """Tokens/s of rounds 1.. over the wall time from the first worker's end
  of round 0's compute to the last task's end: the steady state, without
  the compilation that round 0's first steps carry. Round 0's compute ends
  with its task (its contributions' commit counted in round 0) or, for a
  delayed task, at the end of its `compute` phase (everything after is
  rounds 1.. and their transfers)."""
  tasks = list(tasks)
  first = [t for t in tasks if t["round"] == 0]
  later = [t for t in tasks if t["round"] > 0]
  if not first or not later:
    return None
  start = min(t["start"] + (t["phases"]["compute"]
                            if "compute" in t.get("phases", {})
                            else t["seconds"]) for t in first)
  end = max(t["start"] + t["seconds"] for t in tasks)
  return (tokens_per_task_path * sum(len(t["group"]) for t in later)
          / max(end - start, 1e-9))
