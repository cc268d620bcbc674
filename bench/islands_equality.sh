#!/usr/bin/env bash
# Islands against the SPMD runtime on one machine, at pipeline level: the
# main job, then the island runtime on a copy of its workdir (the same data,
# base, shards and dense baseline), one worker holding every path; prints
# both runs' DiPaCo losses per logged step / round and their routed-once
# perplexity. On CPU they agree to float rounding (tests/test_islands.py).
#   bash bench/islands_equality.sh OUT [--config.X=Y ...]
# CONFIG: the experiment (default experiments/quickstart.py:small); the corpus is
# cut to 600k characters, 40 base steps and 100 DiPaCo steps unless the
# extra flags say otherwise.
set -u
out=${1:?OUT}; shift; mkdir -p "$out"
a=$out/spmd; b=$out/islands; rm -rf "$a" "$b"; mkdir -p "$b/runs"
common=(--config=${CONFIG:-experiments/quickstart.py:small}
        --config.data.max_corpus_chars=600000 --config.base.num_steps=40
        --config.train.num_steps=100 --config.eval.learned_reroute=False
        --config.train.log_every=10 "$@")
python3 -m dipaco_jax.main "${common[@]}" --workdir="$a" > "$out/spmd.log" 2>&1
echo "spmd exit $?"
cp -r "$a/data" "$b/"; cp -r "$a/runs/base" "$b/runs/"
for d in shards router splits.json runs/dense; do
  [[ -e $a/$d ]] && cp -r "$a/$d" "$b/$d"
done
python3 -m dipaco_jax.islands "${common[@]}" --workdir="$b" --num_workers=1 \
  --paths_per_task=4 > "$out/islands.log" 2>&1
echo "islands exit $?"
grep -h "routed once per" "$out/spmd.log" "$out/islands.log"
grep -h "loss" "$b/islands/dipaco/logs/worker_w0.log"
python3 - "$a/runs/dipaco/logs/train/metrics.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
  d = json.loads(line)
  print("spmd step", d["step"], "loss", round(d["loss"], 5),
        [round(d[f"loss/worker_{w}"], 4) for w in range(4)])
PY
