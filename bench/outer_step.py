r"""Cost of the outer step against a round of H inner steps, on one device.

  python bench/outer_step.py --config=experiments/dipaco_4x4.py --h=100

Builds the config's runtime (16 paths for dipaco_4x4), times the jitted
inner step (all paths vmapped) and the jitted outer step (per-module
weighted pseudo-gradients, Nesterov, restart of every path), and reports
outer / (H x inner). The DiPaCo issue asks for at most 2% at H = 100.
"""

import argparse

import jax
import numpy as np

from dipaco_jax import config_base
from dipaco_jax import testing
from dipaco_jax.train import sync as sync_lib
import timing  # bench/timing.py (the script's folder is on sys.path)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", default="experiments/dipaco_4x4.py")
  p.add_argument("--h", type=int, default=100)
  p.add_argument("--vocab", type=int, default=0, help="0: config's vocab")
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--out", default="")
  args = p.parse_args()
  config = config_base.load_experiment(args.config)
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

  sync = sync_lib.InProcessSync(runtime)  # What the training loop calls.

  def outer():
    holder["state"] = sync.finish(0, sync.start(0, holder["state"]))
    return holder["state"]["step"]

  inner_s = timing.seconds_per_call(inner, args.steps)
  outer_s = timing.seconds_per_call(outer, args.steps)
  bank_bytes = sum(x.nbytes for x in jax.tree.leaves(
      holder["state"]["outer"]["params"]))
  result = {
      "device": jax.devices()[0].device_kind, "jax": jax.__version__,
      "config": args.config, "workers": w, "batch_per_path": b,
      "seq_len": seq, "inner_step_s": inner_s, "outer_step_s": outer_s,
      "H": args.h, "outer_over_round": outer_s / (args.h * inner_s),
      "bank_bytes": bank_bytes}
  timing.report(result, args.out)


if __name__ == "__main__":
  main()
