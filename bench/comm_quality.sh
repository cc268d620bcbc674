#!/usr/bin/env bash
# DiLoCoX communication arms on experiments/diloco.py (DiLoCo x8, H = 50),
# all from one dense base and one tokenized corpus (issue 11, "Quality"):
#   diloco_x8     plain DiLoCo (float32 contributions, no delay)
#   one_round     DiLoCoX's one-round-late outer step
#   eager         the eager-updates correction of the delay
#   int4_ef       int4 (per-block absmax) + error feedback
#   e3m0          4-bit float, no error feedback
#   lowrank_ef    adaptive low rank (energy 0.9, rank 1-2) + error feedback
#   topk_ef       top 0.8% entries with 2-bit values + error feedback
# (rank 2 and 0.8% are the settings that send >= 100x fewer bytes than
# float32 on this model: ~205 / rank for its 256 x 1024 matrices, and
# 4.25 bytes per kept entry.)
#   one_round_best  one_round + the compressor chosen below
# The combined arm's compressor is chosen WITHOUT validation data: among the
# compressed arms sending at least 100x fewer bytes than float32, the one
# with the lowest mean training loss over its last 10% of steps.
# Each arm's results.json, metrics and log go to WORK_DIR/arms/ and, packed,
# to OUT_DIR/arms.tgz (a device run returns only a few files); the table
# (python bench/comm_table.py WORK_DIR/arms) is OUT_DIR/summary.md.
#
# Usage: [STEPS=3000] [MAX_CHARS=400000000] [LANES=3] [MODEL="flags"] \
#        bash bench/comm_quality.sh OUT_DIR [WORK_DIR]
# LANES arms train at once on the one GPU (small models leave it idle
# between kernels); with GPUS=0,1,2,3 they spread over those GPUs instead
# (bench/comm_arms_lib.sh), e.g. LANES=8 for two arms a GPU. Expected:
# ~25 min on one H100 for the defaults; about 8 min with STEPS=1500
# MAX_CHARS=200000000.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?OUT_DIR}; work=${2:-/tmp/comm_quality}
read -r -a model <<< "${MODEL:-}"
# shellcheck source=bench/comm_arms_lib.sh
source bench/comm_arms_lib.sh
setup_arms comm_quality experiments/diloco.py 400000000 \
  --config.train.num_steps=${STEPS:-3000} "${model[@]}"
declare -A ARMS=(
  [diloco_x8]=""
  [one_round]="--config.diloco.delay=one_round"
  [eager]="--config.diloco.delay=eager"
  [int4_ef]="--config.diloco.compression=int4 --config.diloco.error_feedback=True"
  [e3m0]="--config.diloco.compression=e3m0"
  [lowrank_ef]="--config.diloco.compression=lowrank --config.diloco.error_feedback=True --config.diloco.compression_rank_max=2"
  [topk_ef]="--config.diloco.compression=topk --config.diloco.error_feedback=True --config.diloco.compression_topk_fraction=0.008"
)
on_gpu 0 run diloco_x8
run_lanes one_round int4_ef lowrank_ef eager e3m0 topk_ef
best=$(python3 bench/comm_table.py "$arms" --choose)
echo "=== combined arm: one_round + $best" >> "$log"
share diloco_x8 one_round_best
# shellcheck disable=SC2086
on_gpu 0 run one_round_best --config.diloco.delay=one_round ${ARMS[$best]}
python3 bench/comm_table.py "$arms" > "$out/summary.md"
tar czf "$out/arms.tgz" -C "$arms" .
cat "$out/summary.md"
