#!/usr/bin/env bash
# The quality evidence of BUILD_NOTES.md, in one go on one GPU:
#   DiLoCo x8 vs dense (1 replica) vs dense with an 8x batch (synchronous),
#   DiPaCo 2x2 and 4x4 vs the dense baseline (routed once / re-routed).
# Usage: bash bench/quality_runs.sh OUT_DIR [WORK_DIR]
# Writes OUT_DIR/<run>.json (each run's results.json) and OUT_DIR/runs.log.
set -uo pipefail
out=${1:?OUT_DIR}; work=${2:-/tmp/dipaco_quality}
mkdir -p "$out" "$work"
log="$out/runs.log"
run() {  # name, then main.py arguments
  local name=$1; shift
  echo "=== $name: $* ($(date -u +%H:%M:%S))" | tee -a "$log"
  python3 -m dipaco_jax.main --workdir="$work/$name" "$@" 2>&1 \
    | grep -v '^[WI][0-9]\{4\} ' >> "$log"
  cp "$work/$name/results.json" "$out/$name.json" 2>/dev/null \
    || echo "!!! $name wrote no results" | tee -a "$log"
}
share_data() {  # reuse the tokenized corpus of run $1 in run $2
  mkdir -p "$work/$2"; cp -r "$work/$1/data" "$work/$2/" 2>/dev/null
}
# The GPU image's standard library is small (about 2.4M tokens), too small
# for 8 replicas or 16 paths without many epochs: train on the image's
# site-packages Python source instead (capped, deterministic).
sp=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
corpus=(--config.data.corpus=text_files "--config.data.text_glob=$sp/**/*.py"
        --config.data.max_corpus_chars=${MAX_CHARS:-80000000})
run diloco --config=experiments/diloco.py "${corpus[@]}"
share_data diloco dense; run dense --config=experiments/dense.py "${corpus[@]}"
share_data diloco dense_8x_batch
run dense_8x_batch --config=experiments/dense.py "${corpus[@]}" \
  --config.train.batch_size=64
share_data diloco dipaco_2x2; run dipaco_2x2 --config=experiments/dipaco_2x2.py "${corpus[@]}"
# 4x4 forks from the same base and compares with the same dense baseline.
share_data diloco dipaco_4x4
for d in runs/base runs/dense shards/base shards/dense; do
  mkdir -p "$work/dipaco_4x4/$(dirname $d)"
  cp -r "$work/dipaco_2x2/$d" "$work/dipaco_4x4/$d" 2>/dev/null
done
run dipaco_4x4 --config=experiments/dipaco_4x4.py "${corpus[@]}"
cp "$work/dipaco_4x4/plots/"*.png "$out/" 2>/dev/null
echo "=== done ($(date -u +%H:%M:%S))" | tee -a "$log"
