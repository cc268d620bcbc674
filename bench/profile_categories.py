"""Groups a jax.profiler trace's device ops into the categories below.

The trace (the `perfetto_trace.json.gz` that `jax.profiler.trace(...,
create_perfetto_trace=True)` writes) names each device op by its HLO
instruction (`args.hlo_op`, with `args.hlo_module`): XLA:GPU kernels and
XLA:CPU thunks alike. The compiled program's HLO text (`compiled.as_text()`)
tells, for each instruction, its opcode, what a fusion computes and the
`op_name` metadata, which carries the jax name stack: flax's module scopes
(`attention`, `mlp`, `embed_head.logits`, ...) and the `jax.named_scope`s
the step adds (`output_layer_loss`, `optimizer`, `dot_product_attention`).

Category of an op, first rule that matches:
  collectives        all-reduce, all-gather, reduce-scatter, permutes, ...
  attention          cuDNN fused attention (fmha) or ops under
                     `dot_product_attention` (the XLA implementation)
  output_layer_loss  ops under `output_layer_loss` or the head
                     (`embed_head.logits`, `embed_head.head_inputs`), its
                     matmul and backward included
  optimizer          ops under `optimizer` (AdamW, clipping, the update)
  matmul             dot/convolution, cuBLAS/cuBLASLt GEMM custom calls,
                     fusions holding a dot (Triton GEMMs)
  norms_elementwise  other fusions, reductions, elementwise ops
  other              copies, transposes, slices, gathers, control flow...
A backward op keeps its forward's scope (`transpose(jvp(...))/...`), so
the head's and the attention's gradients land with them.
"""

import collections
import dataclasses
import glob
import gzip
import json
import os
import re

CATEGORIES = ("matmul", "attention", "output_layer_loss", "optimizer",
              "norms_elementwise", "collectives", "other")

_COLLECTIVE = re.compile(r"^(all-reduce|all-gather|reduce-scatter|"
                         r"collective-permute|all-to-all|collective-broadcast|"
                         r"send|recv|ragged-all-to-all)")
_CONTROL_FLOW = ("while", "conditional", "call", "async-start", "async-done",
                 "async-update")
_DATA_MOVEMENT = ("copy", "copy-start", "copy-done", "transpose", "slice",
                  "dynamic-slice", "dynamic-update-slice", "concatenate",
                  "pad", "gather", "scatter", "bitcast", "reshape",
                  "broadcast", "tuple", "get-tuple-element", "parameter",
                  "constant", "iota")
_GEMM_WORDS = ("gemm", "matmul", "cublas", "cutlass", "xmma")
_ATTENTION_WORDS = ("fmha", "flash")
_OUTPUT_SCOPES = ("output_layer_loss", "embed_head.logits",
                  "embed_head.head_inputs")


@dataclasses.dataclass
class HloOp:
  name: str
  opcode: str
  op_name: str  # The jax name stack (metadata), "" if none.
  target: str  # custom_call_target, or the fusion's backend kind.
  calls: tuple[str, ...]  # Called computations (fusion bodies, loops).


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[^\s=]+)\s*=\s*"
                          r"(?P<rest>.*)$")
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?(?P<name>[^\s(]+)\s*\(.*\{\s*$")


def _opcode(rest: str) -> str:
  """'f32[2]{0} add(%a, %b), ...' or '(f32[], s32[]) tuple(...)' -> op."""
  if rest.startswith("("):  # A tuple type: skip to its closing paren.
    depth = 0
    for i, ch in enumerate(rest):
      depth += {"(": 1, ")": -1}.get(ch, 0)
      if depth == 0:
        rest = rest[i + 1:]
        break
  else:
    rest = rest.split(" ", 1)[1] if " " in rest else rest
  return rest.strip().split("(", 1)[0].strip()


def parse_hlo(text: str) -> tuple[str, dict[str, HloOp], dict]:
  """(module name, {instruction: HloOp}, {computation: [instructions]})."""
  module = ""
  ops, computations, current = {}, collections.defaultdict(list), ""
  for line in text.splitlines():
    if line.startswith("HloModule "):
      module = line.split()[1].rstrip(",")
      continue
    header = _COMPUTATION.match(line)
    if header and " = " not in line.split("(", 1)[0]:
      current = header.group("name")
      continue
    match = _INSTRUCTION.match(line)
    if not match or not current:
      continue
    rest = match.group("rest")
    op_name = re.search(r'op_name="([^"]*)"', rest)
    target = (re.search(r'custom_call_target="([^"]*)"', rest) or
              re.search(r'"kind":"([^"]*)"', rest))
    calls = re.findall(r"(?:calls|body|condition|to_apply|"
                       r"branch_computations)=\{?%?([\w.\-]+)", rest)
    op = HloOp(match.group("name"), _opcode(rest),
               op_name.group(1) if op_name else "",
               target.group(1) if target else "", tuple(calls))
    ops[op.name] = op
    computations[current].append(op.name)
  computations = dict(computations)
  for op in ops.values():
    if not op.op_name:  # A fusion without metadata: its body's scope.
      op.op_name = _body_op_name(op, ops, computations)
  return module, ops, computations


def _body_op_name(op: HloOp, ops, computations, depth=0) -> str:
  """The first op_name inside the computations `op` calls (its body's
  ROOT is listed last, so that is searched first)."""
  for c in op.calls:
    for name in reversed(computations.get(c, ())):
      inner = ops[name]
      if inner.op_name:
        return inner.op_name
      if depth < 3 and inner.calls:
        found = _body_op_name(inner, ops, computations, depth + 1)
        if found:
          return found
  return ""


def _holds_matmul(op: HloOp, ops, computations, depth=0) -> bool:
  if op.opcode in ("dot", "convolution"):
    return True
  if any(w in op.target.lower() for w in _GEMM_WORDS):
    return True
  if op.opcode != "fusion" or depth > 3:
    return False
  return any(_holds_matmul(ops[i], ops, computations, depth + 1)
             for c in op.calls for i in computations.get(c, ()) if i in ops)


def categorize(op: HloOp, ops, computations) -> str | None:
  """The category of one instruction (module docstring); None for control
  flow, whose time is its body's ops (counted on their own)."""
  scope, target = op.op_name, op.target.lower()
  if _COLLECTIVE.match(op.opcode) or "nccl" in target:
    return "collectives"
  if op.opcode in _CONTROL_FLOW:
    return None
  if (any(w in target for w in _ATTENTION_WORDS) or
      "dot_product_attention" in scope):
    return "attention"
  if any(s in scope for s in _OUTPUT_SCOPES):
    return "output_layer_loss"
  if "optimizer" in scope:
    return "optimizer"
  if _holds_matmul(op, ops, computations):
    return "matmul"
  if op.opcode in _DATA_MOVEMENT:
    return "other"
  return "norms_elementwise"


def _by_kernel_name(name: str) -> str:
  """For a device op that the HLO does not name (a library's kernel)."""
  lower = name.lower()
  if any(w in lower for w in _GEMM_WORDS):
    return "matmul"
  if any(w in lower for w in _ATTENTION_WORDS):
    return "attention"
  # A collective the HLO names only as its async start/done pair shows in
  # the trace under its own name (e.g. "all-reduce.64"; seen on 2 H100s).
  if "nccl" in lower or _COLLECTIVE.match(lower):
    return "collectives"
  return "other"


def find_trace(trace_dir: str) -> str:
  """The newest perfetto trace under `trace_dir` (jax writes it to
  plugins/profile/<timestamp>/)."""
  files = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"),
                    recursive=True)
  if not files:
    raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
  return max(files, key=os.path.getmtime)


def device_ops(trace_path: str, module: str) -> list[tuple[str, float]]:
  """(HLO op or kernel name, microseconds) of each event of `module`."""
  with gzip.open(trace_path, "rt") as f:
    data = json.load(f)
  events = data["traceEvents"] if isinstance(data, dict) else data
  out = []
  for e in events:
    args = e.get("args") or {}
    if e.get("ph") != "X" or "hlo_op" not in args:
      continue
    if args.get("hlo_module", module) != module:
      continue
    out.append((args["hlo_op"], float(e.get("dur", 0.0))))
  return out


def group(events, ops, computations, steps: int, top: int = 5) -> dict:
  """{category: {ms_per_step, share, top: [{op, op_name, ms_per_step}]}}
  over the events of `steps` steps; shares of the summed device op time."""
  per_op = collections.Counter()
  for name, micros in events:
    per_op[name] += micros
  totals = collections.Counter()
  members = collections.defaultdict(list)
  for name, micros in per_op.items():
    op = ops.get(name)
    category = (categorize(op, ops, computations) if op
                else _by_kernel_name(name))
    if category is None:
      continue
    totals[category] += micros
    members[category].append((micros, name))
  all_micros = sum(totals.values()) or 1.0
  result = {}
  for category in CATEGORIES:
    biggest = sorted(members[category], reverse=True)[:top]
    result[category] = {
        "ms_per_step": totals[category] / 1e3 / steps,
        "share": totals[category] / all_micros,
        "top": [{"op": n, "op_name": ops[n].op_name if n in ops else "",
                 "ms_per_step": m / 1e3 / steps} for m, n in biggest]}
  return result


def table(categories: dict, step_ms: float) -> str:
  rows = [f"{'category':<18} {'ms/step':>9} {'share':>7}"]
  for name, c in categories.items():
    rows.append(f"{name:<18} {c['ms_per_step']:9.3f} {c['share']:7.1%}")
  op_ms = sum(c["ms_per_step"] for c in categories.values())
  rows.append(f"{'device ops':<18} {op_ms:9.3f}   (step {step_ms:.3f} ms "
              "wall)")
  return "\n".join(rows)
