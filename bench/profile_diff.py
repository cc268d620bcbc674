r"""Where two profiled steps differ: `bench/step_profile.py --out` A vs B.

  python bench/profile_diff.py /tmp/one_slot.json /tmp/two_slots.json

Prints the step time, the summed device op time and each category's time
per step (bench/profile_categories.py) of both, with B - A; then the ops
of each category's top list whose jax name (scopes and slot names
stripped of layer ranges) is in only one of the two: e.g. why a path cut
into two slots of 4 layers (paths.shape=1x1) runs slower than one slot of
8 (paths.shape=1), by 4% on an H100 (docs/performance.md).
"""

import json
import re
import sys


def _load(path: str) -> dict:
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def _scope(op_name: str) -> str:
  """An op's jax name without its slot's layer range (layers_00_03 and
  layers_04_07 are the same code) or trailing HLO numbering."""
  return re.sub(r"\.\d+$", "", re.sub(r"layers_\d+_\d+", "layers", op_name))


def main(argv) -> None:
  if len(argv) != 3:
    sys.exit("usage: profile_diff.py A.json B.json (bench/step_profile.py "
             "--out files)")
  a, b = _load(argv[1]), _load(argv[2])
  print("| | A | B | B - A |\n| --- | --- | --- | --- |")
  for key in ("step_ms", "device_op_ms"):
    print(f"| {key} | {a[key]:.3f} | {b[key]:.3f} | {b[key] - a[key]:+.3f} |")
  names = list(a["categories"]) + [k for k in b["categories"]
                                   if k not in a["categories"]]
  for name in names:
    ms = [x["categories"].get(name, {}).get("ms_per_step", 0.0)
          for x in (a, b)]
    print(f"| {name} (ms/step) | {ms[0]:.3f} | {ms[1]:.3f} "
          f"| {ms[1] - ms[0]:+.3f} |")
  for name in names:
    tops = [{_scope(op.get("op_name", op["op"])): op["ms_per_step"]
             for op in x["categories"].get(name, {}).get("top", [])}
            for x in (a, b)]
    for label, mine, other in (("only in A", tops[0], tops[1]),
                               ("only in B", tops[1], tops[0])):
      for scope, ms in mine.items():
        if scope not in other:
          print(f"{name}: {label}: {ms:.4f} ms  {scope}")


if __name__ == "__main__":
  main(sys.argv)
