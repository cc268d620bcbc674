#!/usr/bin/env bash
# The delay rules on a CPU-sized DiLoCo (exploratory): the
# quickstart model (4 layers of d_model 64, 1024 pieces, the embedded
# corpus) as DiLoCo x8, H = 50, 800 steps, outer Nesterov 0.7 / 0.9, all
# arms from one dense base: no delay, one_round, lookahead, lookahead with
# int4 + error feedback. About 25 minutes on a 2-core CPU.
# Usage: bash bench/delay_toy.sh OUT_DIR [WORK_DIR]
# Writes OUT_DIR/summary.md (validation perplexity of the final global
# modules and the mean training loss of the last 10% of logged steps) and
# each arm's results.json.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?OUT_DIR}; work=${2:-/tmp/delay_toy}
mkdir -p "$out" "$work"
common=(--config=experiments/quickstart.py --config.paths.shape=1
        --config.paths.num_replicas=8 --config.diloco.inner_steps=50
        --config.train.num_steps=800 --config.eval.learned_reroute=False)
d=--config.diloco
declare -A ARMS=(
  [none]=""
  [one_round]="$d.delay=one_round"
  [lookahead]="$d.delay=lookahead"
  [lookahead_int4_ef]="$d.delay=lookahead $d.compression=int4 $d.error_feedback=True"
)
run() {  # name, then extra flags
  local name=$1; shift
  echo "=== $name ($(date -u +%H:%M:%S))"
  python3 -m dipaco_jax.main --workdir="$work/$name" "${common[@]}" "$@" \
    > "$out/$name.log" 2>&1 || echo "!!! $name failed"
  cp "$work/$name/results.json" "$out/$name.json" 2>/dev/null
  cp "$work/$name/runs/main/logs/train/metrics.jsonl" \
    "$out/$name.metrics.jsonl" 2>/dev/null
}
run none
for name in one_round lookahead lookahead_int4_ef; do
  for p in data runs/base shards/base; do  # the same data and base
    mkdir -p "$work/$name/$(dirname $p)"
    cp -r "$work/none/$p" "$work/$name/$p" 2>/dev/null
  done
  # shellcheck disable=SC2086
  run "$name" ${ARMS[$name]}
done
python3 - "$out" > "$out/summary.md" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print("| arm | validation perplexity | vs no delay | training loss (last 10%) |")
print("| --- | --- | --- | --- |")
base = None
for name in ("none", "one_round", "lookahead", "lookahead_int4_ef"):
  try:
    result = json.loads((out / f"{name}.json").read_text())
    rows = [json.loads(l) for l in (out / f"{name}.metrics.jsonl").open()]
  except FileNotFoundError:
    print(f"| {name} | no result | | |")
    continue
  ppl = next(m["perplexity"] for name_, m in result["models"].items()
             if name_.startswith("diloco"))
  losses = [r["loss"] for r in rows if "loss" in r]
  tail = losses[-max(1, len(losses) // 10):]
  base = base or ppl
  print(f"| {name} | {ppl:.2f} | {100 * (ppl / base - 1):+.1f}% | "
        f"{sum(tail) / len(tail):.4f} |")
PY
cat "$out/summary.md"
