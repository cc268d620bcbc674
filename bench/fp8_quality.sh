#!/usr/bin/env bash
# The dense.py model trained in bf16 and in FP8 (config.model.fp8) for the
# same steps on the same corpus; prints both validation perplexities.
# Usage: [STEPS=1000] [BASE=300] [MAX_CHARS=30000000] bash bench/fp8_quality.sh OUT [WORK]
set -uo pipefail
out=${1:?OUT_DIR}; work=${2:-/tmp/fp8_quality}
mkdir -p "$out" "$work"
sp=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
common=(--config=experiments/dense.py --config.data.corpus=text_files
        "--config.data.text_glob=$sp/**/*.py"
        --config.data.max_corpus_chars=${MAX_CHARS:-30000000}
        --config.train.num_steps=${STEPS:-1000}
        --config.base.num_steps=${BASE:-300} --config.eval.reroute_every=0)
for arm in bf16 fp8; do
  flag=(); [[ $arm == fp8 ]] && flag=(--config.model.fp8=True)
  if [[ $arm == fp8 ]]; then  # The same tokenized data as the bf16 run.
    mkdir -p "$work/fp8"; cp -r "$work/bf16/data" "$work/fp8/" 2>/dev/null
  fi
  echo "=== $arm ($(date -u +%H:%M:%S))" | tee -a "$out/fp8_quality.log"
  python3 -m dipaco_jax.main --workdir="$work/$arm" "${common[@]}" "${flag[@]}" \
    2>&1 | grep -v '^[WI][0-9]\{4\} ' >> "$out/fp8_quality.log"
  cp "$work/$arm/results.json" "$out/$arm.json" 2>/dev/null \
    || echo "!!! $arm wrote no results" | tee -a "$out/fp8_quality.log"
done
python3 - "$out" <<'PY'
import json, sys
for arm in ("bf16", "fp8"):
  try:
    r = json.load(open(f"{sys.argv[1]}/{arm}.json"))
  except OSError:
    continue
  print(arm, json.dumps(r.get("models", r))[:600])
PY
