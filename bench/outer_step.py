r"""Cost of the outer step against a round of H inner steps, on one device.

  python bench/outer_step.py --config=experiments/dipaco_4x4.py --h=100

Builds the config's runtime (16 paths for dipaco_4x4), times the jitted
inner step (all paths vmapped) and the jitted outer step (per-module
weighted pseudo-gradients, Nesterov, restart of every path), and reports
outer / (H x inner). The DiPaCo issue asks for at most 2% at H = 100.
"""

import argparse
import importlib.util
import json
import time

import jax
import numpy as np

from dipaco_jax import testing


def load_config(path):
  spec = importlib.util.spec_from_file_location("experiment", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def _time(fn, steps):
  jax.block_until_ready(fn())
  t0 = time.perf_counter()
  for _ in range(steps):
    out = fn()
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) / steps


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", default="experiments/dipaco_4x4.py")
  p.add_argument("--h", type=int, default=100)
  p.add_argument("--vocab", type=int, default=0, help="0: config's vocab")
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--out", default="")
  args = p.parse_args()
  config = load_config(args.config)
  vocab = args.vocab or config.data.vocab_size
  runtime = testing.tiny_runtime(config, vocab_size=vocab)
  holder = {"state": runtime.init_state(jax.random.key(0))}
  w, b, seq = (runtime.topology.num_workers, config.train.batch_size,
               config.data.seq_len)
  batch = runtime.worker_rows(np.random.default_rng(0).integers(
      0, vocab, (w, b, seq + 1)).astype(np.int32))

  def inner():
    holder["state"], metrics = runtime.inner_step(holder["state"], batch)
    return metrics["loss"]

  def outer():
    holder["state"] = runtime.outer_step(holder["state"])
    return holder["state"]["step"]

  inner_s = _time(inner, args.steps)
  outer_s = _time(outer, args.steps)
  bank_bytes = sum(x.nbytes for x in jax.tree.leaves(
      holder["state"]["outer_params"]))
  result = {
      "device": jax.devices()[0].device_kind, "jax": jax.__version__,
      "config": args.config, "workers": w, "batch_per_path": b,
      "seq_len": seq, "inner_step_s": inner_s, "outer_step_s": outer_s,
      "H": args.h, "outer_over_round": outer_s / (args.h * inner_s),
      "bank_bytes": bank_bytes}
  print(json.dumps(result, indent=1))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
