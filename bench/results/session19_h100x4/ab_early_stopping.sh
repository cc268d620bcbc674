#!/bin/bash
# A/B of per-path early stopping's cost in the training loop (session 19).
#   old  = this tree with fix_es_modules.patch and fix_es.patch reversed:
#          each outer step scores every path through a host copy of its
#          parameters and saves every improving path whole, before training
#          goes on;
#   bg   = this tree with fix_es_modules.patch reversed: scored on the
#          devices, whole paths written by a background thread;
#   new  = this tree: as bg, but one snapshot per module (a module shared by
#          several improving paths is written once).
# bench/scaling.py with --early_stopping_tokens=65536 (about 5% of a path's
# shard in the quality runs), K = 8, 200 steps = 4 rounds of H = 50.
# Runs with early stopping go one at a time (they write to one disk); the
# runs without it share the call on GPU 3. Usage: bash ab_early_stopping.sh OUT
set -u
out=${1:?OUT}; mkdir -p "$out"
root=$PWD
here=$root/bench/results/session19_h100x4
for v in old bg; do
  rm -rf /tmp/$v && mkdir -p /tmp/$v && cp -r dipaco_jax bench experiments /tmp/$v/
  (cd /tmp/$v && patch -s -R -p1 < "$here/fix_es_modules.patch") || exit 1
done
(cd /tmp/old && patch -s -R -p1 < "$here/fix_es.patch") || exit 1
run() {  # tree name config gpus es_tokens
  local dir=$1 name=$2 config=$3 gpus=$4 es=$5 n
  n=$(echo "$gpus" | tr ',' '\n' | wc -l)
  (cd "$dir" && CUDA_VISIBLE_DEVICES=$gpus PYTHONPATH=/tmp/site:$dir:$dir/bench \
    timeout 200 python bench/scaling.py --configs=experiments/$config.py --devices=$n \
    --steps=200 --timeout=190 --set=train.steps_per_dispatch=8 \
    --early_stopping_tokens=$es \
    --out="$out/${name}_${config}_g${n}.json") > "$out/${name}_${config}_g${n}.log" 2>&1
}
(run "$root" none dipaco_2x2 3 0; run "$root" none dipaco_4x4 3 0) &
for config in dipaco_2x2 dipaco_4x4; do
  run /tmp/old old $config 0 65536; run /tmp/bg bg $config 0 65536
  run "$root" new $config 0 65536
done
wait
run "$root" none dipaco_2x2 0,1,2,3 0
run /tmp/bg bg dipaco_2x2 0,1,2,3 65536; run "$root" new dipaco_2x2 0,1,2,3 65536
python - "$out" <<'PY'
import json, sys, glob, os
out = sys.argv[1]
print("| code | config | GPUs | loop tokens/s | vs no early stopping | path bests saved | wall s |")
print("| --- | --- | --- | --- | --- | --- | --- |")
r = {}
for f in sorted(glob.glob(f"{out}/*.json")):
  r[os.path.basename(f)[:-5]] = json.load(open(f))["results"][0]
for config in ("dipaco_2x2", "dipaco_4x4"):
  for n in (1, 4):
    base = r.get(f"none_{config}_g{n}")
    for name in ("none", "old", "bg", "new"):
      d = r.get(f"{name}_{config}_g{n}")
      if d is None or "error" in d:
        if d is not None:
          print(f"| {name} | {config} | {n} | failed | | | |")
        continue
      vs = (d["loop_tokens_per_s"] / base["loop_tokens_per_s"]
            if base and "error" not in base else 0)
      print(f"| {name} | {config} | {n} | {d['loop_tokens_per_s']:,.0f} | "
            f"{vs:.3f} | {d['early_stopping_saves']} | {d['wall_s']:.1f} |")
PY
