#!/usr/bin/env bash
# DiLoCoX's overlap on islands (docs/communication.md), on this machine's CPU:
# DiLoCo x2 of a small model through `python -m dipaco_jax.islands`, two
# worker processes, every role behind an emulated link (store/link.py):
#   plain_fast   delay none, no link limit      (about the compute alone)
#   plain_link   delay none, LINK_MBPS / LATENCY_MS
#   late_link    delay one_round, the same link
# and with INT4=1 two more on the same link, contributions sent as int4
# with error feedback (islands/wire.py):
#   int4_link       delay none
#   late_int4_link  delay one_round
# and with OVERLAP=1 one more on the same link, Streaming DiLoCo's overlap
# (islands/delayed.py): version r applied TAU inner steps into round r + 1:
#   overlap_link    delay overlap, tau = TAU (default 10 of H = 50)
# then prints the table of bench/islands_overlap.py (round time against
# compute and transfer) and leaves the timelines in WORK/ARM/plots/.
# Usage: [LINK_MBPS=100] [LATENCY_MS=50] [STEPS=300] [H=50] [INT4=1] \
#        [OVERLAP=1] [TAU=10] \
#        bash bench/islands_overlap.sh [WORK_DIR] [TABLE.md]
# ~10 minutes on a 2-core CPU (three runs of ~3 minutes; 5 with INT4=1).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${VIRTUAL_ENV:-}" && -f .venv/bin/activate ]]; then
  . .venv/bin/activate
fi
work=${1:-/tmp/islands_overlap}; table=${2:-}
mbps=${LINK_MBPS:-100}; lat=${LATENCY_MS:-50}
rm -rf "$work"; mkdir -p "$work"
std=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
common=(--config=experiments/diloco.py --fake_devices=2
        --config.paths.num_replicas=2 --config.data.corpus=text_files
        "--config.data.text_glob=$std/email/**/*.py"
        --config.data.max_corpus_chars=600000 --config.data.seq_len=64
        --config.train.num_steps=${STEPS:-300}
        --config.diloco.inner_steps=${H:-50} --config.base.num_steps=20
        --config.model.d_model=64 --config.model.mlp_dim=256
        --config.model.head_dim=16 --config.train.batch_size=8
        --config.base.batch_size=8 --num_workers=2 --worker_fake_devices=1
        --num_executors=1)
arm() {  # name, then flags
  local name=$1; shift
  echo "=== $name ($(date -u +%H:%M:%S))"
  timeout 1200 python3 -m dipaco_jax.islands --workdir="$work/$name" \
    "${common[@]}" "$@" > "$work/$name.log" 2>&1 \
    || { echo "!!! $name failed"; tail -5 "$work/$name.log"; exit 1; }
  grep -E "mean task phases|tasks per worker|store traffic" "$work/$name.log" \
    || true
}
arm plain_fast
int4=(--config.diloco.compression=int4 --config.diloco.error_feedback=True)
linked=(plain_link late_link)
[[ -n "${INT4:-}" ]] && linked+=(int4_link late_int4_link)
[[ -n "${OVERLAP:-}" ]] && linked+=(overlap_link)
for d in data runs/base shards; do
  for a in "${linked[@]}"; do
    mkdir -p "$work/$a/$(dirname $d)"; cp -r "$work/plain_fast/$d" "$work/$a/$d"
  done
done
arm plain_link --link_mbps="$mbps" --link_latency_ms="$lat"
arm late_link --link_mbps="$mbps" --link_latency_ms="$lat" \
  --config.diloco.delay=one_round
if [[ -n "${INT4:-}" ]]; then
  arm int4_link --link_mbps="$mbps" --link_latency_ms="$lat" "${int4[@]}"
  arm late_int4_link --link_mbps="$mbps" --link_latency_ms="$lat" \
    --config.diloco.delay=one_round "${int4[@]}"
fi
if [[ -n "${OVERLAP:-}" ]]; then
  arm overlap_link --link_mbps="$mbps" --link_latency_ms="$lat" \
    --config.diloco.delay=overlap --config.diloco.overlap_steps=${TAU:-10}
fi
python3 bench/islands_overlap.py "$work" --link_mbps="$mbps" \
  --latency_ms="$lat" --tau=${TAU:-10} --inner_steps=${H:-50} \
  ${table:+--out "$table"}
