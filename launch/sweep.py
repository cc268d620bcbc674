r"""Runs every point of a sweep config, one `dipaco_jax.main` per point.

  python launch/sweep.py --sweep=experiments/sweep_diloco_outer_lr.py \
      --workdir=/tmp/sweep [-- --config.train.num_steps=100 ...]

A sweep file has `get_config()` (the base experiment) and `get_sweep()`,
a list of {'section.field': value} overrides. Point i runs in
WORKDIR/point_i_<name>; WORKDIR/sweep.json collects every point's results.
Points whose results.json exists are not run again.
"""

import argparse
import importlib.util
import json
import pathlib
import shutil
import subprocess
import sys


def load(path):
  spec = importlib.util.spec_from_file_location("sweep", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def point_name(overrides: dict) -> str:
  return "_".join(f"{k.split('.')[-1]}={v}" for k, v in overrides.items())


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--sweep", required=True)
  parser.add_argument("--workdir", required=True)
  args, extra = parser.parse_known_args()
  extra = [a for a in extra if a != "--"]
  sweep = load(args.sweep)
  workdir = pathlib.Path(args.workdir)
  summary = []
  for i, overrides in enumerate(sweep.get_sweep()):
    run_dir = workdir / f"point_{i}_{point_name(overrides)}"
    flags = [f"--config.{k}={v}" for k, v in overrides.items()]
    first_data = workdir / f"point_0_{point_name(sweep.get_sweep()[0])}" / (
        "data")
    if i > 0 and first_data.exists() and not (run_dir / "data").exists():
      # Points share the data stage (sweeps vary training, not data; a
      # different data config is detected by its key and redone).
      shutil.copytree(first_data, run_dir / "data")
    if not (run_dir / "results.json").exists():
      cmd = [sys.executable, "-m", "dipaco_jax.main",
             f"--config={args.sweep}", f"--workdir={run_dir}", *flags, *extra]
      print(f"=== point {i}: {' '.join(flags)}", flush=True)
      subprocess.run(cmd, check=True)
    results = json.loads((run_dir / "results.json").read_text())
    summary.append({"overrides": overrides, "models": results["models"]})
  (workdir / "sweep.json").write_text(json.dumps(summary, indent=1))
  for row in summary:
    scores = ", ".join(f"{k}: {v['perplexity']:.2f}"
                       for k, v in row["models"].items())
    print(f"{point_name(row['overrides'])}: {scores}")


if __name__ == "__main__":
  main()
