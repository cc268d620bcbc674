r"""The 2-GPU island table of issue 10 from `bench/islands_gpu.sh diloco2`.

  python bench/islands_speedup.py OUT

Reads OUT/diloco_spmd1_metrics.jsonl (one replica on one GPU, SPMD) and
OUT/diloco_islands2_{DELAY}_h{H}_{stats,results}.json (two worker
processes, one GPU each) and prints, per island arm, the aggregate tokens/s
after round 0 (launcher.task_stats: no compilation) against the SPMD run's
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


def spmd_tokens_per_s(out: pathlib.Path) -> float:
  rows = [json.loads(line) for line in
          (out / "diloco_spmd1_metrics.jsonl").read_text().splitlines()]
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


def perplexity(results: dict) -> float:
  return next(iter(results["models"].values()))["perplexity"]


def main():
  out = pathlib.Path(sys.argv[1])
  base = spmd_tokens_per_s(out)
  spmd_ppl = perplexity(json.loads(
      (out / "diloco_spmd1_results.json").read_text()))
  print(f"SPMD, one replica on one GPU: {base:,.0f} tokens/s (median of "
        f"progress rows), validation perplexity {spmd_ppl:.2f}\n")
  print("| delay | H | aggregate tokens/s after round 0 | vs one GPU | "
        "outer-step wait share | mean task phases (s) | perplexity |")
  print("| --- | --- | --- | --- | --- | --- | --- |")
  for path in sorted(out.glob("diloco_islands2_*_stats.json")):
    delay, h = re.fullmatch(r"diloco_islands2_(\w+?)_h(\d+)_stats.json",
                            path.name).groups()
    stats = json.loads(path.read_text())
    results = out / path.name.replace("_stats", "_results")
    ppl = (f"{perplexity(json.loads(results.read_text())):.2f}"
           if results.exists() else "n/a")
    tps = stats.get("tokens_per_s_after_round0")
    phases = stats.get("mean_phases_s") or {}
    print(f"| {delay} | {h} | {tps:,.0f} | {tps / base:.2f}x | "
          f"{wait_share(stats):.0%} | "
          + (", ".join(f"{k} {v:.2f}" for k, v in phases.items()) or "-")
          + f" | {ppl} |")


if __name__ == "__main__":
  main()
