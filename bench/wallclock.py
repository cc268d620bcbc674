r"""Analytic wall clock of data parallel vs DiLoCo training over a slow link.

  python bench/wallclock.py --params=1e9 --step_time_s=0.5 \
      --tokens_per_step=65536 --workers=8 --H=100 --bandwidth_gbps=1 \
      --latency_ms=10 --steps=10000 --compressors=none,int8,int4,lowrank:0.02
  python bench/wallclock.py --measured=FILE.json --bandwidth_gbps=1
  python bench/wallclock.py --preset=diloco_x_107b

No measurement happens here: every number is a formula of the inputs, so a
benchmark can put `predict_round_s` next to a measured round time.

Arms (W workers, t = compute time of one inner step of one worker, S inner
steps in all, R = ceil(S / H) rounds, E = exchange time of one round):
  AllReduce every step: synchronous data parallel, a ring all-reduce of the
    gradients after every step, not overlapped with the backward pass:
      step = t + 2 (W-1)/W * grad_bytes / bw + 2 (W-1) * latency,
    grad_bytes = params * 4 (float32, "vanilla AllReduce") or * 2 (bf16).
  DiLoCo, delay=none: round = H t + E; wall = S t + R E.
  DiLoCo, delay=one_round (DiLoCoX) or eager: the exchange of round r runs
    while round r+1 computes, so round = max(H t, E) after the first;
    wall = S t + (R-1) max(0, E - H t) + E (the last exchange is drained).
  DiLoCo, delay=overlap (Streaming DiLoCo, --overlap_steps=tau): the
    exchange has the next round's first tau steps: round = H t + max(0,
    E - tau t); wall = S t + (R-1) max(0, E - tau t) + E (tau = H is
    one_round).

Exchange of one round, payload P = bytes one worker's compressed
pseudo-gradient takes:
  --topology=allreduce: workers talk to each other over links of `bw`.
    Uncompressed float32 payloads are summed on the way: a ring all-reduce,
      E = 2 (W-1)/W * P / bw + 2 (W-1) * latency.
    ASSUMPTION: compressed payloads (int8, int4, e3m0, lowrank, topk) cannot
    be summed in compressed form, so every worker gathers everyone's: a ring
    all-gather, E = (W-1)/W * W * P / bw + (W-1) * latency.
  --topology=store: our island runtime. Every worker uploads P to a shared
    store and downloads the new module version D (float32 params, 4 B/param,
    or P with --store_download=compressed); all W workers share the store's
    link of `bw`: E = (W * P + W * D) / bw + 2 * latency.

Bytes per parameter of the compressors (overridable as NAME:BYTES_PER_PARAM):
  none 4; int8 1 + 4/256 (a float32 scale per 256-block); int4 and e3m0
  0.5 + 4/256; lowrank 4 r (m+n) / (m n) (rank r float32 factors of m x n
  matrices, every parameter assumed to sit in such a matrix); lowrank+int4
  the same factors in int4; topk f (4 + 0.25) (4-byte index, 2-bit value).
"""

import argparse
import dataclasses
import json
import math
import sys

FLOAT32_BYTES = 4.0
BF16_BYTES = 2.0
SCALE_BYTES_PER_BLOCK = 4.0 / 256  # One float32 scale per 256 values.
TOPK_BYTES_PER_ENTRY = 4.0 + 0.25  # int32 index + 2-bit value.
DELAYS = ("none", "one_round", "eager", "overlap")
TOPOLOGIES = ("allreduce", "store")
SUMMABLE_COMPRESSORS = ("none",)
PAPER_SPEEDUP = 357.0  # DiLoCoX abstract (arXiv 2506.21263).


def gbps_to_bytes_per_s(gbps: float) -> float:
  return gbps * 1e9 / 8


# ---------------------------------------------------------------- payloads


def quantized_bytes_per_param(bits: int) -> float:
  return bits / 8 + SCALE_BYTES_PER_BLOCK


def lowrank_bytes_per_param(rank: int, rows: int, cols: int,
                            factor_bytes: float = FLOAT32_BYTES) -> float:
  """An m x n matrix sent as rank-r factors (m x r and r x n)."""
  return (rows + cols) * rank * factor_bytes / (rows * cols)


def topk_bytes_per_param(fraction: float) -> float:
  return fraction * TOPK_BYTES_PER_ENTRY


def default_bytes_per_param(name: str, lowrank_rank: int,
                            matrix_shape: tuple[int, int],
                            topk_fraction: float) -> float:
  """Bytes per parameter of a named compressor (module docstring)."""
  rows, cols = matrix_shape
  table = {
      "none": lambda: FLOAT32_BYTES,
      "int8": lambda: quantized_bytes_per_param(8),
      "int4": lambda: quantized_bytes_per_param(4),
      "e3m0": lambda: quantized_bytes_per_param(4),
      "lowrank": lambda: lowrank_bytes_per_param(lowrank_rank, rows, cols),
      "lowrank+int4": lambda: lowrank_bytes_per_param(
          lowrank_rank, rows, cols, quantized_bytes_per_param(4)),
      "topk": lambda: topk_bytes_per_param(topk_fraction),
  }
  if name not in table:
    raise ValueError(f"unknown compressor {name!r} (known: {sorted(table)};"
                     " or give NAME:BYTES_PER_PARAM)")
  return table[name]()


def parse_compressors(spec: str, **defaults) -> dict[str, float]:
  """'int4,lowrank:0.02' -> {name: bytes per param}; `defaults` go to
  default_bytes_per_param for names without an override."""
  out = {}
  for item in filter(None, (s.strip() for s in spec.split(","))):
    name, _, override = item.partition(":")
    out[name] = (float(override) if override
                 else default_bytes_per_param(name, **defaults))
  return out


# ---------------------------------------------------------------- exchange


def ring_allreduce_s(payload_bytes: float, workers: int,
                     bandwidth_bytes_s: float, latency_s: float) -> float:
  """Reduce-scatter + all-gather: 2 (W-1) hops of P/W bytes each."""
  if workers <= 1:
    return 0.0
  return (2 * (workers - 1) / workers * payload_bytes / bandwidth_bytes_s
          + 2 * (workers - 1) * latency_s)


def ring_allgather_s(payload_bytes: float, workers: int,
                     bandwidth_bytes_s: float, latency_s: float) -> float:
  """Every worker ends with all W payloads of P: W-1 hops of P each."""
  if workers <= 1:
    return 0.0
  return ((workers - 1) / workers * workers * payload_bytes
          / bandwidth_bytes_s + (workers - 1) * latency_s)


def store_exchange_s(upload_bytes: float, download_bytes: float, workers: int,
                     store_bandwidth_bytes_s: float, latency_s: float) -> float:
  """All W uploads and W downloads cross the store's one link."""
  return (workers * (upload_bytes + download_bytes) / store_bandwidth_bytes_s
          + 2 * latency_s)


def is_summable(params: float, bytes_per_round: float) -> bool:
  """Only an uncompressed float32 payload can be summed on the way."""
  return bytes_per_round >= FLOAT32_BYTES * params


def exchange_s(params: float, bytes_per_round: float, workers: int,
               bandwidth_bytes_s: float, latency_s: float, topology: str,
               summable: bool | None = None,
               download_bytes: float | None = None) -> float:
  """Time of one round's exchange (module docstring). `summable` None: only
  a float32-sized payload is; `download_bytes` None: float32 params."""
  if topology == "store":
    if download_bytes is None:
      download_bytes = FLOAT32_BYTES * params
    return store_exchange_s(bytes_per_round, download_bytes, workers,
                            bandwidth_bytes_s, latency_s)
  if topology != "allreduce":
    raise ValueError(f"topology must be one of {TOPOLOGIES}: {topology!r}")
  if summable is None:
    summable = is_summable(params, bytes_per_round)
  collective = ring_allreduce_s if summable else ring_allgather_s
  return collective(bytes_per_round, workers, bandwidth_bytes_s, latency_s)


def hidden_steps(H: int, delay: str, tau: int = 0) -> int:
  """Inner steps of the next round an exchange runs beside."""
  if delay == "none":
    return 0
  if delay in ("one_round", "eager"):
    return H
  if delay == "overlap":
    if not 1 <= tau <= H:
      raise ValueError(f"overlap needs 1 <= tau <= H={H}: tau={tau}")
    return tau
  raise ValueError(f"delay must be one of {DELAYS}: {delay!r}")


def round_s_from_exchange(step_time_s: float, H: int, exchange: float,
                          delay: str, tau: int = 0) -> float:
  """Steady-state round: exchange after compute, or hidden under (part
  of) the next round's."""
  compute = H * step_time_s
  if delay == "none":
    return compute + exchange
  return compute + max(0.0, exchange -
                       hidden_steps(H, delay, tau) * step_time_s)


def predict_round_s(params: float, step_time_s: float, H: int, workers: int,
                    bytes_per_round: float, bandwidth_bytes_s: float,
                    latency_s: float, delay: str, topology: str,
                    summable: bool | None = None,
                    download_bytes: float | None = None,
                    tau: int = 0) -> float:
  """Predicted steady-state wall time of one DiLoCo round (H inner steps
  and one exchange of `bytes_per_round` per worker)."""
  exchange = exchange_s(params, bytes_per_round, workers, bandwidth_bytes_s,
                        latency_s, topology, summable, download_bytes)
  return round_s_from_exchange(step_time_s, H, exchange, delay, tau)


def comm_wait_s(steps: int, step_time_s: float, H: int, exchange: float,
                delay: str, tau: int = 0) -> float:
  """Seconds of the whole run in which compute waits on the network."""
  rounds = math.ceil(steps / H)
  if delay == "none":
    return rounds * exchange
  # The first round's compute has nothing to hide behind it, the last
  # exchange has no next round to hide under.
  hidden = hidden_steps(H, delay, tau) * step_time_s
  return (rounds - 1) * max(0.0, exchange - hidden) + exchange


def allreduce_step_s(params: float, step_time_s: float, workers: int,
                     bandwidth_bytes_s: float, latency_s: float,
                     grad_bytes_per_param: float = FLOAT32_BYTES) -> float:
  """Synchronous data parallel: compute, then a ring all-reduce."""
  return step_time_s + ring_allreduce_s(
      params * grad_bytes_per_param, workers, bandwidth_bytes_s, latency_s)


# ---------------------------------------------------------------- arms


@dataclasses.dataclass(frozen=True)
class Setting:
  params: float
  step_time_s: float
  tokens_per_step: float  # Per worker.
  workers: int
  H: int
  steps: int  # Inner steps in all, per worker.
  bandwidth_bytes_s: float
  latency_s: float
  topology: str = "allreduce"
  grad_bytes_per_param: float = FLOAT32_BYTES
  store_download_compressed: bool = False
  overlap_steps: int = 0  # tau of the overlap arms; 0: none printed.


@dataclasses.dataclass(frozen=True)
class Arm:
  name: str
  bytes_sent: str  # Per worker per round, as printed.
  round_s: float
  wall_s: float
  comm_wait_s: float


def human_bytes(n: float) -> str:
  """Decimal units, as link speeds are quoted (1 GB = 1e9 B)."""
  for unit in ("B", "KB", "MB", "GB"):
    if abs(n) < 1000:
      return f"{n:.3g} {unit}"
    n /= 1000
  return f"{n:.3g} TB"


def human_number(x: float) -> str:
  """Thousands separated, no exponent; 3 significant digits when small."""
  return f"{x:,.1f}" if abs(x) >= 100 else f"{x:.3g}"


def allreduce_arm(s: Setting) -> Arm:
  step = allreduce_step_s(s.params, s.step_time_s, s.workers,
                          s.bandwidth_bytes_s, s.latency_s,
                          s.grad_bytes_per_param)
  sent = 2 * (s.workers - 1) / s.workers * s.params * s.grad_bytes_per_param
  dtype = "fp32" if s.grad_bytes_per_param == FLOAT32_BYTES else "bf16"
  return Arm(f"AllReduce every step ({dtype} grads; round = 1 step)",
             human_bytes(sent), step, s.steps * step,
             s.steps * (step - s.step_time_s))


def diloco_bytes_sent(s: Setting, payload: float, summable: bool) -> str:
  """What one worker puts on (and, for the store, takes off) the wire."""
  if s.topology == "store":
    down = payload if s.store_download_compressed else (
        FLOAT32_BYTES * s.params)
    return f"{human_bytes(payload)} up + {human_bytes(down)} down"
  fraction = (2 * (s.workers - 1) / s.workers if summable
              else s.workers - 1)
  return human_bytes(fraction * payload)


def diloco_arm(s: Setting, compressor: str, payload: float,
               delay: str) -> Arm:
  summable = compressor in SUMMABLE_COMPRESSORS
  download = payload if s.store_download_compressed else None
  exchange = exchange_s(s.params, payload, s.workers, s.bandwidth_bytes_s,
                        s.latency_s, s.topology, summable, download)
  tau = s.overlap_steps
  wait = comm_wait_s(s.steps, s.step_time_s, s.H, exchange, delay, tau)
  label = {"none": "sync", "overlap": f"overlap tau={tau}"}.get(
      delay, "one_round/eager")
  return Arm(f"DiLoCo {label} [{compressor}]",
             diloco_bytes_sent(s, payload, summable),
             round_s_from_exchange(s.step_time_s, s.H, exchange, delay, tau),
             s.steps * s.step_time_s + wait, wait)


def all_arms(s: Setting, payloads: dict[str, float]) -> list[Arm]:
  """The AllReduce baseline, then sync and delayed DiLoCo per compressor."""
  arms = [allreduce_arm(s)]
  delays = ("none", "one_round") + (("overlap",) if s.overlap_steps else ())
  for delay in delays:  # eager times as one_round.
    arms += [diloco_arm(s, name, payload, delay)
             for name, payload in payloads.items()]
  return arms


def format_table(s: Setting, arms: list[Arm]) -> str:
  baseline_wall = arms[0].wall_s
  tokens = s.steps * s.tokens_per_step * s.workers
  lines = ["| arm | bytes sent per worker per round | round time (s) | "
           "total wall (h) | tokens/s | speedup vs AllReduce every step | "
           "share of wall waiting on communication |",
           "|---|---|---|---|---|---|---|"]
  for arm in arms:
    lines.append(
        f"| {arm.name} | {arm.bytes_sent} | {human_number(arm.round_s)} | "
        f"{human_number(arm.wall_s / 3600)} | "
        f"{human_number(tokens / arm.wall_s)} | "
        f"{baseline_wall / arm.wall_s:.3g}x | "
        f"{100 * arm.comm_wait_s / arm.wall_s:.1f}% |")
  return "\n".join(lines)


def model_notes(s: Setting) -> list[str]:
  """The modelling assumptions every table is printed with."""
  notes = [
      f"Setting: params={s.params:.4g}, step_time_s={s.step_time_s:.4g}, "
      f"tokens_per_step={s.tokens_per_step:.4g} per worker, "
      f"workers={s.workers}, H={s.H}, steps={s.steps}, "
      f"bandwidth={s.bandwidth_bytes_s * 8 / 1e9:.4g} Gbps, "
      f"latency={s.latency_s * 1e3:.4g} ms, topology={s.topology}.",
      "AllReduce every step: ring all-reduce of the gradients after every "
      "step, not overlapped with compute: t + 2(W-1)/W*grad_bytes/bw + "
      "2(W-1)*latency.",
      "DiLoCo sync: round = H*t + E. one_round/eager: round = max(H*t, E) "
      "after the first; the last exchange is drained at the end.",
  ]
  if s.overlap_steps:
    notes.append(f"DiLoCo overlap: round = H*t + max(0, E - tau*t), "
                 f"tau={s.overlap_steps} inner steps.")
  if s.topology == "allreduce":
    notes.append(
        "topology=allreduce: float32 payloads (none) by ring all-reduce, "
        "E = 2(W-1)/W*P/bw + 2(W-1)*latency; ASSUMPTION: compressed payloads "
        "cannot be summed compressed, so ring all-gather, "
        "E = (W-1)*P/bw + (W-1)*latency.")
  else:
    down = ("the compressed payload" if s.store_download_compressed
            else "float32 params (4 B/param)")
    notes.append(
        "topology=store: each worker uploads P and downloads the new module "
        f"version ({down}); one store link shared by all W workers: "
        "E = (W*P + W*D)/bw + 2*latency.")
  return notes


# ---------------------------------------------------------------- preset


def diloco_x_107b() -> tuple[Setting, dict[str, float], list[str]]:
  """The DiLoCoX 107B run, with what is assumed rather than published."""
  params = 107e9  # Paper.
  gpus_per_cluster = 80  # ASSUMPTION: 160 A800s (secondary report) / 2.
  peak_flops = 312e12  # A800 dense bf16 (same as A100).
  mfu = 0.35  # ASSUMPTION (pipeline parallel, PP=8, bubbles).
  tokens_per_step = 128 * 4096  # ASSUMPTION: 128 sequences of 4096/cluster.
  step_time_s = 6 * params * tokens_per_step / (
      gpus_per_cluster * peak_flops * mfu)
  rank, hidden = 32, 8192  # ASSUMPTION: hidden 8192 (as Qwen1.5-110B).
  setting = Setting(
      params=params, step_time_s=step_time_s, tokens_per_step=tokens_per_step,
      workers=2, H=125, steps=125 * 100,
      bandwidth_bytes_s=gbps_to_bytes_per_s(1.0), latency_s=0.010)
  payloads = {
      name: bpp * params for name, bpp in parse_compressors(
          "none,int4,lowrank+int4", lowrank_rank=rank,
          matrix_shape=(hidden, hidden), topk_fraction=0.01).items()}
  ratio = payloads["none"] / payloads["lowrank+int4"]
  assumptions = [
      "[paper] 107e9 parameters; 1 Gbps between clusters; A800 GPUs; "
      f"{PAPER_SPEEDUP:.0f}x vs vanilla AllReduce.",
      "[assumption] W = 2 clusters (the paper's Fig. 1 layout), "
      f"{gpus_per_cluster} A800 per cluster (160 in all: secondary report "
      "of 160 GPUs on 20 nodes).",
      f"[spec] A800 peak bf16 {peak_flops / 1e12:.0f} TFLOP/s. "
      f"[assumption] MFU {mfu}.",
      f"[assumption] {tokens_per_step} tokens per step per cluster "
      "(128 x 4096).",
      f"[derived] step time = 6 N T / (GPUs * peak * MFU) = 6 * 107e9 * "
      f"{tokens_per_step} / ({gpus_per_cluster} * 312e12 * {mfu}) = "
      f"{step_time_s:.1f} s.",
      "[secondary report] H = 125; 'low-rank + int4' at ~1000x. "
      f"[assumption] rank {rank} factors of {hidden}x{hidden} matrices in "
      f"int4 (+ a 4-byte scale per 256) = "
      f"{payloads['lowrank+int4'] / params:.4g} B/param = {ratio:.0f}x "
      "smaller than float32.",
      "[assumption] latency 10 ms; 12,500 inner steps (100 rounds); "
      "AllReduce baseline: ring, float32 grads, no compute overlap.",
  ]
  return setting, payloads, assumptions


def paper_comparison(s: Setting, arms: list[Arm]) -> list[str]:
  """Our speedup of DiLoCoX next to the paper's, and what drives the gap."""
  dilocox = next(a for a in arms
                 if a.name == "DiLoCo one_round/eager [lowrank+int4]")
  ours = arms[0].wall_s / dilocox.wall_s
  allreduce_comm = arms[0].round_s - s.step_time_s
  implied_step = allreduce_comm / (PAPER_SPEEDUP - 1)
  return [
      f"Modelled speedup of DiLoCoX (one_round, lowrank+int4) vs AllReduce: "
      f"{ours:.0f}x; paper: {PAPER_SPEEDUP:.0f}x.",
      "Why they differ: with the exchange hidden, speedup ~= 1 + A / t, "
      f"A = {allreduce_comm:.0f} s of float32 ring all-reduce per step at "
      f"1 Gbps, t = {s.step_time_s:.1f} s of compute per step. It is set by "
      "the assumed compute per step (tokens per step, MFU, GPUs) and by the "
      f"AllReduce model: {PAPER_SPEEDUP:.0f}x needs t ~= {implied_step:.1f} s "
      f"(~{s.tokens_per_step * implied_step / s.step_time_s:.3g} tokens per "
      "step at this MFU), or a baseline "
      f"{PAPER_SPEEDUP / ours:.2g}x slower than a bandwidth-optimal ring "
      "(e.g. a naive or unpipelined AllReduce, per-GPU shares of the link).",
  ]


# ---------------------------------------------------------------- CLI


def setting_from_measured(path: str, args) -> tuple[Setting, dict[str, float]]:
  with open(path) as f:
    m = json.load(f)
  setting = Setting(
      params=float(m["params"]), step_time_s=float(m["step_time_s"]),
      tokens_per_step=float(m["tokens_per_step"]),
      workers=int(m["workers"]), H=int(m["H"]), steps=args.steps,
      **link_fields(args))
  return setting, {k: float(v) for k, v in m["bytes_per_round"].items()}


def link_fields(args) -> dict:
  return dict(bandwidth_bytes_s=gbps_to_bytes_per_s(args.bandwidth_gbps),
              latency_s=args.latency_ms / 1e3, topology=args.topology,
              grad_bytes_per_param=(FLOAT32_BYTES if args.grad_dtype ==
                                    "float32" else BF16_BYTES),
              store_download_compressed=args.store_download == "compressed",
              overlap_steps=args.overlap_steps)


def setting_from_flags(args, parser) -> tuple[Setting, dict[str, float]]:
  required = ("params", "step_time_s", "tokens_per_step", "workers", "H")
  missing = [f"--{k}" for k in required if getattr(args, k) is None]
  if missing:
    parser.error(f"{', '.join(missing)} required (or --measured / --preset)")
  setting = Setting(
      params=args.params, step_time_s=args.step_time_s,
      tokens_per_step=args.tokens_per_step, workers=args.workers, H=args.H,
      steps=args.steps, **link_fields(args))
  per_param = parse_compressors(
      args.compressors, lowrank_rank=args.lowrank_rank,
      matrix_shape=tuple(int(d) for d in args.matrix_shape.split("x")),
      topk_fraction=args.topk_fraction)
  return setting, {k: v * args.params for k, v in per_param.items()}


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--preset", choices=("diloco_x_107b",),
                 help="a fixed setting: every other flag is ignored")
  p.add_argument("--measured", help="JSON: params, step_time_s, "
                 "tokens_per_step, workers, H, bytes_per_round{name: bytes}; "
                 "it replaces those flags and --compressors")
  p.add_argument("--params", type=float)
  p.add_argument("--step_time_s", type=float, help="one inner step, 1 worker")
  p.add_argument("--tokens_per_step", type=float, help="per worker")
  p.add_argument("--workers", type=int)
  p.add_argument("--H", type=int, help="inner steps per round")
  p.add_argument("--steps", type=int, default=10_000, help="inner steps")
  p.add_argument("--bandwidth_gbps", type=float, default=1.0)
  p.add_argument("--latency_ms", type=float, default=10.0)
  p.add_argument("--topology", choices=TOPOLOGIES, default="allreduce")
  p.add_argument("--grad_dtype", choices=("float32", "bfloat16"),
                 default="float32", help="AllReduce-every-step gradients")
  p.add_argument("--store_download", choices=("float32", "compressed"),
                 default="float32",
                 help="what workers read back: float32 module versions, or "
                 "as many bytes as they send (config.diloco."
                 "download_compression with the same codec; SPMD runtime "
                 "only so far)")
  p.add_argument("--compressors", default="none,int8,int4,lowrank,topk",
                 help="comma list; NAME:BYTES_PER_PARAM overrides")
  p.add_argument("--lowrank_rank", type=int, default=32)
  p.add_argument("--matrix_shape", default="4096x4096", help="for lowrank")
  p.add_argument("--topk_fraction", type=float, default=0.01)
  p.add_argument("--overlap_steps", type=int, default=0,
                 help="tau: also print delay=overlap arms (1 <= tau <= H)")
  return p


def main(argv=None) -> None:
  parser = build_parser()
  args = parser.parse_args(argv)
  assumptions = []
  if args.preset:
    setting, payloads, assumptions = diloco_x_107b()
  elif args.measured:
    setting, payloads = setting_from_measured(args.measured, args)
  else:
    setting, payloads = setting_from_flags(args, parser)
  arms = all_arms(setting, payloads)
  print(format_table(setting, arms))
  print()
  for line in model_notes(setting) + assumptions:
    print(f"- {line}")
  if args.preset:
    for line in paper_comparison(setting, arms):
      print(f"- {line}")


if __name__ == "__main__":
  main(sys.argv[1:])
