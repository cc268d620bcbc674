#!/usr/bin/env bash
# Does one GPU train slower while the machine's other GPUs train too?
# (On 4 x H100, 2026-11-27, an island worker's rounds ran 4.4% slower
# than the SPMD run of the same model on one GPU, with all four GPUs busy
# in the island run and one in the SPMD run.) The same single-GPU training loop
# (bench/scaling.py, random batches, no store, no other process) on GPU 0
# alone, then N copies at once on GPUs 0 .. N-1, one process each.
#   [N=4] [CONFIG=experiments/dense.py] [STEPS=600] bash bench/concurrent_gpus.sh OUT
# Writes OUT/alone.json, OUT/together_G.json and OUT/summary.txt: each
# copy's loop tokens/s against the lone run's.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?OUT}; mkdir -p "$out"
n=${N:-4}; cfg=${CONFIG:-experiments/dense.py}
bench=(python3 bench/scaling.py "--configs=$cfg" --devices=1
       "--steps=${STEPS:-600}" --timeout=200
       --set=train.steps_per_dispatch=10)
CUDA_VISIBLE_DEVICES=0 "${bench[@]}" "--out=$out/alone.json" \
  > "$out/alone.log" 2>&1
for g in $(seq 0 $((n - 1))); do
  CUDA_VISIBLE_DEVICES=$g "${bench[@]}" "--out=$out/together_$g.json" \
    > "$out/together_$g.log" 2>&1 &
done
wait
python3 - "$out" <<'PY' | tee "$out/summary.txt"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
rate = lambda p: json.loads(p.read_text())["results"][0]["loop_tokens_per_s"]
alone = rate(out / "alone.json")
print(f"GPU 0 alone: {alone:,.0f} tokens/s")
for p in sorted(out.glob("together_*.json")):
  r = rate(p)
  print(f"GPU {p.stem.split('_')[1]} with the others busy: {r:,.0f} "
        f"tokens/s ({r / alone:.3f} of alone)")
PY
