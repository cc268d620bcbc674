#!/usr/bin/env bash
# What a path's two layer slots cost on one GPU, and whether
# `train.merge_layer_slots` takes it back (issues 12 and 15).
#   [GPUS=0,1,2,3] [STEPS=2000] [SETS="--set=..."] bash bench/layout_cost.sh OUT
# (SETS: more --set flags for every arm, e.g. a tiny model to try it on CPU.)
# Each GPU runs bench/scaling.py's one-GPU training loop (random batches,
# 10 steps a dispatch) for every arm below, one after another, in an order
# rotated by the GPU's index, so each arm runs once per GPU and no arm
# always runs first (busy neighbours cost nothing: docs/performance.md):
#   slot1        dense.py as one slot of 8 layers (paths.shape=1)
#   slot2        dense.py as two slots of 4 (paths.shape=1x1, a 2x2 path)
#   slot2_merge  the same with train.merge_layer_slots=True
#   dipaco       experiments/dipaco_2x2.py (4 paths vmapped)
#   dipaco_merge the same with train.merge_layer_slots=True
# Then bench/hlo_kernels.py counts the compiled step's kernels of slot1 and
# slot2 on the first GPU. Writes OUT/<arm>_gpu<G>.json, OUT/kernels.md and
# OUT/summary.md (each arm's loop and bare-step tokens/s over the GPUs:
# median, min, max; and each arm against slot2 or dipaco).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?OUT}; mkdir -p "$out"
IFS=, read -r -a gpus <<< "${GPUS:-0,1,2,3}"
declare -A sets=(
  [slot1]="experiments/dense.py --set=paths.shape=1"
  [slot2]="experiments/dense.py --set=paths.shape=1x1"
  [slot2_merge]="experiments/dense.py --set=paths.shape=1x1 --set=train.merge_layer_slots=True"
  [dipaco]="experiments/dipaco_2x2.py"
  [dipaco_merge]="experiments/dipaco_2x2.py --set=train.merge_layer_slots=True"
)
order=(slot1 slot2 slot2_merge dipaco dipaco_merge)
run_gpu() {  # GPU index i: every arm, the order rotated by i
  local i=$1 g=${gpus[$1]} n=${#order[@]}
  for j in $(seq 0 $((n - 1))); do
    local arm=${order[$(((i + j) % n))]}
    read -r cfg more <<< "${sets[$arm]}"
    CUDA_VISIBLE_DEVICES=$g python3 bench/scaling.py "--configs=$cfg" \
      --devices=1 "--steps=${STEPS:-2000}" --timeout=300 \
      --set=train.steps_per_dispatch=10 $more ${SETS:-} \
      "--out=$out/${arm}_gpu$g.json" >> "$out/gpu$g.log" 2>&1
  done
}
for i in "${!gpus[@]}"; do run_gpu "$i" & done
wait
CUDA_VISIBLE_DEVICES=${gpus[0]} python3 bench/hlo_kernels.py \
  --config=experiments/dense.py ${SETS:-} --set=paths.shape=1 \
  --set=paths.shape=1x1 \
  > "$out/kernels.md" 2>> "$out/gpu${gpus[0]}.log"
python3 - "$out" <<'PY' | tee "$out/summary.md"
import json, pathlib, statistics, sys
out = pathlib.Path(sys.argv[1])
rows = {}
for p in sorted(out.glob("*_gpu*.json")):
  arm = p.stem.rsplit("_gpu", 1)[0]
  r = json.loads(p.read_text())["results"][0]
  if "error" not in r:
    rows.setdefault(arm, []).append(r)
def med(arm, key):
  return statistics.median(r[key] for r in rows[arm])
ref = {"slot1": "slot2", "slot2": "slot2", "slot2_merge": "slot2",
       "dipaco": "dipaco", "dipaco_merge": "dipaco"}
print("| arm | runs | loop tokens/s (median) | min - max | vs "
      "reference | bare step tokens/s (median) | vs reference |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for arm in ref:
  if arm not in rows:
    print(f"| {arm} | 0 | failed | | | | |"); continue
  loop = [r["loop_tokens_per_s"] for r in rows[arm]]
  base = ref[arm] if ref[arm] in rows else arm
  print(f"| {arm} | {len(loop)} | {med(arm, 'loop_tokens_per_s'):,.0f} | "
        f"{min(loop):,.0f} - {max(loop):,.0f} | "
        f"{med(arm, 'loop_tokens_per_s') / med(base, 'loop_tokens_per_s'):.3f}"
        f" x {base} | {med(arm, 'bare_step_tokens_per_s'):,.0f} | "
        f"{med(arm, 'bare_step_tokens_per_s') / med(base, 'bare_step_tokens_per_s'):.3f} |")
PY
cat "$out/kernels.md"
