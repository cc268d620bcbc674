#!/bin/bash
cd "$(dirname "$0")/../../.." && { [ -f .venv/bin/activate ] && . .venv/bin/activate; }
mkdir -p "${OUT:-/tmp/dl}"
for arm in up down; do
  extra=""; [ $arm = down ] && extra="--config.diloco.download_compression=int4"
  start=$(date +%s)
  python -m dipaco_jax.islands --config=experiments/quickstart.py --workdir=${OUT:-/tmp/dl}/$arm --num_workers=2 --fake_devices=8 \
    --config.diloco.compression=int4 --config.diloco.error_feedback=True $extra > ${OUT:-/tmp/dl}/$arm.log 2>&1
  echo "$arm rc=$? $(( $(date +%s) - start )) s" >> ${OUT:-/tmp/dl}/done.txt
done
