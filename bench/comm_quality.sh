#!/usr/bin/env bash
# DiLoCoX communication arms on experiments/diloco.py (DiLoCo x8, H = 50),
# all from one dense base and one tokenized corpus (docs/communication_measured.md):
#   diloco_x8     plain DiLoCo (float32 contributions, no delay)
#   one_round     DiLoCoX's one-round-late outer step, outer lr 1.0
#   eager         the eager-updates correction of the delay, outer lr 0.35
#   int4_ef       int4 (per-block absmax) + error feedback
#   e3m0          4-bit float, no error feedback
#   lowrank_ef    adaptive low rank (energy 0.9, rank 1-2) + error feedback
#   lowrank_int4_ef  low rank 20 with int4 factors (DiLoCoX's low rank +
#                 int4) + error feedback decayed by 0.9 a round (SparseLoCo's
#                 accumulator: bounded, where plain feedback let the float
#                 low rank diverge, 2026-11-27): 118x fewer bytes
#   topk_ef       chunked top-k, 64 of every 4096 entries, 2-bit values +
#                 error feedback (SparseLoCo's layout)
#   overlap_tau5          the outer step 5 of H = 50 inner steps late
#   overlap_tau5_int4_ef  the same with int4 + error feedback
# (rank 2 and 64/4096 are the settings that send >= 100x fewer bytes than
# float32 on this model: ~205 / rank for its 256 x 1024 matrices, 136.5x
# for the top-k; rank 20 in int4 is the lowest residual at >= 100x of
# bench/contribution_fidelity.py on the training run's own contributions,
# docs/communication_measured.md. The outer lrs of one_round and eager are the best
# of its 1500-step sweeps, chosen on our validation split of the
# training corpus; the overlap arms were fixed from the same sweeps.)
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
# (bench/comm_arms_lib.sh), e.g. LANES=10 for all ten at once on 4 GPUs. Expected:
# ~25 min on one H100 for seven arms (11 arms now); about 8 min with
# STEPS=1500 MAX_CHARS=200000000. Longer than a device call allows: run
# the same command again on the same machine (under `timeout`), and it
# goes on where the last call stopped; on a fresh machine, add
# PRIOR=<the last call's OUT/arms.tgz> to keep the arms it finished
# (comm_arms_lib.sh). Both keep only arms of the same code and flags: a
# WORK_DIR of other code is moved aside whole, such a PRIOR ignored.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?OUT_DIR}; work=${2:-/tmp/comm_quality}
read -r -a model <<< "${MODEL:-}"
# shellcheck source=bench/comm_arms_lib.sh
source bench/comm_arms_lib.sh
setup_arms comm_quality experiments/diloco.py 400000000 \
  --config.train.num_steps=${STEPS:-3000} "${model[@]}"
d=--config.diloco
int4="$d.compression=int4 $d.error_feedback=True"
declare -A ARMS=(
  [diloco_x8]=""
  [one_round]="$d.delay=one_round $d.outer_lr=1.0"
  [eager]="$d.delay=eager $d.outer_lr=0.35"
  [int4_ef]="$int4"
  [e3m0]="$d.compression=e3m0"
  [lowrank_ef]="$d.compression=lowrank $d.error_feedback=True $d.compression_rank_max=2"
  [lowrank_int4_ef]="$d.compression=lowrank $d.error_feedback=True $d.compression_rank_max=20 $d.compression_energy=1.0 $d.compression_factor_bits=4 $d.error_feedback_decay=0.9"
  [topk_ef]="$d.compression=topk $d.error_feedback=True $d.compression_topk_fraction=0.015625 $d.compression_topk_chunk=4096 $d.sparse_aggregate=mean"
  [overlap_tau5]="$d.delay=overlap $d.overlap_steps=5"
  [overlap_tau5_int4_ef]="$d.delay=overlap $d.overlap_steps=5 $int4"
)
# The data and the base first (a 1-step run, only if an arm is to train),
# then every arm, DiLoCo x8 among them, from that one base: with LANES=10
# and 4 GPUs, all at once.
base=_stages run_lanes diloco_x8 one_round int4_ef lowrank_ef eager e3m0 \
  topk_ef overlap_tau5 overlap_tau5_int4_ef lowrank_int4_ef
best=$(python3 bench/comm_table.py "$arms" --choose)
echo "=== combined arm: one_round + $best" >> "$log"
share _stages one_round_best
# shellcheck disable=SC2086
on_gpu 0 run one_round_best ${ARMS[one_round]} ${ARMS[$best]}
python3 bench/comm_table.py "$arms" > "$out/summary.md"
tar czf "$out/arms.tgz" -C "$arms" .
cat "$out/summary.md"
