#!/usr/bin/env bash
# Do wider XLA:GPU command buffers (CUDA graphs) help the small-kernel steps
# of the scaling table (docs/performance.md)? `train.steps_per_dispatch=K`
# runs K inner steps as one jitted scan; by default XLA records fusions,
# GEMMs and custom calls into command buffers but launches the scan's while
# loop and every collective from the host, splitting each step into several
# graphs.
#   [FLAGSETS="base while coll while_coll"] [STEPS=400] [K=8] \
#     bash bench/cmdbuf_flags.sh OUT
# Needs 4 GPUs. For each flag set (in its own processes, XLA_FLAGS set):
# DiPaCo 2x2 and dense on 1 GPU (one flag set per GPU, all at once), then
# dense on 2 GPUs (two flag sets at once, GPUs 0,1 and 2,3), then 2x2 on 4
# GPUs (one at a time). Each is `bench/scaling.py`, so ratios compare a flag
# set's multi-GPU figure with its own 1-GPU figure, and with the base
# flag set's, within this one call. Writes OUT/<set>_<config>_g<n>.json,
# .log and OUT/summary.md.
#   base        no XLA_FLAGS (the defaults)
#   while       + the scan's while loop inside the command buffer
#   coll        + collectives inside the command buffer
#   while_coll  both
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?OUT}; mkdir -p "$out"
declare -A flags=(
  [base]=""
  [while]="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"
  [coll]="--xla_gpu_enable_command_buffer=+COLLECTIVES"
  [while_coll]="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL,+COLLECTIVES"
)
read -r -a sets <<< "${FLAGSETS:-base while coll while_coll}"
one() {  # set, config name, GPUs
  local n; n=$(echo "$3" | tr ',' '\n' | wc -l)
  XLA_FLAGS="${flags[$1]}" CUDA_VISIBLE_DEVICES=$3 python3 bench/scaling.py \
    "--configs=experiments/$2.py" "--devices=$n" "--steps=${STEPS:-400}" \
    --timeout=200 "--set=train.steps_per_dispatch=${K:-8}" \
    "--out=$out/$1_$2_g$n.json" > "$out/$1_$2_g$n.log" 2>&1
}
for i in "${!sets[@]}"; do  # 1 GPU: one flag set per GPU.
  (one "${sets[i]}" dipaco_2x2 "$i"; one "${sets[i]}" dense "$i") &
done
wait
for ((i = 0; i < ${#sets[@]}; i += 2)); do  # Dense on 2 GPUs, two at once.
  one "${sets[i]}" dense 0,1 &
  [[ -n "${sets[i + 1]:-}" ]] && one "${sets[i + 1]}" dense 2,3 &
  wait
done
for s in "${sets[@]}"; do one "$s" dipaco_2x2 0,1,2,3; done
python3 - "$out" "${sets[*]}" <<'PY' | tee "$out/summary.md"
import json, pathlib, sys
out, sets = pathlib.Path(sys.argv[1]), sys.argv[2].split()
def get(s, config, n):
  try:
    r = json.loads((out / f"{s}_{config}_g{n}.json").read_text())["results"][0]
    return None if "error" in r else r
  except (OSError, ValueError, KeyError, IndexError):
    return None
print("| flags | config | GPUs | loop tokens/s | x its 1 GPU | bare step ms |"
      " bare x its 1 GPU | loop vs base |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for config, n in (("dipaco_2x2", 1), ("dipaco_2x2", 4), ("dense", 1),
                  ("dense", 2)):
  base = get("base", config, n)
  for s in sets:
    r, one = get(s, config, n), get(s, config, 1)
    if r is None:
      print(f"| {s} | {config} | {n} | failed (see {s}_{config}_g{n}.log) |"
            " | | | |")
      continue
    x = r["loop_tokens_per_s"] / one["loop_tokens_per_s"] if one else 0
    bx = (r["bare_step_tokens_per_s"] / one["bare_step_tokens_per_s"]
          if one else 0)
    vs = r["loop_tokens_per_s"] / base["loop_tokens_per_s"] if base else 0
    print(f"| {s} | {config} | {n} | {r['loop_tokens_per_s']:,.0f} | {x:.2f} |"
          f" {r['bare_step_ms']:.2f} | {bx:.2f} | {vs:.3f} |")
PY
