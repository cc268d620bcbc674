r"""How many kernels the compiled inner step launches, by part of the step.

  python bench/hlo_kernels.py --config=experiments/dense.py \
      --set=paths.shape=1 --set=paths.shape=1x1      # two layouts compared

Compiles the framework's inner step (`Runtime._step`, one worker's AdamW
step vmapped over the workers) for each `--set` value given last (the
other `--set`s apply to all) on whatever backend JAX has, and counts the
instructions of the compiled program's entry computation, each a kernel
(a fusion, a library call, a copy) on this backend, by the jax name scope
they came from: the optimizer update, the model (forward and backward) or
other (gradient clipping, the loss's reductions, the step counter). No
timing: on the GPU, each kernel also costs a launch and a tail, so a step
of many small kernels runs below the roofline of its bytes and FLOPs.
The question: why do two slots of 4 layers (paths.shape=1x1, a DiPaCo
2x2 path) run 4% slower than one slot of 8 (paths.shape=1) on an H100
(docs/performance.md)?
XLA:GPU fuses differently from XLA:CPU: count on the GPU for its numbers.
"""

import argparse
import collections
import os
import re
import sys

# As bench/step_profile.py: kernels one by one, not as CUDA graphs.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_gpu_enable_command_buffer=")

import jax  # pylint: disable=g-import-not-at-top
import numpy as np

from dipaco_jax import testing
import eval_throughput  # bench/: load_config, apply_overrides

_NOT_KERNELS = ("parameter", "constant", "get-tuple-element", "tuple",
                "bitcast")


def count_kernels(hlo_text: str) -> dict[str, int]:
  """Entry-computation instructions of a compiled HLO module by scope."""
  entry = hlo_text[hlo_text.index("\nENTRY"):]
  counts = collections.Counter()
  for line in entry.splitlines()[1:]:
    kind = re.search(r"= \S+ ([\w-]+)\(", line)
    if not kind or kind.group(1) in _NOT_KERNELS:
      continue
    name = re.search(r'op_name="([^"]*)"', line)
    name = name.group(1) if name else ""
    counts["optimizer" if "optimizer" in name else
           "model" if "PathTransformer" in name else "other"] += 1
  counts["all"] = sum(counts.values())
  return dict(counts)


def compiled_step_hlo(config) -> str:
  runtime = testing.tiny_runtime(config, vocab_size=config.data.vocab_size)
  state = runtime.init_state(jax.random.key(0))
  w, b, _ = runtime.global_batch_shape
  batch = runtime.worker_rows(np.zeros((w, b, config.data.seq_len + 1),
                                       np.int32))
  return runtime.inner_step.jitted.lower(state, batch).compile().as_text()


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", required=True)
  p.add_argument("--set", action="append", default=[],
                 help="section.field=value; the last field set several "
                 "times is compared across its values")
  args = p.parse_args()
  if not args.set:
    sys.exit("--set: at least one section.field=value")
  varied = args.set[-1].split("=", 1)[0]
  fixed = [s for s in args.set if s.split("=", 1)[0] != varied]
  values = [s for s in args.set if s.split("=", 1)[0] == varied]
  print(f"| {varied} | optimizer | model | other | all |")
  print("| --- | --- | --- | --- | --- |")
  for setting in values:
    config = eval_throughput.apply_overrides(
        eval_throughput.load_config(args.config), fixed + [setting])
    c = count_kernels(compiled_step_hlo(config))
    print(f"| {setting.split('=', 1)[1]} | {c.get('optimizer', 0)} | "
          f"{c.get('model', 0)} | {c.get('other', 0)} | {c['all']} |",
          flush=True)


if __name__ == "__main__":
  main()
