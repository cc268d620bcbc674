#!/usr/bin/env bash
# DiLoCoX on DiPaCo: DiPaCo 2x2 (experiments/dipaco_2x2.py, H = 50)
# with DiLoCoX's delay and compression against plain DiPaCo 2x2, all arms
# from one tokenized corpus, one base, one router and one set of shards:
#   dipaco_2x2              plain (outer Nesterov 0.7 / 0.9, float32)
#   int4_ef                 int4 + error feedback (7.8x fewer bytes)
#   one_round_lr1           one round late, outer lr 1.0 (momentum 0.9)
#   one_round_lr1_int4_ef   the combined arm: the two above together
# The overlap delay (2026-11-27; NAMES="overlap_tau5 overlap_tau5_int4_ef",
# fixed from the DiLoCo x8 table, where tau = 5 cost 1.3%):
#   overlap_tau5            delay=overlap, the outer step 5 of H = 50
#                           inner steps late (outer Nesterov 0.7 / 0.9)
#   overlap_tau5_int4_ef    the same with int4 + error feedback
# Compressed downloads (2026-11-28; NAMES="int4_ef_down_int4"):
#   int4_ef_down_int4       int4 + error feedback, and what the workers
#                           read back as int4 too (download_compression)
# Top-k on DiPaCo (built 2026-12-01 after the CPU toy's
# dipaco_density_toy.md, run the same day on one H200 with STEPS=1500
# EXTRA="--config.diloco.inner_steps=15", the papers' short rounds, and
# NAMES="avg_lr14 topk2x_lr14 combined_topk2x_lr14"; settings from the
# toy, where the combined arm cost +2.4% against plain DiPaCo 2x2; on the
# GPU it was 24% better, docs/communication_dipaco.md):
#   avg_lr14                float32, outer SGD lr 1.4 without momentum
#   topk2x_lr14             top-k 128/4096 up (2 bits, error feedback
#                           decayed by 0.95, senders) at that outer lr
#   combined_topk2x_lr14    the same with top-k down at 0.125 (4x the
#                           upload's share: the shared module's 4 users)
#                           and delay=overlap at tau = 2 (H / 10 of 15,
#                           rounded up)
# The settings are the best of the DiLoCo x8 table (docs/communication_measured.md),
# fixed before any DiPaCo run, not chosen on DiPaCo's validation.
# Usage: [STEPS=500] [MAX_CHARS=150000000] [LANES=3] [GPUS=0,1,2,3] \
#        [NAMES="arm ..."] [EXTRA="more main.py flags"] \
#        bash bench/comm_dipaco.sh OUT_DIR [WORK_DIR]
# The baseline runs first (it makes the shared stages); the other arms then
# run LANES at once, on the GPUs of GPUS. Writes OUT_DIR/summary.md
# (python bench/comm_table.py ARMS --baseline=dipaco_2x2) and
# OUT_DIR/arms.tgz (each arm's results.json, metrics.jsonl, log).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?OUT_DIR}; work=${2:-/tmp/comm_dipaco}
# shellcheck source=bench/comm_arms_lib.sh
source bench/comm_arms_lib.sh
read -r -a extra <<< "${EXTRA:-}"
setup_arms comm_dipaco experiments/dipaco_2x2.py 150000000 \
  ${STEPS:+--config.train.num_steps=$STEPS} "${extra[@]}"
d=--config.diloco
int4="$d.compression=int4 $d.error_feedback=True"
lr14="$d.outer_optimizer=sgd $d.outer_lr=1.4 $d.outer_momentum=0"
topk2x="$d.compression=topk $d.compression_topk_chunk=4096
        $d.compression_topk_fraction=0.03125 $d.error_feedback=True
        $d.error_feedback_decay=0.95 $d.sparse_aggregate=senders"
declare -A ARMS=(
  [int4_ef]="$int4"
  [overlap_tau5]="$d.delay=overlap $d.overlap_steps=5"
  [overlap_tau5_int4_ef]="$d.delay=overlap $d.overlap_steps=5 $int4"
  [one_round_lr1]="$d.delay=one_round $d.outer_lr=1.0"
  [one_round_lr1_int4_ef]="$d.delay=one_round $d.outer_lr=1.0 $int4"
  [int4_ef_down_int4]="$int4 $d.download_compression=int4"
  [avg_lr14]="$lr14"
  [topk2x_lr14]="$topk2x $lr14"
  [combined_topk2x_lr14]="$topk2x $lr14 $d.delay=overlap $d.overlap_steps=2 $d.download_compression=topk $d.download_topk_fraction=0.125"
)
# What a DiPaCo arm shares with the baseline: every stage before training,
# and the dense baseline, which no DiLoCoX setting changes.
share() {
  for p in data runs/base runs/dense router shards splits.json; do
    [[ -e "$work/$1/$p" ]] || continue
    mkdir -p "$work/$2/$(dirname $p)"; cp -r "$work/$1/$p" "$work/$2/$p"
  done
}
on_gpu 0 run dipaco_2x2
# shellcheck disable=SC2086
base=dipaco_2x2 run_lanes ${NAMES:-int4_ef one_round_lr1 one_round_lr1_int4_ef}
python3 bench/comm_table.py "$arms" --baseline=dipaco_2x2 > "$out/summary.md"
tar czf "$out/arms.tgz" -C "$arms" .
cat "$out/summary.md"
