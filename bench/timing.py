"""Timing and output helpers shared by the benchmarks (never used in tests)."""

import json
import time

import jax


def seconds_per_call(fn, steps: int, warmup: int = 1) -> float:
  """Mean wall time of `fn()` over `steps` calls, after `warmup` calls
  (the first compiles); blocks on the results so async dispatch is counted."""
  for _ in range(warmup):
    jax.block_until_ready(fn())
  t0 = time.perf_counter()
  for _ in range(steps):
    out = fn()
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) / steps


def report(result: dict, out_path: str = "") -> None:
  print(json.dumps(result, indent=1))
  if out_path:
    with open(out_path, "w") as f:
      json.dump(result, f, indent=1)
