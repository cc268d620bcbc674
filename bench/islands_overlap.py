"""The table of bench/islands_overlap.sh: round time against compute and
the link, measured from the island runs' task timelines.

  python bench/islands_overlap.py WORK --link_mbps=100 --latency_ms=50

A round's measured time is the training span (first task start to last task
end, both workers) over the rounds; every arm's first task also compiles,
so the column to read is what the link adds per round against the arm
without a link. The prediction is the worker's critical
path on a per-role link of the given bandwidth and latency (store/link.py),
from the bytes each role moved (control/bytes): without delay, a round is
compute + its contribution and state up + the executor's reads and writes +
the module read back; one round late, only the module read back stays on it
(its uploads and the outer step run while the next round trains), unless the
transfers take longer than the compute. With `overlap` they have the
next round's first tau of H steps (a share f = tau / H of its compute):
a round is compute + module read, or (1 - f) compute + the transfers where
those take longer. The int4 arms send int4 +
error-feedback payloads (islands/wire.py): their bytes are what the
roles measured, so the same prediction holds.
"""

import argparse
import json
from pathlib import Path

ARMS = ("plain_fast", "plain_link", "late_link", "int4_link",
        "late_int4_link", "overlap_link")


def _load(path: Path):
  return json.loads(path.read_text()) if path.exists() else None


def measured(work: Path, arm: str) -> dict | None:
  run = work / arm / "islands" / "main"
  stats = _load(run / "stats.json")
  if stats is None:
    return None
  tasks = stats["tasks"]
  rounds = 1 + max(t["round"] for t in tasks)
  span = (max(t["start"] + t["seconds"] for t in tasks)
          - min(t["start"] for t in tasks))
  written, read = {}, {}
  for path in (run / "control" / "bytes").glob("*.json"):
    counts = _load(path)
    role = "executor" if path.stem.startswith("executor") else "worker"
    for kind, into in (("written", written), ("read", read)):
      into[role] = into.get(role, 0) + sum(counts[kind].values())
  return {"rounds": rounds, "round_s": span / rounds,
          "phases": stats.get("mean_phases_s"), "written": written,
          "read": read}


def predict(fast: dict, arm: dict, hidden: float, mbps: float,
            latency_ms: float) -> float:
  """The worker's critical path per round on the emulated link; `hidden`:
  the share of a round's compute the transfers run beside (0: no delay,
  1: one_round, tau / H: overlap)."""
  rate, lat = mbps * 1e6 / 8, latency_ms / 1e3
  compute = fast["round_s"]
  rounds, workers = arm["rounds"], 2
  per_task = lambda role, kind: arm[kind].get(role, 0) / rounds / (
      workers if role == "worker" else 1)
  up = per_task("worker", "written") / rate + 2 * lat
  down = per_task("worker", "read") / rate + lat
  executor = (per_task("executor", "read") + per_task("executor", "written")
              ) / rate + 4 * lat
  if not hidden:
    return compute + up + executor + down
  return max(compute + down, (1 - hidden) * compute + up + executor + down)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("work", type=Path)
  parser.add_argument("--link_mbps", type=float, required=True)
  parser.add_argument("--latency_ms", type=float, required=True)
  parser.add_argument("--out", type=Path)
  parser.add_argument("--tau", type=int, default=10,
                      help="the overlap arm's overlap_steps")
  parser.add_argument("--inner_steps", type=int, default=50, help="H")
  args = parser.parse_args()
  # The int4 arms run only with INT4=1 (bench/islands_overlap.sh).
  runs = {a: measured(args.work, a) for a in ARMS
          if (args.work / a).exists()}
  fast = runs["plain_fast"]
  # Every arm's first task compiles: compare what the link adds per round.
  lines = ["| arm | link | measured round (s) | added by the link (s) | "
           "predicted round (s) | mean task phases (s) |",
           "| --- | --- | --- | --- | --- | --- |"]
  for arm, run in runs.items():
    if run is None:
      lines.append(f"| {arm} | | failed | | | |")
      continue
    link = "none" if arm == "plain_fast" else (
        f"{args.link_mbps:g} Mbit/s, {args.latency_ms:g} ms")
    hidden = (1.0 if arm.startswith("late") else
              args.tau / args.inner_steps if arm.startswith("overlap")
              else 0.0)
    pred = ("" if arm == "plain_fast" else
            f"{predict(fast, run, hidden, args.link_mbps, args.latency_ms):.2f}")
    phases = ", ".join(f"{k} {v:.2f}" for k, v in (run["phases"] or {}
                                                    ).items())
    added = run["round_s"] - fast["round_s"]
    lines.append(f"| {arm} | {link} | {run['round_s']:.2f} | {added:+.2f} | "
                 f"{pred} | {phases} |")
  table = "\n".join(lines)
  print(table)
  if args.out:
    args.out.write_text(table + "\n")


if __name__ == "__main__":
  main()
