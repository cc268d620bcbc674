#!/usr/bin/env bash
# Three more arms after bench/comm_quality.sh, on the same machine: they
# reuse its data and base in /tmp/cq/diloco_x8 (STEPS=1500,
# MAX_CHARS=150000000 there). Writes $OUT/NAME.{json,log,metrics.jsonl} and
# prints perplexity, final training loss and bytes per worker per round:
#   eager_lr035        delay=eager with outer lr 0.35 (half the default)
#   one_round_int4_ef  one_round + int4 + error feedback
#   lowrank8_ef        lowrank, rank 1-8, + error feedback
# Usage: OUT=DIR bash bench/comm_extra_arms.sh   (~3 min on one H100)
# (bench/comm_quality.sh now keeps its arms in WORK_DIR/arms/.)
set -u
export XLA_PYTHON_CLIENT_PREALLOCATE=false
sp=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
common=(--config=experiments/diloco.py --config.data.corpus=text_files "--config.data.text_glob=$sp/**/*.py" --config.data.max_corpus_chars=150000000 --config.train.num_steps=1500)
share() { for d in data runs/base shards/base; do mkdir -p "/tmp/cq/$1/$(dirname $d)"; cp -r "/tmp/cq/diloco_x8/$d" "/tmp/cq/$1/$d"; done; }
run() { local name=$1; shift; share $name; python3 -m dipaco_jax.main --workdir=/tmp/cq/$name "${common[@]}" "$@" > $OUT/$name.log 2>&1; cp /tmp/cq/$name/results.json $OUT/$name.json; cp /tmp/cq/$name/runs/main/logs/train/metrics.jsonl $OUT/$name.metrics.jsonl; }
run eager_lr035 --config.diloco.delay=eager --config.diloco.outer_lr=0.35 &
run one_round_int4_ef --config.diloco.delay=one_round --config.diloco.compression=int4 --config.diloco.error_feedback=True &
run lowrank8_ef --config.diloco.compression=lowrank --config.diloco.error_feedback=True --config.diloco.compression_rank_max=8 &
wait
for n in eager_lr035 one_round_int4_ef lowrank8_ef; do python3 -c "
import json
d=json.load(open('$OUT/$n.json')); r=d['runs'][-1]; print('$n', round(list(d['models'].values())[0]['perplexity'],3), r['final_loss'], (r.get('bytes_sent') or {}).get('per_worker_round'))" || (echo "$n failed"; grep -v "^[WI][0-9]" $OUT/$n.log | tail -3); done
