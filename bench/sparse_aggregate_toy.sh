#!/usr/bin/env bash
# SparseLoCo's aggregation on a CPU toy: DiLoCo x8 of the quickstart model
# on the embedded corpus, H = 10 (30 rounds), outer averaging; float32
# contributions against chunked top-k 64/4096 with 2-bit values and error
# feedback (decay 0.95), averaged over every worker (mean) or over the
# workers that sent each coordinate (senders). The data and the dense base
# are made once, by the first arm, and copied into the others' workdirs (a
# workdir refuses a run of other settings).
# Top-k downloads (2026-12-01, after the GPU's +53.68% at 8.4M; densities
# fixed before the run: the upload's, 4x and 8x it, 8 workers' top-k
# covering up to 8x one worker's entries; and int4 for comparison), each
# senders arm reading back each module's change compressed:
#   NAMES="topk_senders down_topk down_topk4x down_topk8x down_int4"
#   bash bench/sparse_aggregate_toy.sh OUT
#   bash bench/sparse_aggregate_toy.sh OUT     (the three arms of 2026-11-29)
# DiPaCo 2x2 instead of DiLoCo x8 (SHAPE=2x2; its first arm, float32 with
# the same outer averaging, is dipaco_2x2), 2026-12-01: the combined arm
# (combined_topk4x: senders up, overlap at tau = 1 of H = 10, top-k down at
# 4x the upload's share, as the shared module has 4 users) and plain
# DiPaCo with its default outer Nesterov 0.7 / 0.9 (plain_nesterov):
#   SHAPE=2x2 NAMES="plain_nesterov combined_topk4x" bash bench/sparse_aggregate_toy.sh OUT
# Then (2026-12-01, fixed before each run, after top-k up alone cost
# DiPaCo +15.4% there): the upload at 2x the share (128/4096, the top of
# SparseLoCo's 1.5-3%), and top-k under DiPaCo's outer Nesterov 0.7 / 0.9
# instead of averaging: with the decayed feedback (senders_nesterov, at
# 64/4096), without it (topk2x_nesterov_noef) and at half the outer lr
# (topk2x_nesterov_lr035); combined_topk2x is combined_topk4x's arm with
# the upload at 2x and the download at 4x that (0.125):
#   SHAPE=2x2 NAMES="topk2x_senders senders_nesterov" bash bench/sparse_aggregate_toy.sh OUT
#   SHAPE=2x2 NAMES="combined_topk2x" bash bench/sparse_aggregate_toy.sh OUT
#   SHAPE=2x2 NAMES="topk2x_nesterov_noef topk2x_nesterov_lr035" bash bench/sparse_aggregate_toy.sh OUT
# Outer averaging at a larger outer lr (SGD lr 1.4, no momentum: a step
# past the mean), float32 and top-k 2x, as averaging lost 7% to Nesterov:
#   SHAPE=2x2 NAMES="avg_lr14 topk2x_senders_lr14" bash bench/sparse_aggregate_toy.sh OUT
# and the combined arm at that lr (combined_topk2x_lr14, fixed after the
# two above, before its run):
#   SHAPE=2x2 NAMES="combined_topk2x_lr14" bash bench/sparse_aggregate_toy.sh OUT
# and whether that lr helps DiLoCo x8 too (the default shape; topk_senders
# at outer lr 1.4, and float32 at it):
#   NAMES="avg_lr14 topk_senders_lr14" bash bench/sparse_aggregate_toy.sh OUT
# DiLoCo x8's own outer Nesterov 0.7 / 0.9 (float32), after DiPaCo 2x2 on a
# GPU lost 23% with it at H = 15 (2026-12-01):
#   NAMES="plain_nesterov avg_lr14" bash bench/sparse_aggregate_toy.sh OUT
# The eager paper's rows at M = 2 (REPLICAS=2: DiLoCo x2; its first arm
# is then diloco_x2), each delay at outer Nesterov 0.7 / 0.9 as in
# bench/delay_table.sh, and eager at half that lr (2026-12-01):
#   REPLICAS=2 NAMES="plain_nesterov eager_nesterov eager_nesterov_lr035
#   naive_nesterov" bash bench/sparse_aggregate_toy.sh OUT
# The strided codec both ways after it cost +207% on the 8.4M GPU model
# (2026-12-01): with error feedback at decay 1 and without any (a worker's
# progress on the entries of other phases is then dropped each round), to
# see whether the feedback's repeats of the same stale progress are the
# cost; top-k over its senders beside them:
#   NAMES="topk_senders strided8_both strided8_both_noef" bash bench/sparse_aggregate_toy.sh OUT
# leader_topk (ScaleCom's cyclic local top-k: a module's users send on one
# support a round, their leader's, so a download at the upload's share can
# carry the change); built after strided failed, arms fixed before the
# run (2026-12-01): the toy's top-k up with the mean (its users' supports
# agree) and float32 down (leader_topk), the same read back as top-k at
# the upload's share (leader_topk_both), and both ways at 2x the share,
# 128/4096 (leader_topk2x_both):
#   NAMES="topk_senders leader_topk leader_topk_both leader_topk2x_both" bash bench/sparse_aggregate_toy.sh OUT
# then, after those lost 32% to 55% here and more on the GPU, the same
# both ways at 8x the share (512/4096, as many entries a round as the 8
# workers' top-k together): whether the count of entries a round or the
# one worker's choice of them is the cost:
#   NAMES="leader_topk8x_both" bash bench/sparse_aggregate_toy.sh OUT
# One round late against eager at M = 2, each at both outer lrs, and both
# at outer momentum 0.8 (2026-12-03, fixed before the run, after eager at
# 42M, H = 30 had no better outer lr than 0.35-0.45: whether our
# one_round, which keeps a worker's whole round, does better than eager
# at the lr that suits eager, and whether less momentum, which carries
# each round's stale share on, narrows eager's gap):
#   REPLICAS=2 NAMES="plain_nesterov plain_nesterov_lr035 eager_nesterov_lr035
#   one_round_nesterov one_round_nesterov_lr035 plain_nesterov_lr035_m08
#   eager_nesterov_lr035_m08" bash bench/sparse_aggregate_toy.sh OUT
# then, after momentum 0.8 took more than half off eager's gap there (and
# made no delay better too), momentum 0.8 at the default lr 0.7 and 0.6 at
# lr 0.35, for both:
#   REPLICAS=2 NAMES="plain_nesterov_m08 eager_nesterov_m08
#   plain_nesterov_lr035_m06 eager_nesterov_lr035_m06" bash bench/sparse_aggregate_toy.sh OUT
# then around the best of each (no delay 0.7 / 0.8, eager 0.35 / 0.8):
#   REPLICAS=2 NAMES="plain_nesterov_m07 plain_nesterov_lr1_m08
#   eager_nesterov_lr05_m08 eager_nesterov_lr035_m07" bash bench/sparse_aggregate_toy.sh OUT
# and whether DiLoCo x8, the baseline of the compression tables, also
# gains from momentum 0.8 (the default shape, 8 replicas):
#   NAMES="plain_nesterov plain_nesterov_m08" bash bench/sparse_aggregate_toy.sh OUT
# and whether top-k over its senders, with its decayed error feedback,
# trains under outer Nesterov at a lower momentum (at 0.9 it did not: the
# feedback's release through the momentum), which would let SparseLoCo's
# recipe take the outer step that beats averaging by 28% here:
#   NAMES="topk_senders_nesterov_m06 topk_senders_nesterov_lr1_m05
#   topk_senders_nesterov_lr035_m08" bash bench/sparse_aggregate_toy.sh OUT
# The shared low rank's outer step (2026-12-04, fixed before the run): it
# was only ever run under outer averaging (SGD lr 1), where its training
# loss trails from the first rounds (underfitting, as top-k's `mean` did
# before `senders`). Whether a larger outer lr or DiLoCo's Nesterov lets
# it take a longer step: rank 3 (planned as about 100x fewer bytes up on
# this model; the runs measured 175.3x),
# int4 factors, error feedback, at SGD lr 1, 2 and 4, and Nesterov 0.7 at
# momentum 0.9 and 0.6:
#   NAMES="lowrank_shared3 lowrank_shared3_lr2 lowrank_shared3_lr4
#   lowrank_shared3_nesterov lowrank_shared3_nesterov_m06" bash bench/sparse_aggregate_toy.sh OUT
# then, after every longer step did worse (lr 2: 78.88, lr 4: 103.56,
# Nesterov 0.9: 213.47, against 68.47 at lr 1), a shorter one and a
# fresher residual: SGD lr 0.5, the feedback decayed by 0.9, no feedback:
#   NAMES="lowrank_shared3_lr05 lowrank_shared3_decay09 lowrank_shared3_noef" bash bench/sparse_aggregate_toy.sh OUT
# then, after the decay of 0.9 helped (65.83; lr 0.5: 70.28, none: 80.57),
# faster decays:
#   NAMES="lowrank_shared3_decay08 lowrank_shared3_decay07" bash bench/sparse_aggregate_toy.sh OUT
# Then (2026-12-04, fixed before the run): the shared basis sends rank 3
# of the module's mean however many users it has, where top-k over its
# senders sends up to 8 workers' supports (+0.06% on this toy at 136x).
# The per-worker low rank (`lowrank`, each worker its own rank-3 basis,
# so the mean may span up to rank 24) had only run under Nesterov on
# GPUs; under averaging at the shared arm's rank, int4 factors and
# feedback, at SGD lr 1 and, as its mean divides each worker's own
# directions by 8 as top-k's `mean` did, at lr 2:
#   NAMES="lowrank3_worker lowrank3_worker_lr2" bash bench/sparse_aggregate_toy.sh OUT
# then, after the per-worker basis beat the shared one (61.96 against
# 68.47 at lr 1; lr 2: 66.36), its feedback decayed by 0.9 (the shared
# arm's best) and by 0.95 (SparseLoCo's):
#   NAMES="lowrank3_worker_decay09 lowrank3_worker_decay095" bash bench/sparse_aggregate_toy.sh OUT
# then, after both decays did worse (65.74, 62.93 against 61.96 undecayed),
# whether the per-worker basis keeps its lead with twice the bytes: both
# bases at rank 6 (about 87x), undecayed feedback, averaging:
#   NAMES="lowrank6_worker lowrank_shared6" bash bench/sparse_aggregate_toy.sh OUT
# 100x both ways with Elias-Fano indices (2026-12-04, fixed before the
# run): with the indices so coded, top-k at 32/4096 up and 8x that down
# (256/4096, the 8 workers' top-k together) would send about 104x fewer
# bytes both ways on the 126M model (64/4096 and 512/4096: 60x). Whether
# half SparseLoCo's density costs this toy much: up alone (float32 down),
# and read back at 8x:
#   NAMES="topk_half_senders topk_half_down8x_ef" bash bench/sparse_aggregate_toy.sh OUT
# then (2026-12-05, fixed before the run, after half the density cost 8.5
# points up alone): the most entries up that still leave 100x both ways
# with a download of 256/4096, 40/4096 (100.8x on the 126M model; the 8
# workers' 40 together, at ~1.3 senders a kept coordinate, ~250 entries, so
# the download still covers their union), up alone and read back:
#   NAMES="topk40_senders topk40_down256_ef" bash bench/sparse_aggregate_toy.sh OUT
# then (2026-12-05, fixed before the run, after 40/4096 read back at 6.4x
# cost +41.3%): at half the density a coordinate waits about twice as long
# to be sent, and the feedback's decay of 0.95 a round drops more of it on
# the way; 32/4096 up with the feedback decayed by 0.98 and kept whole:
#   NAMES="topk_half_senders_decay098 topk_half_senders_decay1" bash bench/sparse_aggregate_toy.sh OUT
# then, after both did worse (66.54 and 85.49 against 54.11 at 0.95), the
# other way, decayed by 0.9 and 0.8:
#   NAMES="topk_half_senders_decay09 topk_half_senders_decay08" bash bench/sparse_aggregate_toy.sh OUT
# then, after 0.9 took the half density's cost from +8.5% to +2.0%, the
# 103x-both-ways arm (read back at 8x, Elias-Fano indices) at that decay:
#   NAMES="topk_half_down8x_ef_decay09" bash bench/sparse_aggregate_toy.sh OUT
# Each layer's weight its own matrix (2026-12-04, fixed before the run):
# every arm above took a slot's stacked layers [L, ...] as one matrix, so
# all its layers shared one basis, where PowerSGD codes each weight alone
# (`diloco.compression_matrix=per_layer`; a layer's norm scale then goes
# whole). At about the bytes of rank 3 stacked (174x): rank 2 per layer
# (170.5x), the shared basis and the per-worker one:
#   NAMES="lowrank_shared2_layer lowrank2_worker_layer" bash bench/sparse_aggregate_toy.sh OUT
# then, after both did a little worse than stacked (68.89 against 68.47,
# 64.15 against 61.96; a slot here stacks only 2 layers, and the layers'
# norm scales, now sent whole, take a fifth of the bytes), the model 12
# layers deep (slots of 6 layers, as 126M stacks 12), the shared basis at
# about 93x: rank 8 stacked against rank 4 per layer:
#   EXTRA=--config.model.num_layers=12 NAMES="lowrank_shared8
#   lowrank_shared4_layer" bash bench/sparse_aggregate_toy.sh OUT
# then (2026-12-05, fixed before the run), on the same 12-layer toy at
# over 100x, whether the per-worker basis keeps its 4-layer lead where
# the shared one came to +13.4%: both at rank 7 stacked (about 106x), and
# top-k over its senders at the same depth for the bar they must meet:
#   EXTRA=--config.model.num_layers=12 NAMES="lowrank_shared7 lowrank7_worker
#   topk_senders" bash bench/sparse_aggregate_toy.sh OUT
set -uo pipefail
out=${1:?OUT}; mkdir -p "$out"; w=${WORKDIR:-/tmp/sparse_aggregate_toy}
if [[ ${SHAPE:-1x1} == 2x2 ]]; then
  base=dipaco_2x2; shape=(--config.paths.shape=2x2 --config.paths.num_replicas=1)
else
  base=diloco_x${REPLICAS:-8}
  shape=(--config.paths.shape=1x1 --config.paths.num_replicas=${REPLICAS:-8})
fi
common=(--config=experiments/quickstart.py:small "${shape[@]}"
        --config.diloco.inner_steps=10 --config.diloco.outer_optimizer=sgd
        --config.diloco.outer_lr=1.0 --config.diloco.outer_momentum=0.0
        --config.eval.reroute_every=0 --config.eval.learned_reroute=False)
# EXTRA: flags for every arm, the float32 base included (e.g. the depth).
read -ra extra <<< "${EXTRA:-}"
common+=("${extra[@]}")
topk=(--config.diloco.compression=topk --config.diloco.error_feedback=True
      --config.diloco.error_feedback_decay=0.95
      --config.diloco.compression_topk_fraction=0.015625
      --config.diloco.compression_topk_chunk=4096)
run() {  # NAME FLAGS...
  local name=$1; shift
  if [[ $name != "$base" ]]; then
    rm -rf "${w}_$name"; mkdir -p "${w}_$name/runs"
    cp -r "$w/$base/data" "${w}_$name/"
    cp -r "$w/$base/runs/base" "${w}_$name/runs/"
    dir=${w}_$name
  else
    rm -rf "$w"; mkdir -p "$w"; dir=$w/$base
  fi
  python3 -m dipaco_jax.main "${common[@]}" --workdir="$dir" "$@" \
    > "$out/$name.log" 2>&1
  echo "$name exit $?"
  sed -n '/^Validation/,+5p' "$out/$name.log" | tail -2
}
senders=("${topk[@]}" --config.diloco.sparse_aggregate=senders)
strided8="--config.diloco.compression=strided --config.diloco.compression_stride=8 --config.diloco.error_feedback=True --config.diloco.sparse_aggregate=mean"
topk2x="${senders[*]} --config.diloco.compression_topk_fraction=0.03125"
down=(--config.diloco.download_compression=topk)
down8x="${down[*]} --config.diloco.download_topk_fraction=0.125"
overlap1="--config.diloco.delay=overlap --config.diloco.overlap_steps=1"
nesterov="--config.diloco.outer_optimizer=nesterov --config.diloco.outer_lr=0.7 --config.diloco.outer_momentum=0.9"
lr14="--config.diloco.outer_lr=1.4"
lowrank3="--config.diloco.compression=lowrank_shared --config.diloco.compression_rank_max=3 --config.diloco.compression_factor_bits=4 --config.diloco.error_feedback=True"
lowrank3_worker="--config.diloco.compression=lowrank --config.diloco.compression_rank_max=3 --config.diloco.compression_energy=1.0 --config.diloco.compression_factor_bits=4 --config.diloco.error_feedback=True"
# An arm's later flag wins over an earlier one (and over `common`'s).
declare -A ARMS=(
  [lowrank_shared3]="$lowrank3"
  [lowrank3_worker]="$lowrank3_worker"
  [lowrank3_worker_lr2]="$lowrank3_worker --config.diloco.outer_lr=2.0"
  [lowrank3_worker_decay09]="$lowrank3_worker --config.diloco.error_feedback_decay=0.9"
  [lowrank3_worker_decay095]="$lowrank3_worker --config.diloco.error_feedback_decay=0.95"
  [lowrank6_worker]="$lowrank3_worker --config.diloco.compression_rank_max=6"
  [lowrank_shared6]="$lowrank3 --config.diloco.compression_rank_max=6"
  [lowrank_shared2_layer]="$lowrank3 --config.diloco.compression_rank_max=2 --config.diloco.compression_matrix=per_layer"
  [lowrank_shared8]="$lowrank3 --config.diloco.compression_rank_max=8"
  [lowrank_shared7]="$lowrank3 --config.diloco.compression_rank_max=7"
  [lowrank7_worker]="$lowrank3_worker --config.diloco.compression_rank_max=7"
  [lowrank_shared4_layer]="$lowrank3 --config.diloco.compression_rank_max=4 --config.diloco.compression_matrix=per_layer"
  [lowrank2_worker_layer]="$lowrank3_worker --config.diloco.compression_rank_max=2 --config.diloco.compression_matrix=per_layer"
  [lowrank_shared3_lr2]="$lowrank3 --config.diloco.outer_lr=2.0"
  [lowrank_shared3_lr4]="$lowrank3 --config.diloco.outer_lr=4.0"
  [lowrank_shared3_lr05]="$lowrank3 --config.diloco.outer_lr=0.5"
  [lowrank_shared3_decay09]="$lowrank3 --config.diloco.error_feedback_decay=0.9"
  [lowrank_shared3_decay08]="$lowrank3 --config.diloco.error_feedback_decay=0.8"
  [lowrank_shared3_decay07]="$lowrank3 --config.diloco.error_feedback_decay=0.7"
  [lowrank_shared3_noef]="$lowrank3 --config.diloco.error_feedback=False"
  [lowrank_shared3_nesterov]="$lowrank3 $nesterov"
  [lowrank_shared3_nesterov_m06]="$lowrank3 $nesterov --config.diloco.outer_momentum=0.6"
  [topk_mean]="${topk[*]} --config.diloco.sparse_aggregate=mean"
  [topk_senders]="${senders[*]}"
  [topk_half_senders]="${senders[*]} --config.diloco.compression_topk_fraction=0.0078125"
  [topk_half_senders_decay098]="${senders[*]} --config.diloco.compression_topk_fraction=0.0078125 --config.diloco.error_feedback_decay=0.98"
  [topk_half_senders_decay09]="${senders[*]} --config.diloco.compression_topk_fraction=0.0078125 --config.diloco.error_feedback_decay=0.9"
  [topk_half_senders_decay08]="${senders[*]} --config.diloco.compression_topk_fraction=0.0078125 --config.diloco.error_feedback_decay=0.8"
  [topk_half_down8x_ef_decay09]="${senders[*]} --config.diloco.compression_topk_fraction=0.0078125 --config.diloco.error_feedback_decay=0.9 ${down[*]} --config.diloco.download_topk_fraction=0.0625 --config.diloco.compression_index_code=elias_fano"
  [topk_half_senders_decay1]="${senders[*]} --config.diloco.compression_topk_fraction=0.0078125 --config.diloco.error_feedback_decay=1.0"
  [topk_half_down8x_ef]="${senders[*]} --config.diloco.compression_topk_fraction=0.0078125 ${down[*]} --config.diloco.download_topk_fraction=0.0625 --config.diloco.compression_index_code=elias_fano"
  [topk40_senders]="${senders[*]} --config.diloco.compression_topk_fraction=0.009765625"
  [topk40_down256_ef]="${senders[*]} --config.diloco.compression_topk_fraction=0.009765625 ${down[*]} --config.diloco.download_topk_fraction=0.0625 --config.diloco.compression_index_code=elias_fano"
  [down_topk]="${senders[*]} ${down[*]}"
  [down_topk4x]="${senders[*]} ${down[*]} --config.diloco.download_topk_fraction=0.0625"
  [down_topk8x]="${senders[*]} $down8x"
  [down_int4]="${senders[*]} --config.diloco.download_compression=int4"
  [plain_nesterov]="$nesterov"
  [eager_nesterov]="--config.diloco.delay=eager $nesterov"
  [eager_nesterov_lr035]="--config.diloco.delay=eager $nesterov --config.diloco.outer_lr=0.35"
  [naive_nesterov]="--config.diloco.delay=naive $nesterov"
  [plain_nesterov_lr035]="$nesterov --config.diloco.outer_lr=0.35"
  [one_round_nesterov]="--config.diloco.delay=one_round $nesterov"
  [one_round_nesterov_lr035]="--config.diloco.delay=one_round $nesterov --config.diloco.outer_lr=0.35"
  [plain_nesterov_lr035_m08]="$nesterov --config.diloco.outer_lr=0.35 --config.diloco.outer_momentum=0.8"
  [plain_nesterov_m08]="$nesterov --config.diloco.outer_momentum=0.8"
  [eager_nesterov_m08]="--config.diloco.delay=eager $nesterov --config.diloco.outer_momentum=0.8"
  [plain_nesterov_lr035_m06]="$nesterov --config.diloco.outer_lr=0.35 --config.diloco.outer_momentum=0.6"
  [eager_nesterov_lr035_m06]="--config.diloco.delay=eager $nesterov --config.diloco.outer_lr=0.35 --config.diloco.outer_momentum=0.6"
  [plain_nesterov_m07]="$nesterov --config.diloco.outer_momentum=0.7"
  [plain_nesterov_lr1_m08]="$nesterov --config.diloco.outer_lr=1.0 --config.diloco.outer_momentum=0.8"
  [eager_nesterov_lr05_m08]="--config.diloco.delay=eager $nesterov --config.diloco.outer_lr=0.5 --config.diloco.outer_momentum=0.8"
  [eager_nesterov_lr035_m07]="--config.diloco.delay=eager $nesterov --config.diloco.outer_lr=0.35 --config.diloco.outer_momentum=0.7"
  [topk_senders_nesterov_m06]="${senders[*]} $nesterov --config.diloco.outer_momentum=0.6"
  [topk_senders_nesterov_lr1_m05]="${senders[*]} $nesterov --config.diloco.outer_lr=1.0 --config.diloco.outer_momentum=0.5"
  [topk_senders_nesterov_lr035_m08]="${senders[*]} $nesterov --config.diloco.outer_lr=0.35 --config.diloco.outer_momentum=0.8"
  [eager_nesterov_lr035_m08]="--config.diloco.delay=eager $nesterov --config.diloco.outer_lr=0.35 --config.diloco.outer_momentum=0.8"
  [topk2x_senders]="$topk2x"
  [senders_nesterov]="${senders[*]} $nesterov"
  [topk2x_nesterov_noef]="$topk2x --config.diloco.error_feedback=False $nesterov"
  [topk2x_nesterov_lr035]="$topk2x $nesterov --config.diloco.outer_lr=0.35"
  [avg_lr14]="$lr14"
  [topk2x_senders_lr14]="$topk2x $lr14"
  [topk_senders_lr14]="${senders[*]} $lr14"
  [combined_topk2x_lr14]="$topk2x $lr14 $overlap1 $down8x"
  [combined_topk2x]="$topk2x $overlap1 $down8x"
  [strided8_both]="$strided8 --config.diloco.download_compression=strided"
  [strided8_both_noef]="$strided8 --config.diloco.download_compression=strided --config.diloco.error_feedback=False"
  [combined_topk4x]="${senders[*]} $overlap1 ${down[*]} --config.diloco.download_topk_fraction=0.0625"
  [leader_topk]="${topk[*]} --config.diloco.compression=leader_topk --config.diloco.sparse_aggregate=mean"
  [leader_topk_both]="${topk[*]} --config.diloco.compression=leader_topk --config.diloco.sparse_aggregate=mean ${down[*]}"
  [leader_topk2x_both]="${topk[*]} --config.diloco.compression=leader_topk --config.diloco.sparse_aggregate=mean --config.diloco.compression_topk_fraction=0.03125 ${down[*]}"
  [leader_topk8x_both]="${topk[*]} --config.diloco.compression=leader_topk --config.diloco.sparse_aggregate=mean --config.diloco.compression_topk_fraction=0.125 ${down[*]}"
)
run "$base"
for name in ${NAMES:-topk_mean topk_senders}; do
  # shellcheck disable=SC2086
  run "$name" ${ARMS[$name]}
done
