#!/usr/bin/env bash
# Cloud TPU VM launcher: create (optional), install on every worker, run.
#
#   TPU_NAME=dipaco ZONE=us-central2-b ACCELERATOR=v4-64 \
#   bash launch/tpu_vm.sh --config=experiments/paper_dipaco_16x16_c4.py \
#       --workdir=gs://BUCKET/dipaco_16x16
#
# Every worker runs the same command with --distributed; JAX finds its peers
# on Cloud TPU. TFDS_DATA_DIR (e.g. gs://BUCKET/tfds) must hold prepared C4
# for the C4 configs. Set CREATE=1 to create the VM first.
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}"
ACCELERATOR=${ACCELERATOR:-v4-8}
VERSION=${VERSION:-tpu-ubuntu2204-base}
if [[ "${CREATE:-0}" == 1 ]]; then
  gcloud compute tpus tpu-vm create "$TPU_NAME" --zone="$ZONE" \
    --accelerator-type="$ACCELERATOR" --version="$VERSION"
fi
tar czf /tmp/dipaco_jax_src.tgz --exclude=.git --exclude=.venv .
gcloud compute tpus tpu-vm scp /tmp/dipaco_jax_src.tgz "$TPU_NAME": \
  --zone="$ZONE" --worker=all
args=$(printf '%q ' "$@")
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --worker=all \
  --command="set -e; mkdir -p ~/dipaco_jax && cd ~/dipaco_jax && \
    tar xzf ~/dipaco_jax_src.tgz && python3 -m venv ~/venv && \
    . ~/venv/bin/activate && pip install -q -e '.[tpu,data]' && \
    TFDS_DATA_DIR=${TFDS_DATA_DIR:-} python -m dipaco_jax.main \
      --distributed $args"
