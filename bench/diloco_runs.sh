#!/usr/bin/env bash
# DiLoCo x8 (H = 50) vs one replica vs synchronous training with the 8x
# batch: the three arms of experiments/diloco.py, all from the same dense
# base, the same steps (docs/quality.md, "DiLoCo vs synchronous").
# Usage: [BATCH=32] [STEPS=3000] [MODEL="--config.model.d_model=..."] \
#        [MAX_CHARS=400000000] bash bench/diloco_runs.sh OUT_DIR [WORK_DIR]
# BATCH is the per-replica batch (sequences); the synchronous run takes 8x.
# MODEL holds extra main.py flags given to every run (model size, base).
# DATA_FROM: an earlier WORK_DIR of the same corpus flags whose tokenized data
# this one reuses (the data stage is keyed by the data config alone).
set -uo pipefail
out=${1:?OUT_DIR}; work=${2:-/tmp/diloco_quality}
batch=${BATCH:-32}; steps=${STEPS:-3000}
read -r -a model <<< "${MODEL:-}"
mkdir -p "$out" "$work"
if [[ -n "${DATA_FROM:-}" ]]; then
  mkdir -p "$work/diloco_x8"; cp -r "$DATA_FROM/diloco_x8/data" "$work/diloco_x8/"
fi
log="$out/diloco_runs.log"
sp=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
common=(--config.data.corpus=text_files "--config.data.text_glob=$sp/**/*.py"
        --config.data.max_corpus_chars=${MAX_CHARS:-400000000}
        --config.train.num_steps=$steps --config.base.batch_size=$batch
        "${model[@]}")
run() {  # name, then main.py arguments
  local name=$1; shift
  echo "=== $name: $* ($(date -u +%H:%M:%S))" | tee -a "$log"
  python3 -m dipaco_jax.main --workdir="$work/$name" "$@" "${common[@]}" \
    2>&1 | grep -v '^[WI][0-9]\{4\} ' >> "$log"
  cp "$work/$name/results.json" "$out/$name.json" 2>/dev/null \
    || echo "!!! $name wrote no results" | tee -a "$log"
}
share() {  # reuse the data and the dense base of run $1 in run $2
  for d in data runs/base shards/base; do
    mkdir -p "$work/$2/$(dirname $d)"; cp -r "$work/$1/$d" "$work/$2/$d"
  done
}
run diloco_x8 --config=experiments/diloco.py --config.train.batch_size=$batch
share diloco_x8 one_replica
run one_replica --config=experiments/diloco.py:one_replica \
  --config.train.batch_size=$batch
share diloco_x8 sync_8x_batch
run sync_8x_batch --config=experiments/diloco.py:sync_8x_batch \
  --config.train.batch_size=$((8 * batch))
echo "=== done ($(date -u +%H:%M:%S))" | tee -a "$log"
