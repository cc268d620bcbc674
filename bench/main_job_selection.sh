#!/usr/bin/env bash
# How experiments/quickstart.py's shape was chosen (docs/quality.md, "The
# main job"): candidate settings of the main job, each on seeds 0, 1, 2,
# scored on data.selection_split (the validation files left out, a share of
# the training files held out instead), never on the validation set. The
# candidates, fixed before the runs (the lever each tests), over
# experiments/quickstart.py:small (the quickstart before, 3M characters):
#   c2x2_top2_3m   the quickstart before (DiPaCo 2x2, top-2 shards)
#   c2x2_top2_all  the same on the whole embedded corpus (more data a path)
#   c4_top1_all    4 paths, one level (no module shared between paths but the
#                  embedding and head), disjoint top-1 shards, whole corpus
#   c4_top2_all    the same with overlapping top-2 shards
#   chosen         c2x2_top2_all with the main job's cost settings (3% held
#                  out, no learned window router), added after the others
# Usage: [NAMES="c4_top1_all ..."] [SEEDS="0 1 2"] bash
#        bench/main_job_selection.sh OUT_DIR [WORK_DIR]
# Writes OUT_DIR/selection.md: per candidate and seed, DiPaCo routed once
# against the dense baseline (perplexity on the held-out training files)
# and the job's wall time.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?OUT_DIR}; work=${2:-/tmp/main_job_selection}
mkdir -p "$out" "$work"
declare -A CANDIDATES=(
  [c2x2_top2_3m]=""
  [c2x2_top2_all]="--config.data.max_corpus_chars=0"
  [c4_top1_all]="--config.data.max_corpus_chars=0 --config.paths.shape=4 --config.routing.train_top_k=1"
  [c4_top2_all]="--config.data.max_corpus_chars=0 --config.paths.shape=4 --config.routing.train_top_k=2"
  [chosen]="--config.data.max_corpus_chars=0 --config.data.validation_fraction=0.03 --config.eval.learned_reroute=False"
)
for name in ${NAMES:-c2x2_top2_3m c2x2_top2_all c4_top1_all c4_top2_all chosen}; do
  for seed in ${SEEDS:-0 1 2}; do
    dir="$work/${name}_s$seed"
    [[ -f "$dir/results.json" ]] && continue
    # shellcheck disable=SC2086
    python3 -m dipaco_jax.main --config=experiments/quickstart.py:small \
      --workdir="$dir" --config.data.selection_split=True \
      --config.seed="$seed" ${CANDIDATES[$name]} > "$work/${name}_s$seed.log" 2>&1 \
      || echo "!!! $name seed $seed failed: $work/${name}_s$seed.log"
  done
done
python3 - "$work" > "$out/selection.md" <<'EOF'
import json, pathlib, sys
work = pathlib.Path(sys.argv[1])
print("| candidate | seed | DiPaCo routed once | dense baseline | DiPaCo vs dense | wall s |")
print("| --- | --- | --- | --- | --- | --- |")
for path in sorted(work.glob("*/results.json")):
  r = json.loads(path.read_text())
  name, seed = path.parent.name.rsplit("_s", 1)
  d = r["models"]["dipaco routed once per document"]["perplexity"]
  b = r["models"]["dense baseline (one path's size)"]["perplexity"]
  wall = json.loads((path.parent / "wall_time.json").read_text())["seconds"]
  print(f"| {name} | {seed} | {d:.2f} | {b:.2f} | {d / b - 1:+.2%} | {wall:.0f} |")
EOF
cat "$out/selection.md"
