"""bench/hlo_kernels.py: the compiled step's kernels counted by scope, and
what it showed of the two-slot layout (docs/performance.md)."""

import importlib.util
import os
import sys

from dipaco_jax import testing

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))  # its eval_throughput
_spec = importlib.util.spec_from_file_location(
    "hlo_kernels", os.path.join(REPO, "bench", "hlo_kernels.py"))
hlo_kernels = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hlo_kernels)


def test_entry_instructions_are_counted_by_scope():
  hlo = """HloModule m
%fused (p: f32[2]) -> f32[2] {
  %p = f32[2]{0} parameter(0)
  ROOT %n = f32[2]{0} negate(%p), metadata={op_name="jit(f)/optimizer/mul"}
}

ENTRY %main (a: f32[2]) -> (f32[2], f32[2]) {
  %a = f32[2]{0} parameter(0)
  %f1 = f32[2]{0} fusion(%a), kind=kLoop, calls=%fused, metadata={op_name="jit(f)/vmap(optimizer)/add"}
  %f2 = f32[2]{0} fusion(%f1), kind=kLoop, calls=%fused, metadata={op_name="jit(f)/PathTransformer/dot"}
  %c = f32[2]{0} copy(%f2)
  ROOT %t = (f32[2]{0}, f32[2]{0}) tuple(%f1, %c)
}
"""
  # The fused computation's own instructions are not kernels of their own.
  assert hlo_kernels.count_kernels(hlo) == {
      "optimizer": 1, "model": 1, "other": 1, "all": 3}


def test_two_layer_slots_add_optimizer_kernels():
  # A path cut into two slots of layers (a DiPaCo 2x2 path) holds twice the
  # stacked layer leaves of one slot: the AdamW update runs per leaf, so
  # its kernels grow, while the model's barely change (XLA:CPU here;
  # docs/performance.md has the GPU question this answers in part).
  counts = {}
  for shape in ("1", "1x1"):
    config = testing.tiny_config(shape, replicas=1, inner_steps=0)
    counts[shape] = hlo_kernels.count_kernels(
        hlo_kernels.compiled_step_hlo(config))
  extra = {k: counts["1x1"].get(k, 0) - counts["1"].get(k, 0)
           for k in ("optimizer", "model")}
  assert extra["optimizer"] > 2 * max(extra["model"], 1), counts
