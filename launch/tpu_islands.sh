#!/usr/bin/env bash
# Islands on Cloud TPU: one worker per TPU VM slice, the main job (its
# stages, the coordinator and the outer executors) on a small CPU VM; they
# share only the store under the gs:// workdir.
#
#   # 1. On each slice (here v4-8 single-host VMs dipaco-0..N-1):
#   TPU_PREFIX=dipaco NUM_SLICES=4 ZONE=us-central2-b \
#   WORKDIR=gs://BUCKET/dipaco_16x16 RUNS="dipaco" \
#   bash launch/tpu_islands.sh workers
#   # 2. On the CPU VM (same WORKDIR; --num_workers=0: no local workers;
#   #    the gcs extra, gcsfs, is what every role reads gs:// with):
#   pip install -e '.[data,gcs]'
#   python -m dipaco_jax.islands --config=experiments/paper_dipaco_16x16_c4.py \
#       --workdir=gs://BUCKET/dipaco_16x16 --num_workers=0 --paths_per_task=1 \
#       --config.eval.early_stopping=False
#
# Each worker serves the runs named in RUNS in order (add
# "dipaco_discriminative" when routing.discriminative_steps > 0; "main" for
# DiLoCo), waiting for each to start (--max_idle_s). Workers can be added
# or removed at any time: the coordinator hands tasks to whoever beats. Set
# CREATE=1 to create the VMs first (ACCELERATOR, VERSION as in tpu_vm.sh).
set -euo pipefail
: "${TPU_PREFIX:?}" "${NUM_SLICES:?}" "${ZONE:?}" "${WORKDIR:?}"
RUNS=${RUNS:-dipaco}
ACCELERATOR=${ACCELERATOR:-v4-8}
VERSION=${VERSION:-tpu-ubuntu2204-base}
[[ "${1:-}" == workers ]] || { echo "usage: $0 workers" >&2; exit 2; }
tar czf /tmp/dipaco_jax_src.tgz --exclude=.git --exclude=.venv .
for i in $(seq 0 $((NUM_SLICES - 1))); do
  name="$TPU_PREFIX-$i"
  if [[ "${CREATE:-0}" == 1 ]]; then
    gcloud compute tpus tpu-vm create "$name" --zone="$ZONE" \
      --accelerator-type="$ACCELERATOR" --version="$VERSION"
  fi
  gcloud compute tpus tpu-vm scp /tmp/dipaco_jax_src.tgz "$name": \
    --zone="$ZONE" --worker=all
  serve=""
  for run in $RUNS; do
    serve+="python -m dipaco_jax.islands.worker --store=$WORKDIR/islands/$run --worker_id=$name; "
  done
  gcloud compute tpus tpu-vm ssh "$name" --zone="$ZONE" --worker=all \
    --command="set -e; mkdir -p ~/dipaco_jax && cd ~/dipaco_jax && \
      tar xzf ~/dipaco_jax_src.tgz && python3 -m venv ~/venv && \
      . ~/venv/bin/activate && pip install -q -e '.[tpu,data,gcs]' && \
      nohup bash -c '$serve' > ~/worker.log 2>&1 &"
done
