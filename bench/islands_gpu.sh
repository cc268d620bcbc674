#!/usr/bin/env bash
# The island runtime on GPUs (issue 10's measurements), one call per part.
#
#   bash bench/islands_gpu.sh paths256 OUT   # one GPU: 256 paths, store I/O
#   bash bench/islands_gpu.sh diloco2 OUT    # two GPUs: DiLoCo x2 islands
#
# paths256: experiments/dipaco_2x2.py at 16x16 with a small model (4 layers
#   of d_model 256, batch 4) through islands: one worker holding 32 paths a
#   task (the SPMD runtime vmaps all 256 workers and their AdamW states into
#   one program, which runs out of memory on one 80 GB H100); then the
#   store's write/read throughput against dd on the same disk.
# diloco2: DiLoCo x2 on the dense.py model, two worker processes with one
#   GPU each through a local-disk store, against the SPMD run of one
#   replica on one GPU of the same machine (same base, same steps), one
#   island run per arm of ARMS ("DELAY:H" words, default "none:100";
#   one_round is DiLoCoX's overlap); then the store's throughput against
#   dd; `python bench/islands_speedup.py OUT` makes the table.
# Env: STEPS, ARMS, MAX_CHARS, EXTRA (more flags for every island run and
# the SPMD run, e.g. the outer optimizer).
# Writes OUT/<part>.log, OUT/*.json (results.json and islands stats).
set -uo pipefail
part=${1:?paths256|diloco2}; out=${2:?OUT}
mkdir -p "$out"; log="$out/$part.log"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
sp=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
corpus=(--config.data.corpus=text_files "--config.data.text_glob=$sp/**/*.py"
        --config.data.max_corpus_chars=${MAX_CHARS:-40000000})
case $part in
  paths256)
    w=/tmp/paths256; rm -rf $w
    /usr/bin/time -v python3 -m dipaco_jax.islands \
      --config=experiments/dipaco_2x2.py --workdir=$w "${corpus[@]}" \
      --num_workers=1 --paths_per_task=32 \
      --config.paths.shape=16x16 --config.model.num_layers=4 \
      --config.model.d_model=256 --config.model.num_heads=4 \
      --config.model.head_dim=64 --config.model.mlp_dim=1024 \
      --config.train.batch_size=4 --config.base.num_steps=100 \
      --config.train.num_steps=${STEPS:-100} --config.diloco.inner_steps=50 \
      --config.eval.learned_reroute=False \
      >> "$log" 2>&1
    echo "exit $?" >> "$log"
    cp $w/results.json "$out/paths256_results.json"
    cp $w/islands/dipaco/stats.json "$out/paths256_stats.json"
    df -h /tmp >> "$log"
    python3 bench/store_throughput.py --dir=/tmp/store_bench --mib=2048 \
      > "$out/store_throughput.json" 2>> "$log"
    cat "$out/store_throughput.json" >> "$log" ;;
  diloco2)
    a=/tmp/diloco_spmd1; b=/tmp/diloco_islands2; rm -rf $a $b
    read -r -a extra <<< "${EXTRA:-}"
    steps=(--config.train.num_steps=${STEPS:-500} --config.base.num_steps=200
           "${extra[@]}")
    CUDA_VISIBLE_DEVICES=0 python3 -m dipaco_jax.main \
      --config=experiments/dense.py --workdir=$a "${corpus[@]}" "${steps[@]}" \
      >> "$log" 2>&1
    echo "exit spmd $?" >> "$log"
    mkdir -p $b/runs && cp -r $a/data $b/ && cp -r $a/runs/base $b/runs/ \
      && cp -r $a/shards $b/ 2>/dev/null
    cp $a/results.json "$out/diloco_spmd1_results.json"
    cp $a/runs/main/logs/train/metrics.jsonl "$out/diloco_spmd1_metrics.jsonl"
    for arm in ${ARMS:-none:100}; do  # DELAY:H (H: inner steps per round)
      delay=${arm%%:*}; h=${arm##*:}; tag=${delay}_h$h
      rm -rf $b/islands $b/runs/main $b/results.json
      python3 -m dipaco_jax.islands --config=experiments/dense.py \
        --workdir=$b "${corpus[@]}" "${steps[@]}" \
        --config.paths.num_replicas=2 --config.diloco.inner_steps=$h \
        --config.diloco.delay=$delay \
        --num_workers=2 --gpus_per_worker_machine=2 >> "$log" 2>&1
      echo "exit islands $tag $?" >> "$log"
      cp $b/results.json "$out/diloco_islands2_${tag}_results.json"
      cp $b/islands/main/stats.json "$out/diloco_islands2_${tag}_stats.json"
      cp $b/plots/islands_main.png "$out/diloco_islands2_${tag}_timeline.png"
    done
    python3 bench/store_throughput.py --dir=/tmp/store_bench --mib=2048 \
      > "$out/store_throughput.json" 2>> "$log"
    cat "$out/store_throughput.json" >> "$log" ;;
esac
tail -40 "$log"
