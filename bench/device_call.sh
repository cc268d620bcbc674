#!/usr/bin/env bash
# One bounded call of a bench sweep on a lent GPU machine (a call has a
# wall-clock limit, and the machine can be a fresh one at the next call):
# the sweep runs until SECS, then its arms are stopped as a preemption
# stops them, and what they have goes to OUT_DIR.
#
#   [sweep env: MODEL, NAMES, STEPS, ...] bash bench/device_call.sh SECS \
#       bench/delay_table.sh OUT_DIR [WORK_DIR]
#
# - Wheels carried in wheels/ (the GPU machines lack ml-collections and
#   tensorboardX; WHEELS=DIR for another folder) are installed into
#   /tmp/site for this call.
# - At SECS, each of the sweep's main.py runs (those under WORK_DIR only)
#   gets SIGTERM, once (a second one makes main.py exit without its save):
#   it saves a checkpoint at the end of its step, or says its finished
#   stages are cached. The sweep's lanes are left alone, so
#   each records its arm (log, metrics, `!!!` line) into arms.tgz as after
#   any failure; an arm a lane starts after that is stopped the same way.
#   Whatever still runs GRACE seconds later (default 120) is killed.
# - OUT_DIR gets the sweep's log (of every call on this machine) and
#   summary.md, arms.tgz (packed again here, so a killed sweep's arms come
#   back too) and gpu.log (memory and utilization every 60 s).
# Run the same command again in the next call: on the same machine the
# sweep resumes (kept results, checkpoints); on a fresh one pass the last
# call's arms.tgz as PRIOR (bench/comm_arms_lib.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
usage="usage: bash bench/device_call.sh SECS SWEEP_SCRIPT OUT_DIR [WORK_DIR]"
secs=${1:?$usage}; sweep=${2:?$usage}; out=${3:?$usage}
if [[ ! "$secs" =~ ^[0-9]+$ ]]; then
  echo "device_call: SECS must be whole seconds, got '$secs'; $usage" >&2
  exit 2
fi
if [[ ! -f "$sweep" ]]; then
  echo "device_call: no sweep script '$sweep' (a path from the repository" \
    "root, e.g. bench/delay_table.sh)" >&2
  exit 2
fi
work=${4:-/tmp/$(basename "$sweep" .sh)}
grace=${GRACE:-120}
mkdir -p "$out"
res="$work.out"  # the sweep's OUT_DIR: its log grows over the calls
mkdir -p "$res"
source bench/carried_wheels.sh
gpu_log() {
  command -v nvidia-smi > /dev/null || return 0
  nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader \
    >> "$out/gpu.log" 2>&1
}
# This sweep's runs only: another job's main.py on the machine is not ours.
runs() { pgrep -f "dipaco_jax.main --workdir=$work/"; }
declare -A signaled=()
term_new_runs() {  # each run once: a second SIGTERM drops main.py's save
  local pid
  for pid in $(runs); do
    [[ -n "${signaled[$pid]:-}" ]] && continue
    kill -TERM "$pid" 2> /dev/null
    signaled[$pid]=1
  done
}

# Its own process group (setsid), so that a kill reaches the lanes and
# their runs at once: a lane killed after its run would first start the
# next arm.
if command -v setsid > /dev/null; then
  setsid bash "$sweep" "$res" "$work" &
else  # util-linux missing: killed below run by run, lanes first
  bash "$sweep" "$res" "$work" &
fi
sweep_pid=$!
start=$SECONDS
next_gpu=0
while kill -0 "$sweep_pid" 2> /dev/null && (( SECONDS - start < secs )); do
  if (( SECONDS >= next_gpu )); then gpu_log; next_gpu=$((SECONDS + 60)); fi
  sleep 1
done
if kill -0 "$sweep_pid" 2> /dev/null; then
  echo "device_call: ${secs} s reached; stopping the arms (SIGTERM)"
  stopped=$SECONDS
  while kill -0 "$sweep_pid" 2> /dev/null \
      && (( SECONDS - stopped < grace )); do
    term_new_runs
    sleep 1
  done
  if kill -0 "$sweep_pid" 2> /dev/null; then
    echo "device_call: still running after ${grace} s; killed"
    kill -KILL -- "-$sweep_pid" 2> /dev/null || {
      pkill -STOP -P "$sweep_pid"; kill -STOP "$sweep_pid"
      pkill -KILL -f "dipaco_jax.main --workdir=$work/"
      pkill -KILL -P "$sweep_pid"; kill -KILL "$sweep_pid"; }
  fi
fi
wait "$sweep_pid" 2> /dev/null
echo "device_call: sweep ended after $((SECONDS - start)) s"
cp "$res"/*.log "$res"/summary.md "$out"/ 2> /dev/null
[[ -d "$work/arms" ]] && tar czf "$out/arms.tgz" -C "$work/arms" .
ls -la "$out"
