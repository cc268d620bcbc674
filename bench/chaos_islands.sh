#!/usr/bin/env bash
# The island runtime under failures, on this machine's CPU
# (docs/reliability.md).
#
#   [EXTRA="--config.diloco.delay=one_round"] bash bench/chaos_islands.sh \
#       [WORK=/tmp/chaos_islands]
#
# A small DiPaCo 4x4 (16 paths, the quickstart model) through islands with
# 3 local workers, w2 slowed on purpose (1 s per inner step), and a fourth
# worker started by hand once training runs. During the run: kill -9 of a random worker three
# times, of the coordinator once and of an outer executor once, at random
# moments. Then the same config with no failures (calm). Prints a table of
# verdicts: the stormy run's perplexities equal the calm run's, the slowed
# worker did fewer tasks, the late worker did some. About 10 minutes on
# 2 cores. Exit status 1 if a verdict fails.
set -uo pipefail
work=${1:-/tmp/chaos_islands}; rm -rf "$work"; mkdir -p "$work"
args=(--config=experiments/quickstart.py:small --fake_devices=8
      --config.paths.shape=4x4 --config.base.num_steps=20
      --config.train.num_steps=100 --config.diloco.inner_steps=25
      --config.data.max_corpus_chars=3000000 --config.eval.learned_reroute=False
      --num_workers=3 --lease_timeout_s=6)
# EXTRA: more flags for both runs, e.g. "--config.diloco.delay=one_round".
read -r -a extra <<< "${EXTRA:-}"
args+=("${extra[@]}")
store="$work/stormy/islands/dipaco"
# The launcher's own roles (it restarts them); the late worker and the
# slowed w2 are left be (a restart costs a worker its compilation, which
# would blur which one is slow).
pids() {
  local extra=""; [[ $1 == worker ]] && extra=" --worker_id=w[01]"
  pgrep -f "dipaco_jax.islands.$1 --store=$store$extra" || true
}
kill_one() {  # role: SIGKILL one random process of it, say which
  local p; p=$(pids "$1" | shuf -n 1)
  [[ -n "$p" ]] && kill -9 "$p" && echo "killed $1 (pid $p) at $(date +%T)"
}
timeout 1800 python -m dipaco_jax.islands "${args[@]}" --workdir="$work/stormy" \
  --slow_workers=w2:1.0 > "$work/stormy.log" 2>&1 &
main=$!
# Wait (bounded) for training to start, then add a late worker.
for _ in $(seq 600); do [[ -d "$store/control/heartbeat" ]] && break; sleep 1; done
sleep 5
timeout 1800 python -m dipaco_jax.islands.worker --store="$store" \
  --worker_id=late --fake_devices=1 > "$work/late_worker.log" 2>&1 &
late=$!
kills=()
for role in worker worker coordinator worker executor; do
  sleep $((4 + RANDOM % 6))
  [[ -f "$store/DONE.json" ]] && break
  k=$(kill_one "$role") && kills+=("$role") && echo "$k"
done
wait $main; status=$?
kill $late 2>/dev/null; wait $late 2>/dev/null
timeout 1800 python -m dipaco_jax.islands "${args[@]}" --workdir="$work/calm" \
  > "$work/calm.log" 2>&1
python3 - "$work" "$status" "${kills[*]:-}" <<'PY'
import json, sys
work, status, kills = sys.argv[1], int(sys.argv[2]), sys.argv[3].split()
storm = json.load(open(f"{work}/stormy/results.json"))
calm = json.load(open(f"{work}/calm/results.json"))
done = json.load(open(f"{work}/stormy/islands/dipaco/DONE.json"))
tasks = done["tasks_done"]
ppl = lambda r: {k: round(v["perplexity"], 6) for k, v in r["models"].items()}
rows = [
    ("stormy run finished", "exit 0", f"exit {status}", status == 0),
    ("kills during the run", "worker x3, coordinator, executor",
     " ".join(kills), sorted(kills) == sorted(
         ["worker"] * 3 + ["coordinator", "executor"])),
    ("perplexities vs calm run", "equal", "equal" if ppl(storm) == ppl(calm)
     else f"{ppl(storm)} vs {ppl(calm)}", ppl(storm) == ppl(calm)),
    ("slowed worker w2", "fewest tasks of w0-w2", json.dumps(tasks),
     tasks.get("w2", 0) < min(tasks.get("w0", 0), tasks.get("w1", 0))),
    ("late worker", "took tasks", f"{tasks.get('late', 0)} tasks",
     tasks.get("late", 0) > 0),
    ("re-queued tasks", "any number", str(done["requeued"]), True),
]
print("| case | expected | observed | verdict |\n| --- | --- | --- | --- |")
for case, want, got, ok in rows:
  print(f"| {case} | {want} | {got} | {'PASS' if ok else 'FAIL'} |")
sys.exit(0 if all(r[3] for r in rows) else 1)
PY
