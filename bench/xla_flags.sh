#!/usr/bin/env bash
# Which XLA:GPU flags move the inner step at the paper's path shape
# (the goal: "XLA GPU flags that help, stating which and why").
#   [GPUS=0,1,2,3] [STEPS=10] [ARGS="more step_throughput flags"] \
#     [NAMES="lhs exhaustive"] bash bench/xla_flags.sh OUT
# Runs bench/step_throughput.py (--paths=1 --no_plain, batch 16) once per
# flag set below, each in its own process with that XLA_FLAGS, spread over
# GPUS (one set per GPU at a time; busy neighbours cost nothing:
# docs/performance.md). Every wave starts with a no-flag run on each of
# its GPUs, so each flag set is compared with the baseline of its own GPU
# and wave. A flag this
# XLA does not know fails its run ("Unknown flags in XLA_FLAGS"): its row
# says so. Writes OUT/<name>.json, OUT/<name>.log and OUT/summary.md.
#   cublaslt        GEMMs through cuBLASLt, whose epilogues can take a
#                   bias or an activation (elementwise work now separate)
#   cudnn_gemm2     cuDNN GEMM fusions (level 2: with elementwise producers)
#   triton_any      every GEMM through Triton, fusible with its neighbours
#   no_triton       no Triton GEMMs (cuBLAS only)
#   lhs             the latency-hiding scheduler (no collectives here: a
#                   control, expected to change nothing)
#   exhaustive      the exhaustive tiling search of Triton's autotuner
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?OUT}; mkdir -p "$out"
IFS=, read -r -a gpus <<< "${GPUS:-0,1,2,3}"
declare -A flags=(
  [cublaslt]="--xla_gpu_enable_cublaslt=true"
  [cudnn_gemm2]="--xla_gpu_cudnn_gemm_fusion_level=2"
  [triton_any]="--xla_gpu_triton_gemm_any=true"
  [no_triton]="--xla_gpu_enable_triton_gemm=false"
  [lhs]="--xla_gpu_enable_latency_hiding_scheduler=true"
  [exhaustive]="--xla_gpu_exhaustive_tiling_search=true"
)
read -r -a names <<< \
  "${NAMES:-cublaslt cudnn_gemm2 triton_any no_triton lhs exhaustive}"
one() {  # name, GPU, flags
  XLA_FLAGS="$3" CUDA_VISIBLE_DEVICES=$2 python3 bench/step_throughput.py \
    --paths=1 --no_plain --batch=16 "--steps=${STEPS:-10}" ${ARGS:-} \
    "--out=$out/$1.json" > "$out/$1.log" 2>&1
}
n=${#gpus[@]}; wave=0
for ((i = 0; i < ${#names[@]}; i += n)); do
  for ((j = 0; j < n && i + j < ${#names[@]}; j++)); do
    (one "base_w${wave}_g${gpus[j]}" "${gpus[j]}" "";
     one "${names[i + j]}" "${gpus[j]}" "${flags[${names[i + j]}]}") &
  done
  wait; wave=$((wave + 1))
done
python3 - "$out" "${names[*]}" "${gpus[*]}" <<'PY' | tee "$out/summary.md"
import json, pathlib, sys
out, names, gpus = pathlib.Path(sys.argv[1]), sys.argv[2].split(), sys.argv[3].split()
def mfu(name):
  try:
    return json.loads((out / f"{name}.json").read_text())["results"][0]["mfu"]
  except (OSError, ValueError, KeyError, IndexError):
    return None
print("| flags | MFU | its GPU's no-flag run | ratio |")
print("| --- | --- | --- | --- |")
for i, name in enumerate(names):
  wave, gpu = divmod(i, len(gpus))
  base = mfu(f"base_w{wave}_g{gpus[gpu]}")
  got = mfu(name)
  if got is None:
    tail = (out / f"{name}.log").read_text().strip().splitlines()[-1:]
    print(f"| {name} | failed: {tail[0][:120] if tail else '?'} | | |")
  else:
    ratio = f"{got / base:.3f}" if base else ""
    print(f"| {name} | {got:.2%} | {base:.2%} | {ratio} |" if base else
          f"| {name} | {got:.2%} | failed | |")
PY
