#!/usr/bin/env bash
# One island worker of the paper's 16x16 on the current GPU: its inner step
# (the SPMD program, vmapped over a task's K paths) at the real path size
# (12 layers, d_model 896, 16 heads of 64, gated MLP 2432, tied 32k
# vocabulary, remat dots, sequences of 1024, the paper's 512 a path),
# for K = 1, 4 and 16, with the loss whole (the config) and in chunks of
# 128 (model.loss_chunk). Each arm is its own process (a clean peak):
# the compiled program's memory first, then the step time where it runs.
#
#   [BATCH=512] [ARMS="K:CHUNK:TIMED ..."] bash bench/paper_worker_gpu.sh OUT_DIR
#
# BATCH: rows of 1024 tokens a path (the paper's 512 by default). ARMS:
# each K paths, loss chunk (0: whole), 1 to time it or 0 to only compile.
# OUT_DIR gets one JSON line per arm in arms.jsonl and each arm's log.
# An arm whose program cannot fit is recorded with its memory and error.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bash bench/paper_worker_gpu.sh OUT_DIR}
mkdir -p "$out"
. bench/carried_wheels.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # dipaco_jax, not installed there
shape=(--layers=12 --d_model=896 --heads=16 --head_dim=64 --mlp=2432
       --vocab=32000 --tie=1 --seq=1024 --remat=dots --batch="${BATCH:-512}"
       --no_plain --steps=4 --warmup=1)
read -r -a arms <<< "${ARMS:-1:0:1 1:128:1 4:128:1 4:0:0 16:128:0 16:0:0}"
for arm in "${arms[@]}"; do
  IFS=: read -r k chunk timed <<< "$arm"
  name="k${k}_chunk${chunk}_b${BATCH:-512}"
  extra=()
  [[ "$timed" == 0 ]] && extra=(--memory_only)
  python3 bench/step_throughput.py "${shape[@]}" --paths="$k" \
    --loss_chunk="$chunk" "${extra[@]}" --out="$out/$name.json" \
    > "$out/$name.log" 2>&1
  code=$?
  compiled=$(grep -m1 '^{"compiled"' "$out/$name.log" || echo '{}')
  error=$(grep -m1 -E 'RESOURCE_EXHAUSTED|Out of memory|Error' \
    "$out/$name.log" | cut -c1-300 | python3 -c \
    'import json,sys; print(json.dumps(sys.stdin.read().strip()))')
  result=$( [[ -f "$out/$name.json" ]] && python3 -c \
    'import json,sys; r=json.load(open(sys.argv[1]))["results"][0]; print(json.dumps(r))' \
    "$out/$name.json" || echo null)
  echo "{\"arm\": \"$name\", \"exit\": $code, \"compiled\": $compiled," \
    "\"result\": $result, \"error\": $error}" | tee -a "$out/arms.jsonl"
done
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader \
  > "$out/gpu.txt" 2>&1
