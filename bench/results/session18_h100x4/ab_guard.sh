#!/bin/bash
# A/B of the divergence guard's norm read (session 18) on DiPaCo 2x2's
# scaling: "old" = this tree with this folder's fix.patch reversed (the guard reads the
# newest state's norm at each outer step and waits for the device), "new" =
# this tree. 1-GPU runs four at once (one per GPU), then 4-GPU runs one by
# one, old and new interleaved. Usage: bash ab_guard.sh OUT_DIR
set -u
out=${1:?OUT_DIR}; mkdir -p "$out"
root=$PWD
rm -rf /tmp/old && mkdir -p /tmp/old && cp -r dipaco_jax bench experiments /tmp/old/
(cd /tmp/old && patch -s -R -p1 < "$root/bench/results/session18_h100x4/fix.patch") || exit 1
run() {  # tree name gpus k
  local dir=$1 name=$2 gpus=$3 k=$4 n
  n=$(echo "$gpus" | tr ',' '\n' | wc -l)
  (cd "$dir" && CUDA_VISIBLE_DEVICES=$gpus PYTHONPATH=/tmp/site:$dir:$dir/bench \
    python bench/scaling.py --configs=experiments/dipaco_2x2.py --devices=$n \
    --steps=400 --timeout=200 --set=train.steps_per_dispatch=$k \
    --out="$out/${name}_k${k}_g${n}.json") > "$out/${name}_k${k}_g${n}.log" 2>&1
}
run /tmp/old old 0 8 & run "$root" new 1 8 & run /tmp/old old 2 50 & run "$root" new 3 50 &
wait
for k in 8 50; do
  run /tmp/old old 0,1,2,3 $k; run "$root" new 0,1,2,3 $k
done
python - "$out" <<'PY'
import json, sys, glob, os
out = sys.argv[1]
r = {}
for f in sorted(glob.glob(f"{out}/*.json")):
  d = json.load(open(f))["results"][0]
  r[os.path.basename(f)[:-5]] = d
for name in ("old", "new"):
  for k in (8, 50):
    one, four = r.get(f"{name}_k{k}_g1"), r.get(f"{name}_k{k}_g4")
    if not one or not four or "error" in one or "error" in four:
      print(name, k, "missing"); continue
    print(f"{name} K={k}: 1 GPU loop {one['loop_tokens_per_s']:,.0f} bare "
          f"{one['bare_step_tokens_per_s']:,.0f}; 4 GPUs loop "
          f"{four['loop_tokens_per_s']:,.0f} bare {four['bare_step_tokens_per_s']:,.0f}"
          f"; loop x{four['loop_tokens_per_s']/one['loop_tokens_per_s']:.3f} "
          f"bare x{four['bare_step_tokens_per_s']/one['bare_step_tokens_per_s']:.3f}"
          f" loop/bare(4) {four['loop_tokens_per_s']/four['bare_step_tokens_per_s']:.3f}")
PY
