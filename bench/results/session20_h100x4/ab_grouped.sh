#!/bin/bash
# Early stopping's grouped scoring, session 19's last unmeasured change.
# Call 1: "seq" = the tree with fix_es_grouped.patch reversed (the paths
# scored one after another, session 19's measured "coalesce" code),
# "grouped" = the tree at f9134e4 (a group of paths at once, one per
# device, their parameters stacked on every device). Call 2 (ab_gather.sh)
# reruns it after the gather change. bench/scaling.py, 65,536
# held-out tokens a path, K = 8, 400 steps (8 rounds of H = 50). Runs with
# early stopping one at a time (they write snapshots to the same disk); the
# 1-GPU runs without it on GPU 3 meanwhile.
# Usage: bash ab_grouped.sh OUT
set -u
out=${1:?OUT}; mkdir -p "$out"
root=$PWD
rm -rf /tmp/seq && mkdir -p /tmp/seq && cp -r dipaco_jax bench experiments /tmp/seq/
(cd /tmp/seq && patch -s -R -p1 < "$root/bench/results/session20_h100x4/fix_es_grouped.patch") || exit 1
run() {  # tree name config gpus es_tokens
  local dir=$1 name=$2 cfg=$3 gpus=$4 es=$5 n
  n=$(echo "$gpus" | tr ',' '\n' | wc -l)
  (cd "$dir" && CUDA_VISIBLE_DEVICES=$gpus PYTHONPATH=/tmp/site:$dir:$dir/bench \
    timeout 110 python bench/scaling.py --configs=experiments/$cfg.py --devices=$n \
    --steps=400 --timeout=105 --set=train.steps_per_dispatch=8 \
    --early_stopping_tokens=$es \
    --out="$out/${cfg}_${name}_g${n}.json") > "$out/${cfg}_${name}_g${n}.log" 2>&1
}
run "$root" none dipaco_2x2 0,1,2,3 0
run /tmp/seq seq dipaco_2x2 0,1,2,3 65536
run "$root" grouped dipaco_2x2 0,1,2,3 65536
run "$root" none dipaco_4x4 0,1,2,3 0
run "$root" grouped dipaco_4x4 0,1,2,3 65536
(run "$root" none dipaco_2x2 3 0; run "$root" none dipaco_4x4 3 0) &
run "$root" grouped dipaco_2x2 0 65536
run "$root" grouped dipaco_4x4 0 65536
wait
python - "$out" <<'PY'
import json, sys, glob, os
out = sys.argv[1]
r = {}
for f in glob.glob(f"{out}/*.json"):
  try:
    r[os.path.basename(f)[:-5]] = json.load(open(f))["results"][0]
  except Exception as e:  # a run cut short
    print(f, e)
print("| config | GPUs | code | loop tokens/s | vs no early stopping | path bests saved |")
print("| --- | --- | --- | --- | --- | --- |")
for cfg in ("dipaco_2x2", "dipaco_4x4"):
  for n in (4, 1):
    base = r.get(f"{cfg}_none_g{n}")
    for name in ("none", "seq", "grouped"):
      d = r.get(f"{cfg}_{name}_g{n}")
      if d is None:
        continue
      if "error" in d or base is None or "error" in base:
        print(f"| {cfg} | {n} | {name} | failed | | |"); continue
      print(f"| {cfg} | {n} | {name} | {d['loop_tokens_per_s']:,.0f} | "
            f"{d['loop_tokens_per_s'] / base['loop_tokens_per_s']:.3f} | "
            f"{d['early_stopping_saves']} |")
PY
