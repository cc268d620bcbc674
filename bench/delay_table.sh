#!/usr/bin/env bash
# The eager-updates paper's table (Kale, Douillard, Donchev 2025), scaled
# down: DiLoCo's outer step with no delay, the naive delay (workers restart
# from the delayed global), our one_round (workers keep their own round)
# and eager (each worker's own fresh share applied at once), at M = 2 and
# M = 8 replicas, on experiments/diloco.py's 8.4M model
# (docs/communication_delays.md). The paper's regime: short rounds (H = 15
# here, it used 15-30), many of them (150 rounds = 2250 steps). Every arm runs the
# default outer Nesterov 0.7 / 0.9 (fixed before the run: one outer
# optimizer for all rows, as a user would get), from one dense base and
# one tokenized corpus. Arms: m{2,8}_{none,naive,one_round,eager}.
# Then (after the first call, 2026-11-29, fixed from the delays' earlier
# outer-lr sweeps at H = 50, not from this table's validation numbers):
# m{2,8}_one_round_lr1 (outer lr 1.0) and m{2,8}_eager_lr035 (outer lr
# 0.35), with NAMES="m2_none m8_none m2_one_round_lr1 ...".
# The 42M and 126M models at M = 2 (2026-12-01, MODEL and MAX_CHARS=400000000
# of bench/comm_sweep.sh's 42M and 126M runs; at 126M with
# --config.ckpt.every=2250 --config.ckpt.keep=1): NAMES="m2_none m2_naive
# m2_one_round m2_eager m2_eager_lr035" at 42M, "m2_none m2_eager_lr035" at
# 126M; then m2_none_lr035 (no delay at eager's outer lr 0.35, after no
# delay at lr 0.7 trailed eager at 126M) at 42M, alone in a call; then
# NAMES="m2_none_lr035 m2_eager_lr035" at 126M (its fair pair).
# A 4x larger per-replica batch at M = 2 (2026-12-03, fixed before the run):
# the 8.4M model, MODEL="--config.ckpt.every=750 --config.model.loss_chunk=128"
# MAX_CHARS=400000000 NAMES="m2_none_lr035 m2_eager_lr035 b128_m2_none_lr035
# b128_m2_eager_lr035" LANES=4: eager at its better outer lr, 32 and 128
# sequences per replica step (a b128_ arm: comm_arms_lib.sh's arm_flags).
# Then, after that call (its eager gap fell from 32 to 128 sequences),
# NAMES="b256_m2_none_lr035 b256_m2_eager_lr035" LANES=2 with the same
# MODEL and MAX_CHARS in a call of their own: 256 sequences, the trend.
# Then (2026-12-03, after 256 sequences still narrowed the gap)
# NAMES="b512_m2_none_lr035 b512_m2_eager_lr035" LANES=1 with the same MODEL
# and MAX_CHARS: 512 sequences, one arm at a time (chosen in case two
# lanes of 1024 sequences did not fit; one used at most 50.8 GB, so LANES=2
# fits on an H200).
# Then (2026-12-03, the same lever at 42M, in what was left of a session's
# device time): NAMES="b64_m2_none_lr035 b64_m2_eager_lr035" LANES=2 with the
# 42M MODEL (above) plus --config.model.loss_chunk=128 and MAX_CHARS=400000000.
# Then (2026-12-03, fixed before the run: the paper's H = 30, which took a
# third off eager's gap at 32 sequences, with 64): STEPS=4500 H=30 LANES=2
# NAMES="b64_m2_none_lr035 b64_m2_eager_lr035", the same MODEL plus
# --config.ckpt.every=1500 --config.ckpt.keep=1.
# Then (2026-12-03, fixed before the run: a lower outer lr, as halving it
# from 0.7 to 0.35 took two fifths off eager's gap at 8.4M, H = 15):
# STEPS=4500 H=30 LANES=4 NAMES="m2_none_lr035 m2_none_lr02 m2_eager_lr02
# m2_eager_lr025" with the 42M MODEL plus --config.ckpt.every=1500
# --config.ckpt.keep=1, 32 sequences per replica step; each eager arm
# against the better of the two no-delay arms. Then, after those lost,
# eager at 0.35, 0.4, 0.45 and 0.55 by main.py with this script's flags
# in the same work folder (bench/results/communication_1xh200_2026-12-03/
# eager_42m_m2_h30_outer_lr.md has the command).
# Then (fixed 2026-12-04 before the run, in place of the momentum arms
# planned on 2026-12-03 and not run: on the CPU toy less momentum helped no
# delay as much as eager, while the batch is the lever that brought eager
# within 1% at 8.4M): STEPS=4500 H=30 LANES=2 NAMES="b128_m2_none_lr035
# b128_m2_eager_lr035" with the 42M MODEL plus --config.model.loss_chunk=128
# --config.ckpt.every=1500 --config.ckpt.keep=1, the H = 30 batch trend's
# third row (32, 64, 128 sequences, all at outer lr 0.35). Then, in the
# session's last device minutes (2026-12-04, a fresh machine), the momentum
# arms planned on 2026-12-03 but m2_eager_lr05_m08: STEPS=4500 H=30 LANES=3
# NAMES="m2_none_lr035 m2_none_m08 m2_eager_lr035_m08" with the same MODEL
# (bench/results/communication_1xh200_2026-12-04/).
# Then (fixed 2026-12-04 before the run: the 128-sequence pair read its
# 116.2M-token corpus 5.1 times, and only its validation gap narrowed; is
# the narrowing the batch or the repetition?) the same pair on up to 4x
# the text: STEPS=4500 H=30 LANES=2 MAX_CHARS=1600000000 NAMES=
# "b128_m2_none_lr035 b128_m2_eager_lr035" with the same MODEL, run only
# if the device's site-packages holds at least 800M characters of .py.
# It held 388M (2026-12-04): not run. In its place (fixed before the run),
# no delay at the outer step tuned at 32 sequences, beside the 128-sequence
# pair of the same day: PRIOR=bench/results/communication_1xh200_2026-12-04/
# eager_42m_m2_h30_batch128_arms.tgz STEPS=4500 H=30 LANES=1 NAMES=
# "b128_m2_none_lr035 b128_m2_eager_lr035 b128_m2_none_m08", MAX_CHARS=
# 400000000 and that pair's MODEL (its base rebuilt from the same seed).
# Its first run lost its validation to the call's end and a fresh
# machine; rerun and scored with bench/device_call.sh (bench/results/
# communication_1xh200_2026-12-04/eager_42m_m2_h30_batch128_m08.md).
# Then (fixed 2026-12-04 before the run): is the batch or the
# repetition what narrowed eager's gap at 128 sequences (5.1 passes)? The
# 32-sequence arms on a quarter of the text, so that they too read it
# about 5 times: STEPS=4500 H=30 LANES=3 MAX_CHARS=100000000 NAMES=
# "m2_none_lr035 m2_eager_lr035 m2_none_m08" with the 42M MODEL plus
# --config.ckpt.every=1500 --config.ckpt.keep=1. Against the same arms on
# the whole text (1.3 passes; eager +2.53% against 0.35 / 0.9 and +4.91%
# against 0.7 / 0.8), a gap near the 128-sequence pair's (+1.04%, +2.38%)
# would say repetition, a gap as before the batch. Ran the same day with
# LANES=2 NAMES="m2_eager_lr035 m2_none_m08" (m2_none_lr035 left out to
# fit the device minutes left): +0.94%, repetition, by overfitting
# (bench/results/communication_1xh200_2026-12-04/
# eager_42m_m2_h30_quarter_text.md).
# The tuned outer step at 126M (fixed 2026-12-04 before the call): the
# 126M H = 15 pair ran both arms at 0.35 / 0.9 (no delay 5.208, eager
# 5.466), and no delay at 0.7 / 0.8 gained 2.18% at 42M, eager nothing.
# Does that hold at 126M, where 0.7 / 0.9 failed (7.045)? With the 126M
# MODEL (--config.model.num_layers=12 --config.model.d_model=768
# --config.model.num_heads=12 --config.model.mlp_dim=3072
# --config.ckpt.every=2250 --config.ckpt.keep=1), MAX_CHARS=400000000
# STEPS=2250 H=15 LANES=2 NAMES="m2_none_m08 m2_eager_lr035_m08".
# Eager at 0.35 / 0.8 scored 5.116, no delay at 0.7 / 0.8 5.174; so no
# delay at eager's own setting and between the two (fixed after that call,
# before this one): NAMES="m2_none_lr035_m08 m2_none_lr05_m08".
# Both scored 5.013 (a fresh machine, its own base); eager's other
# settings near its best (fixed after that call, before this one; the
# toy's eager best was 0.5 / 0.8): NAMES="m2_eager_lr05_m08
# m2_eager_lr035_m07".
# Then (fixed 2026-12-04 before the run, from that table's gap by round:
# eager's training-loss gap fell from +0.087 at round 30 to +0.024 at
# round 150): the same pair at its best setting over twice the rounds,
# 300 rounds of H = 15 (1.27 passes over the text, as the device's
# site-packages holds no more): STEPS=4500 H=15 LANES=2 NAMES=
# "m2_none_lr035_m08 m2_eager_lr035_m08" with the 126M MODEL but
# --config.ckpt.every=1500, over two calls on one machine.
# Eager scored +1.04% in loss there (+1.27% at 150 rounds). Then (fixed
# after that, before the run): the same 300 rounds at 42M, the size trend
# at one setting: the 42M MODEL plus --config.ckpt.every=1500
# --config.ckpt.keep=1, STEPS=4500 H=15 LANES=2 and the same NAMES.
# Eager came to +0.82% in loss at 42M. Then (fixed after that, before the
# run, in the session's last device minutes): no delay at 42M's own best
# outer step at H = 30, 0.7 / 0.8, over the same 300 rounds: the same
# MODEL and flags, LANES=1 NAMES=m2_none_m08 (its base rebuilt from the
# same seed on a fresh machine). Not run: no machine could be started.
#
# Usage: [STEPS=2250] [H=15] [LANES=4] [MAX_CHARS=150000000] [MODEL="flags"]
#        [NAMES="m2_none ..."] bash bench/delay_table.sh OUT_DIR [WORK_DIR]
# Tables: OUT_DIR/summary.md (one per M, against that M's no-delay arm);
# arms packed in OUT_DIR/arms.tgz (PRIOR=that file resumes on a fresh
# machine, bench/comm_arms_lib.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?OUT_DIR}; work=${2:-/tmp/delay_table}
read -r -a model <<< "${MODEL:-}"
# shellcheck source=bench/comm_arms_lib.sh
source bench/comm_arms_lib.sh
setup_arms delay_table experiments/diloco.py 150000000 \
  --config.train.num_steps=${STEPS:-2250} \
  --config.diloco.inner_steps=${H:-15} "${model[@]}"
d=--config.diloco
declare -A ARMS=()
for m in 2 8; do
  r="--config.paths.num_replicas=$m"
  ARMS[m${m}_none]="$r"
  ARMS[m${m}_naive]="$r $d.delay=naive"
  ARMS[m${m}_one_round]="$r $d.delay=one_round"
  ARMS[m${m}_eager]="$r $d.delay=eager"
  ARMS[m${m}_one_round_lr1]="$r $d.delay=one_round $d.outer_lr=1.0"
  ARMS[m${m}_eager_lr035]="$r $d.delay=eager $d.outer_lr=0.35"
  ARMS[m${m}_none_lr035]="$r $d.outer_lr=0.35"
  ARMS[m${m}_none_lr02]="$r $d.outer_lr=0.2"
  ARMS[m${m}_eager_lr02]="$r $d.delay=eager $d.outer_lr=0.2"
  ARMS[m${m}_eager_lr025]="$r $d.delay=eager $d.outer_lr=0.25"
  ARMS[m${m}_none_m08]="$r $d.outer_momentum=0.8"
  ARMS[m${m}_none_lr035_m08]="$r $d.outer_lr=0.35 $d.outer_momentum=0.8"
  ARMS[m${m}_none_lr05_m08]="$r $d.outer_lr=0.5 $d.outer_momentum=0.8"
  ARMS[m${m}_eager_lr035_m07]="$r $d.delay=eager $d.outer_lr=0.35 $d.outer_momentum=0.7"
  ARMS[m${m}_eager_lr035_m08]="$r $d.delay=eager $d.outer_lr=0.35 $d.outer_momentum=0.8"
  ARMS[m${m}_eager_lr05_m08]="$r $d.delay=eager $d.outer_lr=0.5 $d.outer_momentum=0.8"
done
# shellcheck disable=SC2086
base=_stages run_lanes ${NAMES:-m2_none m2_naive m2_one_round m2_eager \
  m8_none m8_naive m8_one_round m8_eager}
# Each M's table is against its no-delay arm: m{M}_none, or m{M}_none_lr035
# when only that ran; an M none of whose arms ran has no table.
# One table per M and per batch (arms named b<N>_..., comm_arms_lib.sh).
{ for bp in "" $(ls "$arms" | grep -o '^b[0-9]*_' | sort -u); do
    for m in 2 8; do
      basearm=m${m}_none
      [[ -f $arms/$bp$basearm.json || ! -f $arms/${bp}m${m}_none_lr035.json ]] \
        || basearm=m${m}_none_lr035
      ls "$arms"/${bp}m${m}_*.json > /dev/null 2>&1 || continue
      echo "### M = $m${bp:+, ${bp:1:-1} sequences per replica step}"; echo
      python3 bench/comm_table.py "$arms" --baseline=$basearm --prefix=${bp}m${m}_
      echo
    done
  done
} > "$out/summary.md"
tar czf "$out/arms.tgz" -C "$arms" .
cat "$out/summary.md"
