#!/usr/bin/env bash
# The island runtime on GPUs (docs/islands.md), one device run per part.
#
#   bash bench/islands_gpu.sh paths256 OUT   # one GPU: 256 paths, store I/O
#   bash bench/islands_gpu.sh diloco2 OUT    # two GPUs: DiLoCo x2 islands
#   bash bench/islands_gpu.sh diloco4 OUT    # four GPUs: DiLoCo x4 islands
#   bash bench/islands_gpu.sh dipaco4 OUT    # four GPUs: DiPaCo 2x2 islands
#   bash bench/islands_gpu.sh dipaco2 OUT    # two GPUs: 2 workers of 2 paths
#   bash bench/islands_gpu.sh dipaco1 OUT    # one GPU: the runtime's cost
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
# diloco4: the same with 4 replicas, 4 workers on 4 GPUs.
# dipaco4: experiments/dipaco_2x2.py, 4 workers holding one path each,
#   against the SPMD run of the same config on one GPU (its 4 paths
#   vmapped, and its dense baseline: one path's model alone).
# dipaco2: the same with 2 workers holding 2 paths each, on 2 GPUs.
# dipaco1: the same config, one worker holding all 4 paths on the GPU the
#   SPMD run used: the same inner program, so the ratio is what the island
#   runtime costs per round (reads, writes, the outer step through the
#   store) and its phase tables say where.
# ARMS words are DELAY:H, DELAY:H:K or DELAY:H:K:E (DELAY none, one_round,
# eager, or overlap/TAU: delay=overlap, overlap_steps=TAU), K: kill -9
# worker w1 K seconds after the first heartbeat (the launcher restarts it; compare
# the wall time with the same arm without K); E: --inner_state_every=E
# (the AdamW states committed every E rounds; none:1000::4 without a kill).
# An arm named twice runs twice (the second's files end in _rep2).
# DETERMINISTIC=1 adds --xla_gpu_deterministic_ops=true to XLA_FLAGS (every
# run of the call), to tell GPU non-determinism from a resume that differs.
# TRAIN_ONLY=1 stops each island run once its training stage has written
# its stats and timeline (no results.json, so no perplexity): the dense
# baseline a DiPaCo run trains next takes STEPS steps, and the SPMD run's
# copy of it (SPMD_STEPS) is reused only when the two are equal.
# ARMS=" " (a space) runs no island arm (the SPMD run alone, for SKIP_SPMD).
# PATH1=1 (dipaco4) also runs one path as a worker holds it, SPMD on one GPU
# (paths.shape=1x1 of the same config: its two slots of 4 layers, H of the
# first arm, SPMD_STEPS steps, the same data and base): the baseline whose
# program equals the workers'; the dense baseline's one slot of 8 layers
# runs about 4% faster on an H100 (docs/performance.md).
# PATHS_PER_TASK (dipaco parts): paths a task holds, default 4 / N; 1 on
# dipaco1 runs the 1-path program the workers of dipaco4 run, on one GPU.
# PROFILE=START:COUNT traces those inner steps (config.train.profile_steps)
# in the SPMD runs and in each worker that runs them, and writes each
# trace's idle gaps (bench/trace_gaps.py) as OUT/*_gaps.{txt,json}.
# SPMD_H: the SPMD run's H (default: the first arm's).
# Env: STEPS, ARMS, SPMD_H, DETERMINISTIC, MAX_CHARS, PATH1, PATH1_H, PATHS_PER_TASK, SKIP_SPMD (reuse /tmp/PART_spmd1), SKIP_STORE, EXTRA (more flags for every island run and
# the SPMD run, e.g. the outer optimizer), GPUS (the GPUs to use, e.g.
# "0,1": the SPMD run on the first, worker i on the i-th; default 0..N-1),
# so another job can use the machine's other GPUs meanwhile; SPMD_STEPS
# (the SPMD run's steps, default STEPS: its tokens/s is the median of its
# progress rows after the first, so a shorter run measures the same rate
# in less time; 300 or more: at 100 the one row left holds the run's end).
# Writes OUT/<part>.log, OUT/*.json (results.json and islands stats), each
# island arm's role logs as a .tgz. The device tool returns only a few
# files from $OUT: run it on a folder and tar that into $OUT. Run from the
# repository root; wheels carried in wheels/ are installed first
# (bench/carried_wheels.sh).
set -uo pipefail
source "$(dirname "$0")/carried_wheels.sh"
part=${1:?paths256|diloco2|diloco4|dipaco4|dipaco2|dipaco1}; out=${2:?OUT}
mkdir -p "$out"; log="$out/$part.log"
# A run cut short (`timeout`, ^C) takes its training processes with it:
# once (4 x H100, 2026-11-27) an island run outlived its script and held
# the next run's store. Every process this script starts names a
# folder under /tmp/${part}_ on its command line.
cleanup() { pkill -9 -f "dipaco_jax[.].*/tmp/${part}_"; }
trap cleanup EXIT; trap 'exit 143' TERM INT
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
[[ -n "${DETERMINISTIC:-}" ]] && \
  export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_deterministic_ops=true"
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
  diloco2|diloco4|dipaco4|dipaco2|dipaco1)
    # N worker processes, one GPU each (N = the part's last digit).
    n=${part: -1}; a=/tmp/${part}_spmd1; b=/tmp/${part}_islands
    gpus=${GPUS:-$(seq -s, 0 $((n - 1)))}
    if [[ $part == dipaco* ]]; then  # 4 paths, 4 / N paths per worker
      cfg=experiments/dipaco_2x2.py; name=dipaco; run=dipaco
      shape=(--paths_per_task=${PATHS_PER_TASK:-$((4 / n))})
    else
      cfg=experiments/dense.py; name=diloco; run=main
      shape=(--config.paths.num_replicas=$n)
    fi
    read -r -a extra <<< "${EXTRA:-}"
    steps=(--config.train.num_steps=${STEPS:-500} --config.base.num_steps=200
           ${PROFILE:+--config.train.profile_steps=$PROFILE} "${extra[@]}")
    # The SPMD run at the first arm's H (SPMD_H overrides): its perplexity
    # is comparable with the arms of that H only (an SPMD run at the
    # config's H = 50 against islands at H = 100 once read as a 1.9% gap
    # of the island runtime).
    first=${ARMS:-none:100}; IFS=: read -r _ h1 _ <<< "${first%% *}"
    spmd_h=${SPMD_H:-$h1}
    if [[ -z "${SKIP_SPMD:-}" || ! -f $a/results.json ]]; then
      rm -rf $a
      CUDA_VISIBLE_DEVICES=${gpus%%,*} python3 -m dipaco_jax.main \
        --config=$cfg --workdir=$a "${corpus[@]}" "${steps[@]}" \
        ${SPMD_STEPS:+--config.train.num_steps=$SPMD_STEPS} \
        ${spmd_h:+--config.diloco.inner_steps=$spmd_h} \
        >> "$log" 2>&1
      echo "exit spmd $?" >> "$log"
    fi
    rm -rf $b; mkdir -p $b/runs
    cp -r $a/data $a/runs/base $b/ 2>/dev/null; mv $b/base $b/runs/
    for d in shards router splits.json runs/dense; do
      [[ -e $a/$d ]] && cp -r $a/$d $b/$d
    done
    if [[ $part == dipaco* && -n "${PATH1:-}" ]]; then
      p1=/tmp/${part}_path1; rm -rf $p1; mkdir -p $p1/runs
      cp -r $a/data $p1/; cp -r $a/runs/base $p1/runs/
      h1=${PATH1_H:-$h1}  # PATH1_H: its H when ARMS=" " (no island arm)
      CUDA_VISIBLE_DEVICES=${gpus%%,*} python3 -m dipaco_jax.main \
        --config=$cfg --workdir=$p1 "${corpus[@]}" "${steps[@]}" \
        ${SPMD_STEPS:+--config.train.num_steps=$SPMD_STEPS} \
        --config.paths.shape=1x1 ${h1:+--config.diloco.inner_steps=$h1} \
        >> "$log" 2>&1
      echo "exit path1 $?" >> "$log"
      cp $p1/runs/main/logs/train/metrics.jsonl \
        "$out/${name}_path1_metrics.jsonl"
    fi
    cp $a/results.json "$out/${name}_spmd1_results.json"
    cp $a/runs/$run/logs/train/metrics.jsonl "$out/${name}_spmd1_metrics.jsonl"
    [[ $run == dipaco ]] && cp $a/runs/dense/logs/train/metrics.jsonl \
      "$out/${name}_dense1_metrics.jsonl"
    if [[ -n "${PROFILE:-}" ]]; then  # The SPMD runs' traces, summarized.
      for r in $run dense; do
        [[ -d $a/runs/$r/logs/profile ]] && python3 bench/trace_gaps.py \
          $a/runs/$r/logs/profile --out="$out/${name}_spmd1_${r}_gaps.json" \
          > "$out/${name}_spmd1_${r}_gaps.txt" 2>&1
      done
    fi
    # ARMS: DELAY:H[:K[:E]] (H inner steps per round; K: kill -9 worker w1
    # K seconds after the workers' first heartbeat, the launcher restarts
    # it; E: --inner_state_every=E, e.g. none:1000::4 without a kill).
    for arm in ${ARMS:-none:100}; do
      IFS=: read -r delay h kill every <<< "$arm"
      # DELAY overlap/TAU: delay=overlap with overlap_steps=TAU.
      IFS=/ read -r delay tau <<< "$delay"
      tag=${delay}${tau:+_tau$tau}_h$h${kill:+_kill$kill}${every:+_every$every}
      # An arm named twice runs twice (is the calm run reproducible?).
      rep=1; base_tag=$tag
      while [[ -e "$out/${name}_islands${n}_${tag}_stats.json" ]]; do
        rep=$((rep + 1)); tag=${base_tag}_rep$rep
      done
      rm -rf $b/islands $b/runs/$run $b/results.json $b/plots/islands_$run.png
      CUDA_VISIBLE_DEVICES=$gpus python3 -m dipaco_jax.islands --config=$cfg \
        --workdir=$b "${corpus[@]}" "${steps[@]}" "${shape[@]}" \
        --config.diloco.inner_steps=$h --config.diloco.delay=$delay \
        ${tau:+--config.diloco.overlap_steps=$tau} \
        ${every:+--inner_state_every=$every} \
        --num_workers=$n --gpus_per_worker_machine=$n >> "$log" 2>&1 &
      job=$!
      if [[ -n $kill ]]; then
        for _ in $(seq 900); do
          [[ -d $b/islands/$run/control/heartbeat ]] && break; sleep 0.2
        done
        sleep "$kill"
        pkill -9 -f "dipaco_jax.islands.worker --store=$b/islands/$run --worker_id=w1" \
          && echo "killed w1 at $(date +%s.%N)" | tee -a "$log" \
          > "$out/${name}_islands${n}_${tag}_kill.txt"
      fi
      if [[ -n "${TRAIN_ONLY:-}" ]]; then
        # Stop once the islands' stats and timeline exist: the stages after
        # (the dense baseline, evaluation) are not what this bench measures.
        while kill -0 $job 2>/dev/null \
            && [[ ! -e $b/plots/islands_$run.png ]]; do sleep 1; done
        sleep 1; pkill -9 -P $job; kill -9 $job 2>/dev/null
      fi
      wait $job; echo "exit islands $tag $?" >> "$log"
      cp $b/results.json "$out/${name}_islands${n}_${tag}_results.json"
      cp $b/islands/$run/stats.json "$out/${name}_islands${n}_${tag}_stats.json"
      cp $b/plots/islands_$run.png "$out/${name}_islands${n}_${tag}_timeline.png"
      # The roles' own logs (a worker's traceback lives only there).
      tar czf "$out/${name}_islands${n}_${tag}_logs.tgz" --exclude=profile \
        -C $b/islands/$run logs
      for d in $b/islands/$run/logs/profile/worker_*; do  # PROFILE's traces
        [[ -d $d ]] && python3 bench/trace_gaps.py $d \
          --out="$out/${name}_islands${n}_${tag}_$(basename $d)_gaps.json" \
          > "$out/${name}_islands${n}_${tag}_$(basename $d)_gaps.txt" 2>&1
      done
    done
    if [[ -z "${SKIP_STORE:-}" ]]; then
      python3 bench/store_throughput.py --dir=/tmp/store_bench --mib=2048 \
        > "$out/store_throughput.json" 2>> "$log"
      cat "$out/store_throughput.json" >> "$log"
    fi ;;
esac
tail -40 "$log"
