#!/usr/bin/env bash
# CPU-scale closed-loop check of the >=100x codecs (session 16, exploratory).
set -uo pipefail
cd /work/main
out=/tmp/cpuq/out; work=/tmp/cpuq/work
source bench/comm_arms_lib.sh
setup_arms cpu_quality experiments/diloco.py 20000000 \
  --config.train.num_steps=600 --config.paths.num_replicas=2 \
  --config.train.batch_size=2 --config.data.seq_len=256 \
  --config.base.num_steps=100 --config.base.batch_size=4 \
  --config.eval.learned_reroute=False --config.ckpt.every=0
d=--config.diloco
declare -A ARMS=(
  [diloco_x8]=""
  [lowrank_int4_ef]="$d.compression=lowrank $d.error_feedback=True $d.compression_rank_max=20 $d.compression_energy=1.0 $d.compression_factor_bits=4 $d.error_feedback_decay=0.9"
  [topk_ef]="$d.compression=topk $d.error_feedback=True $d.compression_topk_fraction=0.015625 $d.compression_topk_chunk=4096"
  [lowrank_ef]="$d.compression=lowrank $d.error_feedback=True $d.compression_rank_max=2"
)
run diloco_x8
LANES=1; lanes=1
run_lanes lowrank_int4_ef topk_ef lowrank_ef
python3 bench/comm_table.py "$arms" > "$out/summary.md"
cat "$out/summary.md"
