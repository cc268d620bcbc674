#!/bin/bash
# Early stopping's scoring, three codes in one call (session 20, call 2):
# "seq" = the paths scored one after another (this tree with
# fix_es_gather.patch and fix_es_grouped.patch reversed), "stack" = a group
# at once with its paths stacked on every device and copied to the scoring
# mesh (fix_es_gather.patch reversed; call 1's "grouped"), "gather" = this
# tree (the group gathered from the bank straight into the scoring layout,
# one jitted program). bench/scaling.py, 65,536 held-out tokens a path,
# K = 8, 400 steps, on the GPUs of $GPUS (default 0,1,2,3), runs one at a
# time.
# Usage: [GPUS=0,1] bash ab_gather.sh OUT
set -u
out=${1:?OUT}; mkdir -p "$out"
root=$PWD
gpus=${GPUS:-0,1,2,3}
n=$(echo "$gpus" | tr ',' '\n' | wc -l)
here=$root/bench/results/session20_h100x4
for t in stack seq; do
  rm -rf /tmp/$t && mkdir -p /tmp/$t && cp -r dipaco_jax bench experiments /tmp/$t/
  (cd /tmp/$t && patch -s -R -p1 < "$here/fix_es_gather.patch") || exit 1
done
(cd /tmp/seq && patch -s -R -p1 < "$here/fix_es_grouped.patch") || exit 1
run() {  # tree name config es_tokens
  local dir=$1 name=$2 cfg=$3 es=$4
  (cd "$dir" && CUDA_VISIBLE_DEVICES=$gpus PYTHONPATH=/tmp/site:$dir:$dir/bench \
    timeout 110 python bench/scaling.py --configs=experiments/$cfg.py --devices=$n \
    --steps=400 --timeout=105 --set=train.steps_per_dispatch=8 \
    --early_stopping_tokens=$es \
    --out="$out/${cfg}_${name}_g${n}.json") > "$out/${cfg}_${name}_g${n}.log" 2>&1
}
run "$root" none dipaco_2x2 0
run /tmp/seq seq dipaco_2x2 65536
run /tmp/stack stack dipaco_2x2 65536
run "$root" gather dipaco_2x2 65536
run "$root" none dipaco_4x4 0
run /tmp/seq seq dipaco_4x4 65536
run "$root" gather dipaco_4x4 65536
python - "$out" "$n" <<'PY'
import json, sys, glob, os
out, n = sys.argv[1], sys.argv[2]
r = {}
for f in glob.glob(f"{out}/*.json"):
  try:
    r[os.path.basename(f)[:-5]] = json.load(open(f))["results"][0]
  except Exception as e:  # a run cut short
    print(f, e)
print("| config | code | loop tokens/s | vs no early stopping | path bests saved |")
print("| --- | --- | --- | --- | --- |")
for cfg in ("dipaco_2x2", "dipaco_4x4"):
  base = r.get(f"{cfg}_none_g{n}")
  for name in ("none", "seq", "stack", "gather"):
    d = r.get(f"{cfg}_{name}_g{n}")
    if d is None:
      continue
    if "error" in d or base is None or "error" in base:
      print(f"| {cfg} | {name} | failed | | |"); continue
    print(f"| {cfg} | {name} | {d['loop_tokens_per_s']:,.0f} | "
          f"{d['loop_tokens_per_s'] / base['loop_tokens_per_s']:.3f} | "
          f"{d['early_stopping_saves']} |")
PY
