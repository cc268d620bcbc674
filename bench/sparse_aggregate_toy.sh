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
set -uo pipefail
out=${1:?OUT}; mkdir -p "$out"; w=${WORKDIR:-/tmp/sparse_aggregate_toy}
common=(--config=experiments/quickstart.py:small --config.paths.shape=1x1 --config.paths.num_replicas=8
        --config.diloco.inner_steps=10 --config.diloco.outer_optimizer=sgd
        --config.diloco.outer_lr=1.0 --config.diloco.outer_momentum=0.0
        --config.eval.reroute_every=0 --config.eval.learned_reroute=False)
topk=(--config.diloco.compression=topk --config.diloco.error_feedback=True
      --config.diloco.error_feedback_decay=0.95
      --config.diloco.compression_topk_fraction=0.015625
      --config.diloco.compression_topk_chunk=4096)
run() {  # NAME FLAGS...
  local name=$1; shift
  if [[ $name != diloco_x8 ]]; then
    rm -rf "${w}_$name"; mkdir -p "${w}_$name/runs"
    cp -r "$w/diloco_x8/data" "${w}_$name/"
    cp -r "$w/diloco_x8/runs/base" "${w}_$name/runs/"
    dir=${w}_$name
  else
    rm -rf "$w"; mkdir -p "$w"; dir=$w/diloco_x8
  fi
  python3 -m dipaco_jax.main "${common[@]}" --workdir="$dir" "$@" \
    > "$out/$name.log" 2>&1
  echo "$name exit $?"
  sed -n '/^Validation/,+5p' "$out/$name.log" | tail -2
}
senders=("${topk[@]}" --config.diloco.sparse_aggregate=senders)
down=(--config.diloco.download_compression=topk)
declare -A ARMS=(
  [topk_mean]="${topk[*]} --config.diloco.sparse_aggregate=mean"
  [topk_senders]="${senders[*]}"
  [down_topk]="${senders[*]} ${down[*]}"
  [down_topk4x]="${senders[*]} ${down[*]} --config.diloco.download_topk_fraction=0.0625"
  [down_topk8x]="${senders[*]} ${down[*]} --config.diloco.download_topk_fraction=0.125"
  [down_int4]="${senders[*]} --config.diloco.download_compression=int4"
)
run diloco_x8
for name in ${NAMES:-topk_mean topk_senders}; do
  # shellcheck disable=SC2086
  run "$name" ${ARMS[$name]}
done
