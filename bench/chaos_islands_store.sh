#!/usr/bin/env bash
# Island chaos cases (docs/reliability.md): a damaged key of a finished
# run and one deleted mid-run (detected, rebuilt, results equal), SIGTERM
# to a worker and to the launcher (status 75, resumed, results equal), a
# worker of other code (refused in one line). Prints one row per case,
#   | case | expected | observed | verdict (PASS/FAIL) |
# and exits 1 if any case FAILs. The run and the cases are in
# bench/chaos_islands_store.py's docstring.
#
# Usage: bash bench/chaos_islands_store.sh [WORK_DIR] [TABLE.md]
#   WORK_DIR  scratch, deleted and recreated (default
#             /tmp/chaos_islands_store); every process's output lands in
#             WORK_DIR/logs/, the roles' in WORK_DIR/*/islands/dipaco/logs/
#   TABLE.md  also write the table there
#   env: CHAOS_SEED=N (the moments of the SIGTERMs),
#        CHAOS_TIMEOUT=S (bound on the whole script, default 5400),
#        CHAOS_ARGS="--no_jax_cache" (no shared JAX compilation cache)
# Expected runtime: ~5 minutes on 2 CPU cores (measured 4.7-5.1 min; the
# reference ~2 min, cases 3-5 under 1.5 min each), longer when other jobs
# share the cores. CPU only, 8 fake devices, ~0.3 GB of disk.
# The roles check the code's hash: do not edit dipaco_jax while it runs
# (or run it from a copy of the tree).
# Every wait is bounded (per process, plus CHAOS_TIMEOUT overall); the
# processes it starts, and the roles their launchers start, are killed on a
# timeout, an error or SIGTERM/SIGINT.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${VIRTUAL_ENV:-}" && -f .venv/bin/activate ]]; then
  . .venv/bin/activate
fi
work=${1:-/tmp/chaos_islands_store}
out=()
[[ -n "${2:-}" ]] && out=(--out "$2")
limit=${CHAOS_TIMEOUT:-5400}
# The script's own deadline ends every wait 60 s before timeout's SIGTERM.
exec timeout -k 60 "$limit" python3 bench/chaos_islands_store.py \
  --work "$work" --deadline $((limit - 60)) "${out[@]}" ${CHAOS_ARGS:-}
