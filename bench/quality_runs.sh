#!/usr/bin/env bash
# The DiPaCo evidence of docs/quality.md, on one GPU: DiPaCo 2x2 and 4x4 vs
# the dense baseline (routed once / re-routed / oracle). The DiLoCo evidence
# is bench/diloco_runs.sh.
# Usage: [RUNS="dipaco_2x2 dipaco_4x4 dipaco_4x4_es_disc"] \
#        bash bench/quality_runs.sh OUT [WORK]
# EXTRA: main.py flags added to every run (e.g.
# "--config.eval.dump_reroute_data=True" for bench/window_router_study.py).
# Writes OUT/<run>.json (each run's results.json) and OUT/runs.log.
set -uo pipefail
out=${1:?OUT_DIR}; work=${2:-/tmp/dipaco_quality}
runs=${RUNS:-dipaco_2x2 dipaco_4x4}
mkdir -p "$out" "$work"
log="$out/runs.log"
# The GPU image's standard library is small (about 2.4M tokens), too small
# for 16 paths without many epochs: train on the image's
# site-packages Python source instead (capped, deterministic).
sp=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
corpus=(--config.data.corpus=text_files "--config.data.text_glob=$sp/**/*.py"
        --config.data.max_corpus_chars=${MAX_CHARS:-80000000})
first=""
run() {  # name, then main.py arguments; later runs reuse the first's data
  local name=$1; shift
  if [[ -n "$first" ]]; then
    mkdir -p "$work/$name"; cp -r "$work/$first/data" "$work/$name/"
  else
    first=$name
  fi
  echo "=== $name: $* ($(date -u +%H:%M:%S))" | tee -a "$log"
  python3 -m dipaco_jax.main --workdir="$work/$name" "$@" "${corpus[@]}" \
    ${EXTRA:-} \
    >> "$log" 2>&1
  cp "$work/$name/results.json" "$out/$name.json" 2>/dev/null \
    || echo "!!! $name wrote no results" | tee -a "$log"
}
for name in $runs; do
  case $name in
    dipaco_2x2) run dipaco_2x2 --config=experiments/dipaco_2x2.py ;;
    dipaco_4x4)
      # 4x4 forks from the same base, compares with the same dense baseline.
      if [[ -d "$work/dipaco_2x2/runs/base" ]]; then
        for d in runs/base runs/dense shards/base shards/dense; do
          mkdir -p "$work/dipaco_4x4/$(dirname $d)"
          cp -r "$work/dipaco_2x2/$d" "$work/dipaco_4x4/$d"
        done
      fi
      # With the larger dense baselines (2x and 4x one path's
      # non-embedding parameters, and one path's size at DiPaCo's FLOPs).
      run dipaco_4x4 --config=experiments/dipaco_4x4.py \
        --config.eval.dense_scales=2,4 --config.eval.dense_same_flops=True
      cp "$work/dipaco_4x4/plots/"*.png "$out/" 2>/dev/null ;;
    dipaco_4x4_es_disc)
      # The paper's full recipe: per-path early stopping and one
      # discriminative phase (250 more steps). Its own base: the
      # early-stopping documents are held out of the base's training too.
      run dipaco_4x4_es_disc --config=experiments/dipaco_4x4.py \
        --config.eval.early_stopping=True \
        --config.routing.discriminative_steps=250 ;;
  esac
done
echo "=== done ($(date -u +%H:%M:%S))" | tee -a "$log"
