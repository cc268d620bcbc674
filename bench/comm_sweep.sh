#!/usr/bin/env bash
# DiLoCoX arms beyond bench/comm_quality.sh's (2026-11-27), after it
# showed that the outer Nesterov of plain DiLoCo (lr 0.7, momentum 0.9)
# costs the delayed arms 18.6% and more, and that top-k and low rank under
# it do not train. On experiments/diloco.py (DiLoCo x8, H = 50), all arms
# from one dense base and one tokenized corpus:
#   diloco_x8             plain DiLoCo, rerun in the same job (the baseline)
#   one_round_avg         one_round, outer SGD lr 1, no momentum (averaging)
#   one_round_m06         one_round, outer Nesterov lr 0.7, momentum 0.6
#   one_round_lr05        one_round, outer Nesterov lr 0.5, momentum 0.8
#   sparseloco            SparseLoCo: top 64 of every 4096 entries with
#                         12-bit indices and 2-bit values (136x fewer bytes),
#                         error feedback with decay 0.95, outer SGD lr 1
#                         without momentum (the feedback acts as momentum)
#   topkc_ef              the same chunked top-k + plain error feedback
#                         under the default outer Nesterov
#   one_round_sparseloco  sparseloco one round late (the combined arm, fixed
#                         in advance, not chosen)
# one_round's outer lr and momentum, a denser top-k (2026-11-27;
# NAMES="one_round_lr1 one_round_m095 topk16_ef one_round_lr1_topk16_ef";
# settings fixed before the run from the arms above, not chosen on
# validation):
#   one_round_lr1         one_round, outer Nesterov lr 1.0, momentum 0.9
#   one_round_m095        one_round, outer Nesterov lr 0.7, momentum 0.95
#   topk16_ef             chunked top-k at 4x topkc_ef's density (256 of
#                         every 4096, about 34x fewer bytes) + error
#                         feedback, default outer Nesterov: where between
#                         int4 (7.8x, free) and 136x the cost starts
#   one_round_lr1_topk16_ef  the two together
# Larger outer lrs for one_round (2026-11-27; NAMES="one_round_lr14
# one_round_lr2 one_round_lr14_m08 one_round_lr1_int4_ef"; fixed from the
# trend of the arms above: a larger outer lr helped the delay, more
# momentum did not):
#   one_round_lr14        one_round, outer Nesterov lr 1.4, momentum 0.9
#   one_round_lr2         one_round, outer Nesterov lr 2.0, momentum 0.9
#   one_round_lr14_m08    one_round, outer Nesterov lr 1.4, momentum 0.8
#   one_round_lr1_int4_ef one_round at lr 1.0 with int4 + error feedback
#                         (the compressor that cost nothing, 7.8x)
# The lookahead delay (2026-11-27; NAMES="lookahead lookahead_int4_ef
# lookahead_topk16_ef lookahead_lr1"; built after the larger outer lrs, at
# the default outer Nesterov 0.7 / 0.9 unless named):
#   lookahead             one round late, each worker starting from its own
#                         prediction of the next global modules
#   lookahead_int4_ef     the same with int4 + error feedback (7.8x)
#   lookahead_topk16_ef   the same with chunked top-k 256/4096 + error
#                         feedback (36x)
#   lookahead_lr1         lookahead at outer lr 1.0
# The overlap delay (2026-11-27; NAMES="overlap_tau5 overlap_tau10
# overlap_tau25 overlap_tau5_int4_ef"; `delay=overlap`: round r's
# outer step lands tau of H = 50 inner steps after round r ends, at the
# default outer Nesterov 0.7 / 0.9; tau = 50 would be one_round):
#   overlap_tau5          tau = 5 (a transfer hidden behind 10% of a round)
#   overlap_tau10         tau = 10
#   overlap_tau25         tau = 25
#   overlap_tau5_int4_ef  tau = 5 with int4 + error feedback (7.8x)
# A 42M model (2026-11-28; MODEL="--config.model.num_layers=8
# --config.model.d_model=512 --config.model.num_heads=8
# --config.model.mlp_dim=2048" MAX_CHARS=400000000, NAMES="topkc_ef
# topk16_ef one_round_lr1"): the same arms on a 42M model (the shape of
# experiments/dense.py), whether a larger model narrows their gaps; then
# NAMES="sparseloco lowrank_int4_ef one_round_lr1_topkc_ef" on it:
#   lowrank_int4_ef       comm_quality.sh's low rank 20 with int4 factors
#                         and error feedback decayed by 0.9 (118x fewer)
#   one_round_lr1_topkc_ef  one_round at outer lr 1.0 with topkc_ef's
#                         compressor (comm_quality.sh's combined arm)
# Compressed downloads (2026-11-28; STEPS=3000, NAMES="int4_ef
# int4_ef_down_int4 int4_ef_down_e3m0"; `diloco.download_compression`:
# what workers read back compressed too, fixed before the run from the
# upload codecs that cost nothing):
#   int4_ef               int4 + error feedback (comm_quality.sh's arm)
#   int4_ef_down_int4     the same, and each module's change read back in
#                         int4 (7.8x fewer bytes both ways)
#   int4_ef_down_e3m0     the same with the change read back in e3m0
#   overlap_tau5_int4_ef_down_int4  (built after that run, not run)
#                         overlap at tau = 5 with int4 both ways
# The reference aggregation and PowerSGD's shared subspace (2026-11-29,
# the default 8.4M model, NAMES="sparseloco sparseloco_senders
# lowrank_shared_int4_ef"; then sparseloco_senders on the 42M model above,
# its MODEL and MAX_CHARS=400000000, NAMES="sparseloco_senders"; fixed
# before the runs, not chosen):
#   sparseloco_senders    sparseloco, each coordinate averaged over the
#                         workers that sent it (diloco.sparse_aggregate)
#   lowrank_shared_int4_ef  one rank-24 subspace per module shared by its
#                         users (compression=lowrank_shared), int4 factors
#                         (98.4x fewer bytes at 8.4M),
#                         plain error feedback, outer averaging as
#                         sparseloco (PowerSGD pairs feedback with plain
#                         averaging; under Nesterov the per-worker arm
#                         diverged)
# The combined arm (2026-11-29, the 42M model above, its MODEL and
# MAX_CHARS=400000000, NAMES="combined_overlap_senders_down"; fixed before
# the run from the tables of docs/communication_measured.md, not chosen):
# the best delay measured at H = 50 (overlap at a tenth of a round, tau = 5: +0.36%
# to +0.74% on DiLoCo x8, the only delay within 2%), the best codec at
# >= 100x (sparseloco_senders: +10.50% at 42M, 136.5x up), and downloads
# compressed with the strongest download codec there is (int4 read back,
# 7.8x; download_compression has no codec near 100x: int8, int4, e3m0):
#   combined_overlap_senders_down  sparseloco_senders (outer averaging)
#                         with delay=overlap, tau = 5, and
#                         download_compression=int4
# The papers' regime, scaled down (2026-12-01; MODEL="--config.diloco.
# inner_steps=15", STEPS=2250: 150 rounds of H = 15, the default 8.4M
# model; NAMES="sparseloco_senders senders_topk_down
# combined_overlap2_topk_both lowrank_shared20_int4_ef"; fixed before the
# run from docs/communication_measured.md's tables, not chosen):
#   senders_topk_down     sparseloco_senders with each module's change read
#                         back as top-k too (download_compression=topk, the
#                         same 64/4096 and 2 bits; 136.5x fewer both ways)
#   combined_overlap2_topk_both  the same with delay=overlap at tau = 2 of
#                         H = 15 (the best delay, a tenth of a round rounded
#                         up): the combined arm at >= 100x both ways
#   lowrank_shared20_int4_ef  lowrank_shared_int4_ef at rank 20 (>= 100x
#                         fewer bytes up at 8.4M; rank 24 was 98.4x)
# Built after the CPU toy of 2026-12-01 (top-k read back at 8x the upload's
# density matched float32 there), run the same day with the H = 15 MODEL
# above, STEPS=2250 LANES=4 NAMES="sparseloco_senders senders_topk8x_down
# combined_overlap2_topk8x_both":
#   senders_topk8x_down   senders_topk_down with download_topk_fraction =
#                         8 x 64/4096 (the 8 workers' top-k together; 32x
#                         fewer bytes both ways)
#   combined_overlap2_topk8x_both  combined_overlap2_topk_both with the
#                         download at that 8x share
# SparseLoCo over its senders at 126M (2026-12-01; MODEL="--config.model.
# num_layers=12 --config.model.d_model=768 --config.model.num_heads=12
# --config.model.mlp_dim=3072 --config.ckpt.every=750
# --config.ckpt.keep=1", MAX_CHARS=400000000, STEPS=1500, LANES=1): one
# arm per call, as one call cannot hold two, each call with BASELINE= and
# NAMES=diloco_x8, then NAMES=sparseloco_senders, with an absolute WORK_DIR
# the second call finds again (the same machine, still warm; on a fresh
# one pass the first call's arms.tgz as PRIOR). With H = 50 (the MODEL
# without inner_steps) the arm ran alone against the DiLoCo x8 of
# 2026-11-28; with --config.diloco.inner_steps=15 both arms ran. Then
# (2026-12-01, the same MODEL with inner_steps=15, one machine, one work
# folder, NAMES=combined_overlap2_topk8x_both, and the arm below run by
# main.py with its flags in the call's last minutes):
#   combined_overlap2_topk_both100x  combined_overlap2_topk8x_both with 8x
#                         sparser uploads (8 of every 4096 entries, about
#                         745x fewer bytes) read back at 8 x that share
#                         (64/4096, 136.5x): a module's change is up to
#                         its 8 users' top-k together, so >= 100x both
#                         ways needs uploads 8x sparser than SparseLoCo's
# Fixed 2026-12-04 (after Elias-Fano indices, compression_index_code=
# elias_fano, made the combined arm's bytes 60x both ways with the same
# training), run 2026-12-05 over 150 rounds (trained, not scored: a full
# disk; rerun with --config.ckpt.every=2250
# --config.ckpt.preemption_grace_s=110 in MODEL and GRACE=120), NAMES=
#   combined_overlap2_topk32_8x_ef  combined_overlap2_topk8x_both at half
#                         the upload's density (32/4096, 315x up) read
#                         back at 8 x that (256/4096, 62x), Elias-Fano
#                         indices: about 104x both ways, between the arm
#                         above (+3.67%) and the 8/4096 one
#   combined_overlap2_topk32_8x_ef_decay09  the same with the feedback
#                         decayed by 0.9 (fixed 2026-12-05 after the CPU
#                         toy: +3.4% at 103x both ways against +13.7% at
#                         0.95; not run yet)
# The strided codec (2026-12-01, built after that: every worker sends the
# same eighth of the entries a round, the round's phase, 2 bits each, no
# indices, so the download is as thin as the upload; arms fixed before the
# run, outer averaging as SparseLoCo's, error feedback at decay 1 as every
# entry goes out once in 8 rounds; on the 8.4M model with
# MODEL="--config.diloco.inner_steps=15" STEPS=2250 LANES=7
# NAMES="sparseloco_senders strided8_ef strided8_both strided8_both_decay095
# combined_overlap2_strided8_both strided4_both"; seven lanes of the 8.4M
# model do not fit one H200: three of them stopped out of memory, four ran):
#   strided8_ef           strided 1/8 up (113.8x fewer bytes), float32 down
#   strided8_both         the same read back strided (113.8x both ways)
#   strided8_both_decay095  strided8_both with SparseLoCo's decay 0.95
#   combined_overlap2_strided8_both  strided8_both with overlap at tau = 2
#   strided4_both         a quarter a round both ways (57x): the trend
# leader_topk (ScaleCom's cyclic local top-k: a module's users send on one
# support a round, their leader's, so a download at the upload's share can
# carry the change); built after strided failed, arms fixed before any
# run, run 2026-12-01 with MODEL="--config.diloco.inner_steps=15"
# STEPS=2250 LANES=5 (NAMES="sparseloco_senders leader_sparseloco
# leader_sparseloco_both leader2x_both"; bench/results/
# communication_1xh200_2026-12-01/leader_topk_8m_h15.md):
#   leader_sparseloco     sparseloco_senders' flags with compression=
#                         leader_topk and the mean (one support: senders
#                         is top-k's only), float32 down
#   leader_sparseloco_both  the same read back as top-k at the upload's
#                         share (64/4096)
#   leader2x_both         leader_sparseloco_both at 2x the share both ways
#                         (128/4096)
# A 4x larger per-replica batch (2026-12-03; the papers' replicas step on
# ~500k tokens, ours on 16k; fixed before the run, not chosen): the default
# 8.4M model, MODEL="--config.diloco.inner_steps=15 --config.ckpt.every=750
# --config.model.loss_chunk=128" MAX_CHARS=400000000 STEPS=2250 LANES=4
# NAMES="sparseloco_senders b128_diloco_x8 b128_sparseloco_senders": each
# arm as above and its twin named b128_ at 128 sequences per replica step
# (comm_arms_lib.sh's arm_flags), against its own batch's DiLoCo x8.
# SparseLoCo at 126M over 150 rounds (2026-12-03; the 126M MODEL above
# with --config.diloco.inner_steps=15 --config.ckpt.every=2250, STEPS=2250,
# MAX_CHARS=400000000, LANES=2, BASELINE=diloco_x8
# NAMES=sparseloco_senders; the arms of 2026-12-01's 100 rounds, fixed
# before the run): the papers' >= 150 rounds, both arms at once on the
# GPU, resumed across device calls on one warm machine (a SIGTERM'd
# main.py saves and the rerun resumes). Two 126M lanes do not fit one
# H200 (the sparse arm stopped out of memory beside the baseline), so the
# later calls ran LANES=1: about 1500 s of device time for the pair,
# validation included, which one session's 30 minutes cannot hold with a
# machine's start. The sparse arm was scored alone the same day: BASELINE=
# on a fresh machine, the same base rebuilt from its seed, two calls of
# 572 s and 318 s.
# SparseLoCo at 42M over 150 rounds (2026-12-03, fixed before the run: the
# size trend at the papers' round count): the 42M MODEL above with
# --config.diloco.inner_steps=15 --config.ckpt.every=750 --config.ckpt.keep=1,
# STEPS=2250, MAX_CHARS=400000000, LANES=2, NAMES=sparseloco_senders.
# Then (fixed 2026-12-04 before the run): is the tables' DiLoCo x8 at outer
# Nesterov 0.7 / 0.9 a tuned baseline at short rounds? On a CPU toy 0.7 /
# 0.8 was 3.4% better at 8 replicas, and on a GPU no delay at 2 replicas
# gained 2.18% from it (42M, H = 30; bench/results/
# communication_1xh200_2026-12-04/eager_42m_m2_h30_momentum.md). The 8.4M
# model, MODEL="--config.diloco.inner_steps=15" STEPS=2250 LANES=3
# NAMES="diloco_x8_m08 sparseloco_senders": each compressed cost of the
# 8.4M H = 15 table then also against the better baseline. Ran the same
# day: 0.7 / 0.8 was 7.07% worse (bench/results/
# communication_1xh200_2026-12-04/diloco_8m_h15_momentum08.md).
#   diloco_x8_m08         DiLoCo x8 at outer Nesterov 0.7 / 0.8
# The shared low rank's size trend (fixed 2026-12-04 before the run): the
# 8.4M H = 15 table's lowrank_shared20_int4_ef (+130.12% at 117.9x) at 42M
# and the same bytes ratio, rank 52 (116x fewer bytes up by compress_shared.
# factor_bytes on the 42M bank; rank 20 would send 301x fewer). One arm per
# call, as the 126M arms ran: the 42M MODEL and corpus of the SparseLoCo
# 150-round run above, BASELINE= NAMES=lowrank_shared52_int4_ef LANES=1,
# against that run's DiLoCo x8 (its base rebuilt from the same seed).
#   lowrank_shared52_int4_ef  lowrank_shared20_int4_ef at rank 52
# Then the same day, fixed after that arm's score (+37% at 42M) and before
# this run, the same command with NAMES=lowrank_shared104_int4_ef: how
# the cost falls with twice the bytes (58x fewer), against SparseLoCo's
# +4.23% at 136.5x on this model.
#   lowrank_shared104_int4_ef  lowrank_shared20_int4_ef at rank 104
# Then (fixed 2026-12-04 before the run; scored +25.41%): the third
# size, 126M, at the same ratio, rank 88 (117.9x planned, 119.7x
# measured), over 150 rounds of H = 15: the 126M
# MODEL of the SparseLoCo 150-round run above, STEPS=2250
# MAX_CHARS=400000000 LANES=1 BASELINE= NAMES=lowrank_shared88_int4_ef,
# against that run's DiLoCo x8. About 900 s of device time: two calls of
# device_call.sh 555 on one machine and WORK_DIR, the second made the
# moment the first returns (a machine goes back 30 s after a call; PRIOR
# carries finished arms only, not a checkpoint; a first try, whose second
# call landed on a fresh machine, trained again from the base and was not
# scored).
#   lowrank_shared88_int4_ef  lowrank_shared20_int4_ef at rank 88
# Planned (2026-12-04, after the per-worker low rank under averaging cost
# +24.2% on the CPU toy against the shared basis's +37.2% at the same
# bytes, bench/results/communication_cpu_2026-12-04/
# lowrank_per_worker_toy.md; at rank 6 the lead shrank to 2.8 points, so
# expect less at rank 88 of 768; not run yet): the same command and
# machine use with NAMES=lowrank88_int4_ef_avg, against the shared arm's
# +25.41%.
#   lowrank88_int4_ef_avg  the per-worker low rank (compression=lowrank)
#                         at a fixed rank 88, int4 factors, undecayed
#                         error feedback, outer averaging
# Planned after it, if device time is left (2026-12-04; on the CPU toy the
# view did not help: bench/results/communication_cpu_2026-12-04/
# lowrank_per_layer_toy.md; not run yet): the same with NAMES=
#   lowrank_shared46_layer_int4_ef  lowrank_shared88_int4_ef with each
#                         layer's weight its own matrix
#                         (compression_matrix=per_layer), at rank 46 for
#                         the same bytes (119.3x)
# Usage: [STEPS=1500] [MAX_CHARS=150000000] [LANES=3] [GPUS=0,1,2,3] \
#        [NAMES="arm ..."] [MODEL="flags"] [BASELINE=diloco_x8] \
#        [KEEP_CHECKPOINTS=1] bash bench/comm_sweep.sh OUT_DIR [WORK_DIR]
# The data and the dense base are built once (a 1-step run), then
# DiLoCo x8 and the named arms train from them, LANES at once.
# Writes OUT_DIR/summary.md (python bench/comm_table.py on the arms; the
# `--choose` line names the compressed arm with the lowest training loss)
# and OUT_DIR/arms.tgz (each arm's results.json, metrics.jsonl, log).
# About 9 minutes on one H100 with the defaults.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?OUT_DIR}; work=${2:-/tmp/comm_sweep}
read -r -a model <<< "${MODEL:-}"
# shellcheck source=bench/comm_arms_lib.sh
source bench/comm_arms_lib.sh
setup_arms comm_sweep experiments/diloco.py 150000000 \
  --config.train.num_steps=${STEPS:-1500} "${model[@]}"
d=--config.diloco
avg="$d.outer_optimizer=sgd $d.outer_lr=1.0 $d.outer_momentum=0"
# The top-k arms before 2026-11-29 averaged with the mean (then the
# default); sparseloco_senders sets senders (the default since).
topkc="$d.compression=topk $d.compression_topk_chunk=4096
       $d.compression_topk_fraction=0.015625 $d.error_feedback=True
       $d.sparse_aggregate=mean"
topk16="$d.compression=topk $d.compression_topk_chunk=4096
        $d.compression_topk_fraction=0.0625 $d.error_feedback=True
        $d.sparse_aggregate=mean"
strided8="$d.compression=strided $d.compression_stride=8 $d.error_feedback=True
          $d.sparse_aggregate=mean"
declare -A ARMS=(
  [diloco_x8]=""
  [diloco_x8_m08]="$d.outer_momentum=0.8"
  [one_round_avg]="$d.delay=one_round $avg"
  [one_round_m06]="$d.delay=one_round $d.outer_momentum=0.6"
  [one_round_lr05]="$d.delay=one_round $d.outer_lr=0.5 $d.outer_momentum=0.8"
  [sparseloco]="$topkc $d.error_feedback_decay=0.95 $avg"
  [sparseloco_senders]="${topkc/%=mean/=senders} $d.error_feedback_decay=0.95 $avg"
  [lowrank_shared_int4_ef]="$d.compression=lowrank_shared $d.compression_rank_max=24 $d.compression_factor_bits=4 $d.error_feedback=True $avg"
  [topkc_ef]="$topkc"
  [one_round_sparseloco]="$d.delay=one_round $topkc $d.error_feedback_decay=0.95 $avg"
  [one_round_lr1]="$d.delay=one_round $d.outer_lr=1.0"
  [one_round_m095]="$d.delay=one_round $d.outer_momentum=0.95"
  [topk16_ef]="$topk16"
  [one_round_lr1_topk16_ef]="$d.delay=one_round $d.outer_lr=1.0 $topk16"
  [one_round_lr14]="$d.delay=one_round $d.outer_lr=1.4"
  [one_round_lr2]="$d.delay=one_round $d.outer_lr=2.0"
  [one_round_lr14_m08]="$d.delay=one_round $d.outer_lr=1.4 $d.outer_momentum=0.8"
  [one_round_lr1_int4_ef]="$d.delay=one_round $d.outer_lr=1.0 $d.compression=int4 $d.error_feedback=True"
  [lookahead]="$d.delay=lookahead"
  [lookahead_int4_ef]="$d.delay=lookahead $d.compression=int4 $d.error_feedback=True"
  [lookahead_topk16_ef]="$d.delay=lookahead $topk16"
  [lookahead_lr1]="$d.delay=lookahead $d.outer_lr=1.0"
  [overlap_tau5]="$d.delay=overlap $d.overlap_steps=5"
  [overlap_tau10]="$d.delay=overlap $d.overlap_steps=10"
  [overlap_tau25]="$d.delay=overlap $d.overlap_steps=25"
  [overlap_tau5_int4_ef]="$d.delay=overlap $d.overlap_steps=5 $d.compression=int4 $d.error_feedback=True"
  [lowrank_int4_ef]="$d.compression=lowrank $d.error_feedback=True $d.compression_rank_max=20 $d.compression_energy=1.0 $d.compression_factor_bits=4 $d.error_feedback_decay=0.9"
  [one_round_lr1_topkc_ef]="$d.delay=one_round $d.outer_lr=1.0 $topkc"
  [int4_ef]="$d.compression=int4 $d.error_feedback=True"
  [int4_ef_down_int4]="$d.compression=int4 $d.error_feedback=True $d.download_compression=int4"
  [int4_ef_down_e3m0]="$d.compression=int4 $d.error_feedback=True $d.download_compression=e3m0"
  [overlap_tau5_int4_ef_down_int4]="$d.delay=overlap $d.overlap_steps=5 $d.compression=int4 $d.error_feedback=True $d.download_compression=int4"
  [senders_topk_down]="${topkc/%=mean/=senders} $d.error_feedback_decay=0.95 $avg $d.download_compression=topk"
  [senders_topk8x_down]="${topkc/%=mean/=senders} $d.error_feedback_decay=0.95 $avg $d.download_compression=topk $d.download_topk_fraction=0.125"
  [combined_overlap2_topk_both]="$d.delay=overlap $d.overlap_steps=2 ${topkc/%=mean/=senders} $d.error_feedback_decay=0.95 $avg $d.download_compression=topk"
  [combined_overlap2_topk8x_both]="$d.delay=overlap $d.overlap_steps=2 ${topkc/%=mean/=senders} $d.error_feedback_decay=0.95 $avg $d.download_compression=topk $d.download_topk_fraction=0.125"
  [combined_overlap2_topk32_8x_ef]="$d.delay=overlap $d.overlap_steps=2 ${topkc/%=mean/=senders} $d.error_feedback_decay=0.95 $avg $d.compression_topk_fraction=0.0078125 $d.download_compression=topk $d.download_topk_fraction=0.0625 $d.compression_index_code=elias_fano"
  [combined_overlap2_topk32_8x_ef_decay09]="$d.delay=overlap $d.overlap_steps=2 ${topkc/%=mean/=senders} $d.error_feedback_decay=0.9 $avg $d.compression_topk_fraction=0.0078125 $d.download_compression=topk $d.download_topk_fraction=0.0625 $d.compression_index_code=elias_fano"
  [combined_overlap2_topk_both100x]="$d.delay=overlap $d.overlap_steps=2 $d.compression=topk $d.compression_topk_chunk=4096 $d.compression_topk_fraction=0.001953125 $d.error_feedback=True $d.sparse_aggregate=senders $d.error_feedback_decay=0.95 $avg $d.download_compression=topk $d.download_topk_fraction=0.015625"
  [strided8_ef]="$strided8 $avg"
  [strided8_both]="$strided8 $avg $d.download_compression=strided"
  [strided8_both_decay095]="$strided8 $avg $d.download_compression=strided $d.error_feedback_decay=0.95"
  [combined_overlap2_strided8_both]="$d.delay=overlap $d.overlap_steps=2 $strided8 $avg $d.download_compression=strided"
  [strided4_both]="${strided8/stride=8/stride=4} $avg $d.download_compression=strided"
  [lowrank_shared20_int4_ef]="$d.compression=lowrank_shared $d.compression_rank_max=20 $d.compression_factor_bits=4 $d.error_feedback=True $avg"
  [lowrank_shared52_int4_ef]="$d.compression=lowrank_shared $d.compression_rank_max=52 $d.compression_factor_bits=4 $d.error_feedback=True $avg"
  [lowrank_shared104_int4_ef]="$d.compression=lowrank_shared $d.compression_rank_max=104 $d.compression_factor_bits=4 $d.error_feedback=True $avg"
  [lowrank_shared88_int4_ef]="$d.compression=lowrank_shared $d.compression_rank_max=88 $d.compression_factor_bits=4 $d.error_feedback=True $avg"
  [lowrank_shared46_layer_int4_ef]="$d.compression=lowrank_shared $d.compression_rank_max=46 $d.compression_matrix=per_layer $d.compression_factor_bits=4 $d.error_feedback=True $avg"
  [lowrank88_int4_ef_avg]="$d.compression=lowrank $d.compression_rank_max=88 $d.compression_energy=1.0 $d.compression_factor_bits=4 $d.error_feedback=True $avg"
  [combined_overlap_senders_down]="$d.delay=overlap $d.overlap_steps=5 ${topkc/%=mean/=senders} $d.error_feedback_decay=0.95 $avg $d.download_compression=int4"
  [leader_sparseloco]="${topkc/compression=topk/compression=leader_topk} $d.error_feedback_decay=0.95 $avg"
  [leader_sparseloco_both]="${topkc/compression=topk/compression=leader_topk} $d.error_feedback_decay=0.95 $avg $d.download_compression=topk"
  [leader2x_both]="${topkc/compression=topk/compression=leader_topk} $d.compression_topk_fraction=0.03125 $d.error_feedback_decay=0.95 $avg $d.download_compression=topk"
)
# shellcheck disable=SC2086
base=_stages run_lanes ${BASELINE-diloco_x8} ${NAMES:-sparseloco one_round_avg topkc_ef \
  one_round_sparseloco one_round_m06 one_round_lr05}
{ python3 bench/comm_table.py "$arms"
  echo; echo "chosen on training loss: $(python3 bench/comm_table.py "$arms" --choose 2>&1)"
} > "$out/summary.md"
tar czf "$out/arms.tgz" -C "$arms" .
cat "$out/summary.md"
