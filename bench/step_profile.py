r"""Where the inner step's device time goes: a traced step, grouped by kind.

  python bench/step_profile.py --trace_dir=/tmp/step_trace \
      --out=/tmp/step_profile.json            # the path shape, one path
  python bench/step_profile.py --loss_chunk=256 --fp8 ...    # with options
  python bench/step_profile.py --config=experiments/dense.py ...  # as is
  python bench/step_profile.py --config=experiments/dense.py \
      --set=paths.shape=1 ...   # one slot of 8 layers instead of two of 4
  python bench/step_profile.py --layers=2 --d_model=128 --heads=2 \
      --mlp=256 --vocab=512 --seq=64 --batch=4 --trace_dir=/tmp/t  # CPU

Builds the framework's inner step exactly as bench/step_throughput.py does
(its flags and `make_config`; --paths is one P here), runs --warmup steps,
then traces --steps steps with `jax.profiler.trace` into --trace_dir (open
it in TensorBoard/XProf or ui.perfetto.dev for the timeline). Each device
op of the step's program is put in a category (bench/profile_categories.py:
matmuls, attention, output layer and loss, optimizer update, norms and
elementwise, collectives, other) by its HLO instruction and jax name
scope; the table gives each one's time per step and share of the summed
device op time, and the --out JSON the biggest ops of each.

Step time is the wall time of the traced steps (profiling adds a little);
"device ops" is the summed op time, which exceeds it where ops overlap
(XLA:CPU runs independent thunks in parallel; GPU collectives on their own
stream) and falls short of it by the device's idle time.
"""

import argparse
import os
import sys
import time

# XLA:GPU runs a step's kernels as CUDA graphs ("command buffers"), which a
# trace shows as one opaque op: profile them as separate kernels. (The
# step runs a little slower without graphs; the wall time is step_throughput's.)
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_gpu_enable_command_buffer=")

import jax  # pylint: disable=g-import-not-at-top
import numpy as np

from dipaco_jax import testing
import eval_throughput  # bench/: load_config
import profile_categories  # bench/ (the script's folder is on sys.path)
import step_throughput
import timing


def _build(args):
  if args.config:
    # An experiment config as it is (its mesh chosen over every visible
    # device): e.g. the dense config data parallel on 2 GPUs.
    config = eval_throughput.apply_overrides(
        eval_throughput.load_config(args.config), args.set)
    args.vocab, args.seq = config.data.vocab_size, config.data.seq_len
  else:
    config = step_throughput.make_config(args, args.paths)
  runtime = testing.tiny_runtime(config, vocab_size=args.vocab)
  holder = {"state": runtime.init_state(jax.random.key(0))}
  rng = np.random.default_rng(0)
  w, b, _ = runtime.global_batch_shape
  args.paths, args.batch = w, b
  batch = runtime.worker_rows(rng.integers(
      0, args.vocab, (w, b, args.seq + 1)).astype(np.int32))

  def step():
    holder["state"], metrics = runtime.inner_step(holder["state"], batch)
    return metrics["loss"]
  hlo = runtime.inner_step.jitted.lower(holder["state"], batch).compile(
  ).as_text()
  return step, hlo


def _traced_step_ms(step, steps: int, trace_dir: str) -> float:
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    t0 = time.perf_counter()
    for _ in range(steps):
      out = step()
    jax.block_until_ready(out)
    seconds = time.perf_counter() - t0
  return seconds / steps * 1e3


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--paths", type=int, default=1, help="P workers vmapped")
  p.add_argument("--config", default="",
                 help="an experiment config instead of the shape flags")
  p.add_argument("--set", action="append", default=[],
                 help="with --config: section.field=value, repeatable")
  step_throughput.add_shape_flags(p)
  p.add_argument("--steps", type=int, default=5, help="steps traced")
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--trace_dir", default="/tmp/step_trace")
  p.add_argument("--top", type=int, default=8, help="ops listed per group")
  p.add_argument("--out", default="")
  args = p.parse_args()

  step, hlo = _build(args)
  for _ in range(args.warmup):
    jax.block_until_ready(step())
  step_ms = _traced_step_ms(step, args.steps, args.trace_dir)
  module, ops, computations = profile_categories.parse_hlo(hlo)
  trace = profile_categories.find_trace(args.trace_dir)
  events = profile_categories.device_ops(trace, module)
  if not events:
    sys.exit(f"no device op of {module} in {trace}: the trace names ops "
             "differently on this backend (see profile_categories.py).")
  categories = profile_categories.group(events, ops, computations,
                                        args.steps, args.top)
  print(profile_categories.table(categories, step_ms), flush=True)
  tokens = args.paths * args.batch * args.seq
  timing.report({
      "device": jax.devices()[0].device_kind, "jax": jax.__version__,
      "args": vars(args), "step_ms": step_ms,
      "tokens_per_s": tokens / step_ms * 1e3,
      "device_op_ms": sum(c["ms_per_step"] for c in categories.values()),
      "categories": categories, "trace": os.path.abspath(trace),
      "hlo_module": module,
      # With --fp8 on Hopper, XLA's cuBLASLt FP8 GEMMs (__cublas$lt$matmul$f8):
      # 0 there means the FP8 dots were not rewritten to FP8 kernels.
      "fp8_gemm_calls": sum("f8" in op.target.lower() for op in ops.values()),
  }, args.out)


if __name__ == "__main__":
  main()
