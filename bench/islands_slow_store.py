r"""The island runtime on a slow store: each round against a model of it.

Runs the islands quickstart (docs/islands.md) twice on this machine: with
the store at disk speed, then with `--link_latency_ms=L` added to every
store operation (store/link.py: a marker, a control file, a listing, an
array transfer), on a copy of the first run's workdir (the same data, base
and dense baseline: only the island training runs again). Then it checks
the steady round time against

  T(L) = T(0) + L x N

T(0): the round at disk speed (compute, and the bytes at the disk's
bandwidth); N: the store operations on a round's critical path, counted by
the roles themselves:
  - each worker's tasks of the round, one after another (their own
    operations: module reads, contributions, AdamW states, stats);
  - the outer steps each executor applies in the round;
  - one polling iteration of the role that notices each hand-off: an
    executor seeing the round's contributions, then per task of a worker
    the coordinator's tick that frees and leases it and the worker's look
    at its lease.

  python bench/islands_slow_store.py --out=/tmp/slow_store [--latency_ms=50]
      [--fsync] [--workdir=/tmp/slow_store_runs] [-- --config.X=Y ...]

With --fsync, a third run at disk speed with `--store_fsync` (each key
synced to disk before its marker): what the durability costs a round.
Writes OUT/slow_store.md (the table) and each run's stats.json.
"""

import argparse
import json
import pathlib
import shutil
import statistics
import subprocess
import sys
import time

_ISLANDS = ["--config=experiments/quickstart.py:small", "--num_workers=2",
            "--fake_devices=8"]
_COPIED = ("data", "runs/base", "runs/dense", "shards", "router",
           "splits.json")


def _run(workdir: pathlib.Path, flags: list[str], log: pathlib.Path) -> float:
  cmd = [sys.executable, "-m", "dipaco_jax.islands", *_ISLANDS,
         f"--workdir={workdir}", *flags]
  t0 = time.monotonic()
  with open(log, "w") as f:
    subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=True)
  return time.monotonic() - t0


def _copy_stages(src: pathlib.Path, dst: pathlib.Path) -> None:
  shutil.rmtree(dst, ignore_errors=True)
  for name in _COPIED:
    if (src / name).is_dir():
      shutil.copytree(src / name, dst / name)
    elif (src / name).exists():
      (dst / name).parent.mkdir(parents=True, exist_ok=True)
      shutil.copy(src / name, dst / name)


def _round_starts(tasks: list[dict]) -> dict[int, float]:
  starts = {}
  for t in tasks:
    starts[t["round"]] = min(starts.get(t["round"], t["start"]), t["start"])
  return starts


def steady_round_s(stats: dict) -> float:
  """Median time from a round's first task start to the next round's, over
  rounds 1.. (round 0 compiles)."""
  starts = _round_starts(stats["tasks"])
  rounds = sorted(starts)
  gaps = [starts[b] - starts[a] for a, b in zip(rounds, rounds[1:])
          if a >= 1]
  return statistics.median(gaps)


def critical_ops(stats: dict) -> dict[str, float]:
  """Store operations on a steady round's critical path (the docstring's
  N), by part, from a run's stats.json."""
  per_worker_round = {}
  tasks_per_worker_round = {}
  for t in stats["tasks"]:
    if t["round"] < 1 or "store_ops" not in t:
      continue
    key = (t["worker"], t["round"])
    per_worker_round[key] = (per_worker_round.get(key, 0)
                             + sum(t["store_ops"].values()))
    tasks_per_worker_round[key] = tasks_per_worker_round.get(key, 0) + 1
  # The worker whose round is longest in operations carries the round.
  rounds = sorted({r for _, r in per_worker_round})
  worker_ops = statistics.mean(
      max(v for (_, r), v in per_worker_round.items() if r == rr)
      for rr in rounds)
  tasks = statistics.mean(
      max(v for (_, r), v in tasks_per_worker_round.items() if r == rr)
      for rr in rounds)
  loop = stats["loop_store_ops"]
  step_ops = sum((stats["mean_outer_step_store_ops"] or {}).values())
  steps_per_executor = stats["outer_steps_per_executor_round"]
  return {"worker tasks": worker_ops,
          "outer steps": step_ops * steps_per_executor,
          "hand-offs": (loop.get("executor", 0.0) + tasks * (
              loop.get("coordinator", 0.0) + loop.get("worker", 0.0)))}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", required=True)
  parser.add_argument("--workdir", default="/tmp/slow_store_runs")
  parser.add_argument("--latency_ms", type=float, default=50.0)
  parser.add_argument("--fsync", action="store_true")
  parser.add_argument("extra", nargs="*", help="flags for both runs")
  args = parser.parse_args()
  out, base = pathlib.Path(args.out), pathlib.Path(args.workdir)
  out.mkdir(parents=True, exist_ok=True)
  arms = [("latency_0ms", 0.0, []),
          (f"latency_{args.latency_ms:g}ms", args.latency_ms,
           [f"--link_latency_ms={args.latency_ms}"])]
  if args.fsync:
    arms.append(("fsync", 0.0, ["--store_fsync"]))
  rows = {}
  for name, latency, flags in arms:
    workdir = base / name
    if rows:  # The first run's stages, reused.
      _copy_stages(base / arms[0][0], workdir)
    else:
      shutil.rmtree(workdir, ignore_errors=True)
    wall = _run(workdir, flags + args.extra, out / f"{name}.log")
    stats_path = workdir / "islands" / "dipaco" / "stats.json"
    stats = json.loads(stats_path.read_text())
    shutil.copy(stats_path, out / f"{name}_stats.json")
    rows[name] = (latency, " ".join(flags) or "none", wall, stats)
  t0 = steady_round_s(rows[arms[0][0]][3])
  lines = [
      f"Islands quickstart (`{' '.join(_ISLANDS + args.extra)}`), "
      f"{args.latency_ms:g} ms per store operation against none; "
      "steady round = median time between round starts over rounds 1..",
      "",
      "| flags | job wall s | steady round s | mean task phases s | "
      "operations on a round's critical path | predicted round s | "
      "measured / predicted |",
      "| --- | --- | --- | --- | --- | --- | --- |"]
  for latency, flags, wall, stats in rows.values():
    parts = critical_ops(stats)
    n = sum(parts.values())
    predicted = t0 + latency / 1e3 * n
    measured = steady_round_s(stats)
    phases = ", ".join(f"{k} {v:.2f}"
                       for k, v in (stats["mean_phases_s"] or {}).items())
    lines.append(
        f"| {flags} | {wall:.0f} | {measured:.2f} | {phases} | {n:.1f} ("
        + ", ".join(f"{k} {v:.1f}" for k, v in parts.items())
        + f") | {predicted:.2f} | {measured / predicted:.2f} |")
  table = "\n".join(lines)
  (out / "slow_store.md").write_text(table + "\n")
  print(table)


if __name__ == "__main__":
  main()
