"""The table of bench/comm_quality.sh: perplexity and bytes per arm.

  python bench/comm_table.py OUT_DIR            # markdown table
  python bench/comm_table.py OUT_DIR --choose   # the combined arm's compressor
  python bench/comm_table.py OUT_DIR --baseline=dipaco_2x2  # comm_dipaco.sh
  python bench/comm_table.py OUT_DIR --baseline=m2_none --prefix=m2_

An arm named b<N>_<arm> (bench/comm_arms_lib.sh: <arm> at N sequences per
replica step) is compared with b<N>_<baseline>, its own batch's baseline.

Rows: the arms of bench/comm_quality.sh in its order, then any other
arm found in OUT_DIR (bench/comm_sweep.sh's), by name. `--choose` looks at
training losses only (the mean over the last 10% of logged steps, from
each arm's metrics.jsonl), never at validation: among the compressed arms
without a delay that send at least 100x fewer bytes than float32, the one
with the lowest training loss (else, the fewest bytes). A DiPaCo arm's
results.json scores several models: its row is the paths routed once per
document (the model of record), its bytes those of the `dipaco` run.
"""

import argparse
import json
import re
from pathlib import Path

ARMS = ("diloco_x8", "one_round", "eager", "int4_ef", "e3m0", "lowrank_ef",
        "lowrank_int4_ef", "topk_ef", "overlap_tau5", "overlap_tau5_int4_ef",
        "one_round_best")
# Arms named with a delay: never the combined arm's compressor.
_DELAYS = ("one_round", "eager", "overlap", "lookahead")
# A DiPaCo results.json's model of record (report.py's name for it).
DIPACO_MODEL = "dipaco routed once per document"


def _load(out: Path, name: str) -> dict | None:
  path = out / f"{name}.json"
  return json.loads(path.read_text()) if path.exists() else None


def train_tail_loss(out: Path, name: str) -> float | None:
  """Mean training loss over the last 10% of the arm's logged steps."""
  path = out / f"{name}.metrics.jsonl"
  if not path.exists():
    return None
  rows = [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
  rows = [r for r in rows if "loss" in r]
  if not rows:
    return None
  last = rows[-1]["step"]
  tail = [r["loss"] for r in rows if r["step"] > 0.9 * last]
  return sum(tail) / len(tail)


def arm_figures(out: Path, name: str) -> dict | None:
  result = _load(out, name)
  if result is None:
    return None
  models = result["models"]
  model = (models[DIPACO_MODEL] if DIPACO_MODEL in models
           else next(iter(models.values())) if len(models) == 1 else None)
  if model is None:
    raise SystemExit(f"{name}: which of {sorted(models)} to report?")
  # DiPaCo's pipeline trains the paths, then the dense baseline.
  run = next((r for r in result["runs"] if r["name"] in ("main", "dipaco")),
             result["runs"][-1])
  sent = run.get("bytes_sent")
  f32 = sent["float32_per_worker_round"] if sent else None
  per_round = sent["per_worker_round"] if sent else None
  # What a worker reads back: float32 modules unless downloads are
  # compressed (diloco.download_compression).
  read = sent.get("received_per_worker_round", f32) if sent else None
  return {"perplexity": model["perplexity"], "sent": per_round, "read": read,
          "float32": f32, "train_loss": train_tail_loss(out, name),
          "tokens_per_s": run.get("tokens_per_s")}


def arm_names(out: Path) -> list[str]:
  found = {p.name[:-len(".json")] for p in out.glob("*.json")}
  return ([n for n in ARMS if n in found]
          + sorted(found.difference(ARMS)))


def choose(out: Path) -> str:
  candidates = []
  for name in arm_names(out):
    f = arm_figures(out, name)
    if (f is None or f["sent"] is None or f["sent"] >= f["float32"]
        or any(d in name for d in _DELAYS)):
      continue
    ratio = f["float32"] / f["sent"]
    candidates.append((ratio < 100, f["train_loss"] or float("inf"),
                       f["sent"], name))
  if not candidates:
    raise SystemExit("none: no compressed arm without a delay (an arm named "
                     f"with {', '.join(_DELAYS)} never counts) finished")
  return min(candidates)[3]


def batch_prefix(name: str) -> str:
  """'b128_' of an arm named b128_<arm>, else ''."""
  match = re.match(r"b[0-9]+_", name)
  return match.group(0) if match else ""


def table(out: Path, baseline: str = "diloco_x8", prefix: str = "") -> str:
  rows = [f"| arm | validation perplexity | vs {baseline} | bytes sent per "
          "worker per round | fewer than float32 | bytes read back per "
          "worker per round | sent + read, fewer than float32 | train loss "
          "(last 10%) |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
  names = [n for n in arm_names(out) if n.startswith(prefix)]
  # Each batch's arms together, its baseline's row first.
  for name in sorted(names, key=lambda n: (batch_prefix(n), n != baseline,
                                           n != batch_prefix(n) + baseline)):
    base = arm_figures(out, batch_prefix(name) + baseline)
    f = arm_figures(out, name)
    if f is None:
      continue
    f32 = f["float32"] or (base or {}).get("float32")
    sent = f["sent"] if f["sent"] is not None else f32
    rel = (f"{f['perplexity'] / base['perplexity'] - 1:+.2%}" if base
           else "")
    ratio = f"{f32 / sent:,.1f}x" if f32 and sent else "1x"
    sent_text = f"{sent / 1e6:,.2f} MB" if sent else "float32"
    read = f["read"] if f["read"] is not None else f32
    read_text = f"{read / 1e6:,.2f} MB" if read else "float32"
    both = (f"{2 * f32 / (sent + read):,.1f}x" if f32 and sent and read
            else "1x")
    loss = f"{f['train_loss']:.4f}" if f["train_loss"] else ""
    rows.append(f"| {name} | {f['perplexity']:.3f} | {rel} | {sent_text} | "
                f"{ratio} | {read_text} | {both} | {loss} |")
  return "\n".join(rows)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("out", type=Path)
  parser.add_argument("--choose", action="store_true")
  parser.add_argument("--baseline", default="diloco_x8",
                      help="the arm the others are compared with")
  parser.add_argument("--prefix", default="",
                      help="only the arms whose names start with it")
  args = parser.parse_args()
  print(choose(args.out) if args.choose
        else table(args.out, args.baseline, args.prefix))


if __name__ == "__main__":
  main()
