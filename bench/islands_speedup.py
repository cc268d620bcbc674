r"""The island tables of issues 10 and 15 from `bench/islands_gpu.sh`.

  python bench/islands_speedup.py OUT

Reads OUT/{diloco,dipaco}_spmd1_metrics.jsonl (the SPMD run on one GPU)
(and, for DiPaCo, OUT/dipaco_{dense1,path1}_metrics.jsonl: one path
alone in two layouts) and
OUT/{diloco,dipaco}_islands{N}_{DELAY}[_tau{TAU}]_h{H}[_kill{K}]
[_every{E}][_rep{R}]_{stats,results}.json (N worker processes, one GPU each) and
prints, per island arm, the aggregate tokens/s after round 0 (islands/run_stats.task_stats: no compilation) against the SPMD run's
steady tokens/s (the median of its progress rows after the first, which
carries compilation), the share of the workers' wall time spent waiting
for the outer step (the gaps between a worker's tasks plus delayed tasks'
`wait` phase: reading module version r once it is committed), and the
validation perplexities.
"""

import json
import pathlib
import re
import statistics
import sys


def spmd_tokens_per_s(out: pathlib.Path, name: str,
                      run: str = "spmd1") -> float:
  rows = [json.loads(line) for line in
          (out / f"{name}_{run}_metrics.jsonl").read_text().splitlines()]
  return statistics.median(r["tokens_per_s"] for r in rows[1:])


def wait_share(stats: dict) -> float:
  """Outer-step wait over the workers' busy span after round 0."""
  by_worker = {}
  for t in stats["tasks"]:
    by_worker.setdefault(t["worker"], []).append(t)
  waited = spanned = 0.0
  for tasks in by_worker.values():
    tasks.sort(key=lambda t: t["round"])
    for prev, t in zip(tasks, tasks[1:]):
      waited += max(0.0, t["start"] - (prev["start"] + prev["seconds"]))
      waited += t.get("phases", {}).get("wait", 0.0)
    spanned += (tasks[-1]["start"] + tasks[-1]["seconds"]
                - tasks[0]["start"])
  return waited / max(spanned, 1e-9)


def after_round0(stats: dict) -> float:
  """`tokens_per_s_after_round0` with its clock started where round 0's
  compute really ended. Stats written before 2026-11-27's fix started it
  up to 1.6 s early: a first task's `compute` phase left out the building
  of the worker's program, which its `seconds` hold (the phases of a later
  task add up to its seconds, so this changes nothing for those)."""
  tps = stats["tokens_per_s_after_round0"]
  first = [t for t in stats["tasks"]
           if t["round"] == 0 and "compute" in t.get("phases", {})]
  if not first:
    return tps
  end = max(t["start"] + t["seconds"] for t in stats["tasks"])
  unphased = lambda t: t["seconds"] - sum(
      v for k, v in t["phases"].items() if k != "wait_version")
  logged = min(t["start"] + t["phases"]["compute"] for t in first)
  true = min(t["start"] + max(unphased(t), 0.0) + t["phases"]["compute"]
             for t in first)
  return tps * (end - logged) / (end - true)


def perplexity(results: dict) -> float:
  return next(iter(results["models"].values()))["perplexity"]


def train_wall_s(stats: dict) -> float:
  """First task's start to the last task's end: the training stage."""
  tasks = stats["tasks"]
  return (max(t["start"] + t["seconds"] for t in tasks)
          - min(t["start"] for t in tasks))


def table(out: pathlib.Path, name: str) -> None:
  base = spmd_tokens_per_s(out, name)
  spmd_ppl = perplexity(json.loads(
      (out / f"{name}_spmd1_results.json").read_text()))
  print(f"{name}: SPMD on one GPU: {base:,.0f} tokens/s (median of "
        f"progress rows), validation perplexity {spmd_ppl:.2f}")
  # DiPaCo's islands are compared with one path on one GPU too, in
  # two layouts: the dense baseline run (its 8 layers one slot) and the
  # SPMD run of one path as a worker holds it (paths.shape=1x1: two slots
  # of 4 layers, `islands_gpu.sh dipaco4` with PATH1=1).
  baselines = []
  for run, label in (("dense1", "one path's model alone (the dense "
                      "baseline run, one slot of layers)"),
                     ("path1", "one path in a worker's layout (paths.shape"
                      "=1x1, the same H)")):
    if (out / f"{name}_{run}_metrics.jsonl").exists():
      tps = spmd_tokens_per_s(out, name, run)
      baselines.append((run, tps))
      print(f"{name}: {label} on one GPU: {tps:,.0f} tokens/s")
  cols = "".join(f" vs {run} |" for run, _ in baselines)
  print("\n| workers | delay | H | kill | aggregate tokens/s after round 0 "
        f"| vs one GPU |{cols} training wall s | outer-step wait share "
        "| mean task phases after round 0 (s) "
        "| mean outer step phases per unit (s) | perplexity |")
  print("| --- " * (11 + len(baselines)) + "|")
  for path in sorted(out.glob(f"{name}_islands*_stats.json")):
    n, delay, h, kill, every, rep = re.fullmatch(
        rf"{name}_islands(\d+)_(\w+?)_h(\d+)(?:_kill(\d+))?(?:_every(\d+))?"
        r"(?:_rep(\d+))?_stats.json", path.name).groups()
    if every:  # --inner_state_every (bench/islands_gpu.sh's 4th field).
      delay = f"{delay}, AdamW every {every}"
    if rep:  # The same arm run again (bench/islands_gpu.sh).
      delay = f"{delay} (run {rep})"
    stats = json.loads(path.read_text())
    results = out / path.name.replace("_stats", "_results")
    ppl = (f"{perplexity(json.loads(results.read_text())):.2f}"
           if results.exists() else "n/a")
    tps = after_round0(stats)
    phases = stats.get("mean_phases_s") or {}
    print(f"| {n} | {delay} | {h} | {f'w1 at +{kill} s' if kill else '-'} "
          f"| {tps:,.0f} | {tps / base:.2f}x | "
          + "".join(f"{tps / b:.2f}x | " for _, b in baselines)
          + f"{train_wall_s(stats):.1f} | "
          f"{wait_share(stats):.0%} | "
          + (", ".join(f"{k} {v:.2f}" for k, v in phases.items()) or "-")
          + " | " + (", ".join(f"{k} {v:.3f}" for k, v in (
              stats.get("mean_outer_step_phases_s") or {}).items()) or "-")
          + f" | {ppl} |")
  print()


def main():
  out = pathlib.Path(sys.argv[1])
  for name in ("diloco", "dipaco"):
    if (out / f"{name}_spmd1_metrics.jsonl").exists():
      table(out, name)


if __name__ == "__main__":
  main()
