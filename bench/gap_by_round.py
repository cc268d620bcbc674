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
"""

import argparse
import json
import pathlib
import re
import tarfile
import tempfile


def losses(arms: pathlib.Path, name: str) -> dict[int, float]:
  rows = [json.loads(line) for line in
          (arms / f"{name}.metrics.jsonl").read_text().splitlines()
          if line.strip()]
  return {r["step"]: r["loss"] for r in rows if "loss" in r}


def gap_at(arm: dict, base: dict, step: int, window: int) -> float | None:
  steps = [s for s in base if step - window < s <= step and s in arm]
  if not steps:
    return None
  return sum(arm[s] - base[s] for s in steps) / len(steps)


def table(arms: pathlib.Path, baseline: str, inner_steps: int,
          rounds: list[int], window: int) -> str:
  names = sorted(p.name[:-len(".metrics.jsonl")]
                 for p in arms.glob("*.metrics.jsonl"))
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
    if not any(re.fullmatch(rf"(b[0-9]+_)?{re.escape(args.baseline)}"
                            r"\.metrics\.jsonl", p.name)
               for p in arms.glob("*.metrics.jsonl")):
      raise SystemExit(f"{args.arms}: no {args.baseline}.metrics.jsonl "
                       "(--baseline names the arm to compare against)")
    print(table(arms, args.baseline, args.inner_steps, rounds, args.window))


if __name__ == "__main__":
  main()
