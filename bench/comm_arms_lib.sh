# Sourced by bench/comm_quality.sh and bench/comm_sweep.sh: one arm's run
# and the sharing of the base between arms. Expects $log, $work, $arms and
# the arrays `common` (the main.py flags every arm shares) and ARMS
# (name -> its flags), and $lanes.
run() {  # name, then extra main.py flags
  local name=$1; shift
  echo "=== $name: $* ($(date -u +%H:%M:%S))" >> "$log"
  python3 -m dipaco_jax.main --workdir="$work/$name" "${common[@]}" "$@" \
    > "$arms/$name.log" 2>&1
  cp "$work/$name/results.json" "$arms/$name.json" 2>/dev/null \
    || echo "!!! $name wrote no results" >> "$log"
  cp "$work/$name/runs/main/logs/train/metrics.jsonl" \
    "$arms/$name.metrics.jsonl" 2>/dev/null
  echo "=== $name done ($(date -u +%H:%M:%S))" >> "$log"
}
share() {  # reuse the data and the dense base of run $1 in run $2
  for p in data runs/base shards/base; do
    mkdir -p "$work/$2/$(dirname $p)"; cp -r "$work/$1/$p" "$work/$2/$p"
  done
}
run_lanes() {  # each named arm of ARMS from diloco_x8's base, $lanes at once
  local i=0 name
  for name in "$@"; do
    share diloco_x8 "$name"
    # shellcheck disable=SC2086
    run "$name" ${ARMS[$name]} &
    i=$((i + 1))
    if (( i % lanes == 0 )); then wait; fi
  done
  wait
}
