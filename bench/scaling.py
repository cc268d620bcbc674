r"""Training tokens/s of the dense, DiPaCo 2x2 and 4x4 configs on 1, 2, 4 GPUs.

  python bench/scaling.py --devices=1,2 --out=/tmp/scaling.json

For each config and device count it starts a child process that sees only
that many GPUs (CUDA_VISIBLE_DEVICES), builds the config's runtime (the
mesh chosen automatically, as the main job does) and runs the framework's
own training loop (`train.loop.train`) on random token batches for
`--steps` steps, checkpointing only at the end. The figure is the median of
the loop's own tokens/s between log points after the first (compilation
and warm-up excluded), i.e. what the progress line shows a user. The child
also times the bare jitted inner step on a batch already on the devices
(with `--set=train.steps_per_dispatch=K`, one K-step dispatch over K):
the gap between the two is what the host costs per step. With
`--set=train.profile_steps=START:COUNT` the loop's run is traced and each
result carries its device idle gaps and the host threads' stacks in them
(`trace_gaps`, bench/trace_gaps.py): where the loop loses to the bare step.
With `--early_stopping_tokens=N` the loop runs per-path early stopping
(`eval/early_stopping.py`) after every outer step (every K-th with
`--set=eval.early_stopping_every=K`), each path scored on N
random held-out tokens of its own; the result then counts the path bests
it kept, i.e. paths that improved at an outer step (`early_stopping_saves`).

Ratios compare each config against its own 1-GPU figure in the same call.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CONFIGS = ("experiments/dense.py", "experiments/dipaco_2x2.py",
           "experiments/dipaco_4x4.py")


def child(args):
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from dipaco_jax import testing  # pylint: disable=g-import-not-at-top
  from dipaco_jax.train import loop  # pylint: disable=g-import-not-at-top
  from dipaco_jax.train import metrics  # pylint: disable=g-import-not-at-top
  import eval_throughput  # bench/eval_throughput.py: load_config
  import profile_categories  # pylint: disable=g-import-not-at-top
  import timing  # pylint: disable=g-import-not-at-top
  import trace_gaps  # pylint: disable=g-import-not-at-top

  c = eval_throughput.load_config(args.config)
  c.train.num_steps = args.steps
  c.train.log_every = args.log_every
  c.ckpt.every = 0
  eval_throughput.apply_overrides(c, args.set)
  runtime = testing.tiny_runtime(c, vocab_size=c.data.vocab_size)
  w, b, l = runtime.global_batch_shape
  batches = testing.RandomBatches(w, b, l - 1, c.data.vocab_size)
  gaps, callbacks, stopper = None, (), None
  with tempfile.TemporaryDirectory() as run_dir:
    if args.early_stopping_tokens:
      stopper = _early_stopping(runtime, args.early_stopping_tokens, run_dir)
      callbacks = (stopper,)
    t0 = time.perf_counter()
    loop.train(runtime, batches, run_dir, {}, "scaling",
               after_outer_step=callbacks)
    wall = time.perf_counter() - t0
    rows = metrics.read_jsonl(f"{run_dir}/logs/train/metrics.jsonl")
    if c.train.profile_steps:  # --set=train.profile_steps=START:COUNT
      gaps = trace_gaps.summarize(profile_categories.find_trace(
          f"{run_dir}/logs/profile"), top=5)
  loop_tps = float(np.median([r["tokens_per_s"] for r in rows[1:]]))
  # The bare step on a device-resident batch: no host work in between.
  state = runtime.init_state(jax.random.key(0))
  # With train.steps_per_dispatch = K > 1 the bare figure is one K-step
  # dispatch (the scan the loop runs) divided by K.
  k = c.train.steps_per_dispatch
  one = batches.batch(0, runtime.local_workers)
  holder = {"s": state}
  if k > 1:
    batch = runtime.worker_rows(np.stack([one] * k))
    run = runtime.inner_k_steps
  else:
    batch = runtime.worker_rows(one)
    run = runtime.inner_step

  def step():
    holder["s"], m = run(holder["s"], batch)
    return m["loss"]

  seconds = timing.seconds_per_call(step, max(50 // k, 5), warmup=3) / k
  tokens_per_step = w * b * (l - 1)
  print("RESULT " + json.dumps({
      "config": args.config, "devices": jax.device_count(),
      "mesh": dict(runtime.mesh.shape), "workers": w,
      "batch_per_worker": b, "loop_tokens_per_s": loop_tps,
      "bare_step_tokens_per_s": tokens_per_step / seconds,
      "bare_step_ms": seconds * 1e3,
      "loop_step_ms": tokens_per_step / loop_tps * 1e3,
      "steps_per_dispatch": k, "wall_s": wall, "set": args.set,
      "trace_gaps": gaps,
      "early_stopping_tokens": args.early_stopping_tokens,
      "early_stopping_saves": stopper.saves if stopper else None}),
        flush=True)


def _early_stopping(runtime, tokens_per_path: int, run_dir: str):
  """Per-path early stopping on random held-out documents of 1,000 tokens,
  counting the path bests it keeps."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from dipaco_jax.data import token_store  # pylint: disable=g-import-not-at-top
  from dipaco_jax.eval import early_stopping  # pylint: disable=g-import-not-at-top

  c = runtime.config
  rng = np.random.default_rng(0)
  num_docs = max(tokens_per_path // 1000, 1)
  docs = [token_store.TokenDocs(
      rng.integers(4, c.data.vocab_size, num_docs * 1000).astype(np.int32),
      np.arange(num_docs + 1) * 1000)
          for _ in range(runtime.topology.num_paths)]

  class Counting(early_stopping.EarlyStopping):
    saves = 0

    def __call__(self, step, state):
      before = dict(self.best)
      super().__call__(step, state)
      self.saves += sum(before.get(k) != v for k, v in self.best.items())

  # The outer steps it scores as the main job's (pipeline.py) would.
  return Counting(runtime, docs, f"{run_dir}/early_stopping",
                  c.data.seq_len, c.data.prefix_len, c.train.eval_batch_size,
                  every_rounds=c.eval.early_stopping_every,
                  inner_steps=c.diloco.inner_steps,
                  last_step=c.train.num_steps)


def parent(args):
  results = []
  # The first n of the GPUs this process may use (all, unless the caller
  # set CUDA_VISIBLE_DEVICES: then other work can run on the others).
  visible = [x for x in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
             if x]
  for config in args.configs.split(","):
    for n in (int(x) for x in args.devices.split(",")):
      gpus = visible[:n] if visible else [str(i) for i in range(n)]
      env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(gpus))
      cmd = [sys.executable, __file__, "--child", f"--config={config}",
             f"--steps={args.steps}", f"--log_every={args.log_every}",
             f"--early_stopping_tokens={args.early_stopping_tokens}"] + [
                 f"--set={s}" for s in args.set]
      proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                            timeout=args.timeout)
      line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
      if proc.returncode or not line:
        print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
        results.append({"config": config, "devices": n, "error":
                        proc.stderr.strip().splitlines()[-1:]})
        continue
      results.append(json.loads(line[0][len("RESULT "):]))
      print(json.dumps(results[-1]), flush=True)
  for r in results:
    one = [x for x in results if x["config"] == r["config"] and
           x.get("devices") == 1 and "error" not in x]
    if one and "error" not in r:
      r["loop_speedup"] = r["loop_tokens_per_s"] / one[0]["loop_tokens_per_s"]
      r["bare_speedup"] = (r["bare_step_tokens_per_s"] /
                           one[0]["bare_step_tokens_per_s"])
  print("\nconfig                     GPUs  loop tok/s  x1 GPU  bare tok/s  x1")
  for r in results:
    if "error" in r:
      print(f"{r['config']:<26} {r['devices']:>4}  error: {r['error']}")
      continue
    print(f"{r['config']:<26} {r['devices']:>4} {r['loop_tokens_per_s']:>11,.0f}"
          f" {r.get('loop_speedup', 0):>7.2f} {r['bare_step_tokens_per_s']:>11,.0f}"
          f" {r.get('bare_speedup', 0):>5.2f}")
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"args": vars(args), "results": results}, f, indent=1)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--configs", default=",".join(CONFIGS))
  p.add_argument("--devices", default="1,2")
  p.add_argument("--steps", type=int, default=300)
  p.add_argument("--log_every", type=int, default=50)
  p.add_argument("--set", action="append", default=[],
                 help="section.field=value applied to every config")
  p.add_argument("--timeout", type=int, default=300)
  p.add_argument("--early_stopping_tokens", type=int, default=0,
                 help="per-path early stopping on this many held-out "
                 "tokens a path (0: off)")
  p.add_argument("--out", default="")
  p.add_argument("--child", action="store_true")
  p.add_argument("--config", default="")
  args = p.parse_args()
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  child(args) if args.child else parent(args)


if __name__ == "__main__":
  main()
