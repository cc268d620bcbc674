"""Each arm's training-loss gap to the baseline, round by round: how a
codec's cost moves with the number of outer steps within one run.

  python bench/gap_by_round.py ARMS_DIR --inner_steps=15 --rounds=10,30,60,100,150
  python bench/gap_by_round.py ARMS.tgz --inner_steps=15

ARMS_DIR (or a bench script's OUT/arms.tgz) holds NAME.metrics.jsonl per
arm (bench/comm_arms_lib.sh). At round r the gap is the arm's mean logged
training loss minus the baseline's, over the logged steps of the last
`--window` steps up to r * H. Training loss only: a validation figure is
each arm's results.json, at the end. An arm named b<N>_<arm> (<arm> at N
sequences per replica step, bench/comm_arms_lib.sh) is compared with
b<N>_<baseline>, its own batch's baseline.

An arm cut before its end (a device call's timeout) has no metrics.jsonl
in ARMS, only NAME.log: its progress lines (`[main] step N/T  loss L`, or
`[dipaco] ...` for DiPaCo's paths) carry the same logged loss, rounded to
4 decimals, for the steps since its last resume.
"""

import argparse
import json
import pathlib
import re
import tarfile
import tempfile


# A progress line of train/metrics.py's Progress: [run] step N/T  loss L.
_PROGRESS = re.compile(
    r"^\[(main|dipaco)\] step\s+(\d+)/\d+\s+loss\s+([0-9.]+)", re.MULTILINE)


def logged_losses(log_text: str) -> dict[int, float]:
  """Step -> loss from a job's progress lines: DiLoCo's run (`main`), or
  DiPaCo's paths (`dipaco`) where there is none (the order in which
  bench/comm_arms_lib.sh looks for a run's metrics)."""
  by_run = {"main": {}, "dipaco": {}}
  for run, step, loss in _PROGRESS.findall(log_text):
    by_run[run][int(step)] = float(loss)
  return by_run["main"] or by_run["dipaco"]


def losses(arms: pathlib.Path, name: str) -> dict[int, float]:
  metrics = arms / f"{name}.metrics.jsonl"
  if not metrics.exists():
    return logged_losses((arms / f"{name}.log").read_text(errors="replace"))
  rows = [json.loads(line) for line in metrics.read_text().splitlines()
          if line.strip()]
  return {r["step"]: r["loss"] for r in rows if "loss" in r}


def arm_names(arms: pathlib.Path) -> list[str]:
  """Arms with metrics, and those cut short with only a log of progress."""
  names = {p.name[:-len(".metrics.jsonl")]
           for p in arms.glob("*.metrics.jsonl")}
  names |= {p.stem for p in arms.glob("*.log")
            if logged_losses(p.read_text(errors="replace"))}
  return sorted(names)


def gap_at(arm: dict, base: dict, step: int, window: int) -> float | None:
  steps = [s for s in base if step - window < s <= step and s in arm]
  if not steps:
    return None
  return sum(arm[s] - base[s] for s in steps) / len(steps)


def table(arms: pathlib.Path, baseline: str, inner_steps: int,
          rounds: list[int], window: int) -> str:
  names = arm_names(arms)
  lines = ["| arm | " + " | ".join(f"round {r}" for r in rounds) + " |",
           "| --- |" + " --- |" * len(rounds)]
  for name in names:
    batch = re.match(r"b[0-9]+_", name)
    own_baseline = (batch.group(0) if batch else "") + baseline
    if name == own_baseline or own_baseline not in names:
      continue
    base = losses(arms, own_baseline)
    arm = losses(arms, name)
    cells = [gap_at(arm, base, r * inner_steps, window) for r in rounds]
    lines.append(f"| {name} | " + " | ".join(
        "" if c is None else f"{c:+.3f}" for c in cells) + " |")
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("arms", type=pathlib.Path)
  parser.add_argument("--baseline", default="diloco_x8")
  parser.add_argument("--inner_steps", type=int, required=True)
  parser.add_argument("--rounds", default="10,30,60,100,150")
  parser.add_argument("--window", type=int, default=150,
                      help="inner steps averaged up to each round's end")
  args = parser.parse_args()
  rounds = [int(r) for r in args.rounds.split(",")]
  with tempfile.TemporaryDirectory() as tmp:
    arms = args.arms
    if arms.is_file():
      with tarfile.open(arms) as tar:
        tar.extractall(tmp, filter="data")
      arms = pathlib.Path(tmp)
    # The baseline itself, or a larger batch's (b<N>_ of it) alone.
    if not any(re.fullmatch(rf"(b[0-9]+_)?{re.escape(args.baseline)}", n)
               for n in arm_names(arms)):
      raise SystemExit(f"{args.arms}: no {args.baseline}.metrics.jsonl nor "
                       "its progress log (--baseline names the arm to "
                       "compare against)")
    print(table(arms, args.baseline, args.inner_steps, rounds, args.window))


if __name__ == "__main__":
  main()
