#!/bin/bash
# Early stopping's writer, session 19's last change: "round" = this tree with
# fix_es_coalesce.patch reversed (each outer step first waits for the
# previous round's snapshots), "coalesce" = this tree (training never waits;
# a best replaced before it was written is skipped). Same runs as
# ab_early_stopping.sh (bench/scaling.py, 65,536 held-out tokens a path,
# K = 8, 200 steps), DiPaCo 2x2 on 4 GPUs, then on 1 GPU.
# Usage: bash ab_coalesce.sh OUT
set -u
out=${1:?OUT}; mkdir -p "$out"
root=$PWD
rm -rf /tmp/round && mkdir -p /tmp/round && cp -r dipaco_jax bench experiments /tmp/round/
(cd /tmp/round && patch -s -R -p1 < "$root/bench/results/session19_h100x4/fix_es_coalesce.patch") || exit 1
run() {  # tree name gpus es_tokens
  local dir=$1 name=$2 gpus=$3 es=$4 n
  n=$(echo "$gpus" | tr ',' '\n' | wc -l)
  (cd "$dir" && CUDA_VISIBLE_DEVICES=$gpus PYTHONPATH=/tmp/site:$dir:$dir/bench \
    timeout 100 python bench/scaling.py --configs=experiments/dipaco_2x2.py --devices=$n \
    --steps=200 --timeout=95 --set=train.steps_per_dispatch=8 \
    --early_stopping_tokens=$es \
    --out="$out/${name}_g${n}.json") > "$out/${name}_g${n}.log" 2>&1
}
run "$root" none 0,1,2,3 0
run /tmp/round round 0,1,2,3 65536; run "$root" coalesce 0,1,2,3 65536
run "$root" none 3 0 &
run /tmp/round round 0 65536; run "$root" coalesce 0 65536
wait
python - "$out" <<'PY'
import json, sys, glob, os
out = sys.argv[1]
r = {os.path.basename(f)[:-5]: json.load(open(f))["results"][0]
     for f in glob.glob(f"{out}/*.json")}
print("| code | GPUs | loop tokens/s | vs no early stopping | path bests saved |")
print("| --- | --- | --- | --- | --- |")
for n in (4, 1):
  base = r.get(f"none_g{n}")
  for name in ("none", "round", "coalesce"):
    d = r.get(f"{name}_g{n}")
    if d is None or "error" in d or base is None or "error" in base:
      print(f"| {name} | {n} | missing | | |"); continue
    print(f"| {name} | {n} | {d['loop_tokens_per_s']:,.0f} | "
          f"{d['loop_tokens_per_s'] / base['loop_tokens_per_s']:.3f} | "
          f"{d['early_stopping_saves']} |")
PY
