# Sourced by bench/comm_quality.sh, comm_sweep.sh and comm_dipaco.sh: the
# arms' folders and shared flags (setup_arms), one arm's run and the
# sharing of the base between arms. Expects $out and $work, and the array
# ARMS (name -> its flags) before run_lanes. With GPUS="0,1,2,3" the lanes spread over
# those GPUs (lane i on the (i mod 4)-th; the baseline and the combined arm
# on the first), one CUDA_VISIBLE_DEVICES each, instead of sharing one GPU.
IFS=, read -r -a _gpus <<< "${GPUS:-}"
# Makes $out, $work and $arms, sets $lanes, $log and `common`: CONFIG on
# the text corpus of this Python's site-packages (MAX_CHARS characters, by
# default the script's), then the script's own flags.
setup_arms() {  # log name, config, default MAX_CHARS, then more flags
  lanes=${LANES:-3}
  arms="$work/arms"
  mkdir -p "$out" "$work" "$arms"
  export XLA_PYTHON_CLIENT_PREALLOCATE=false  # several processes, one GPU
  log="$out/$1.log"
  local sp
  sp=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  common=(--config="$2" --config.data.corpus=text_files
          "--config.data.text_glob=$sp/**/*.py"
          --config.data.max_corpus_chars=${MAX_CHARS:-$3} "${@:4}")
  keep_only_this_code
  # PRIOR=ARMS.tgz: the arms an earlier call finished (its OUT/arms.tgz,
  # brought back with the working tree), kept as if run here if they come
  # from this code and these flags; the device may be a fresh machine,
  # whose stages `share` rebuilds.
  if [[ -n "${PRIOR:-}" ]]; then
    local prior_dir="$work/_prior"
    rm -rf "$prior_dir"; mkdir -p "$prior_dir"
    if ! tar xzf "$PRIOR" -C "$prior_dir"; then
      echo "!!! PRIOR $PRIOR unreadable: ignored" >> "$log"
    elif [[ "$(cat "$prior_dir/.stamp" 2>/dev/null)" != "$stamp" ]]; then
      echo "!!! PRIOR $PRIOR comes from other code or flags: ignored" >> "$log"
    else
      cp -rn "$prior_dir/." "$arms/"
    fi
    rm -rf "$prior_dir"
  fi
}
# What the arms' results depend on: the package's code, the script's and
# this file's commands (comments aside) and the shared flags. WORK_DIR and
# every arms.tgz carry it as .stamp. A WORK_DIR stamped otherwise, or
# holding anything without a stamp (a device's /tmp can outlive the job
# that wrote it), is moved aside whole, so that no arm resumes or keeps
# results of other code.
keep_only_this_code() {
  local script="$0"  # as invoked, or by its name where a `cd` moved us
  [[ -f "$script" ]] || script="bench/$(basename "$0")"
  stamp=$( (find dipaco_jax -name '*.py' | LC_ALL=C sort | xargs cat
            grep -hv '^[[:space:]]*#' "$script" bench/comm_arms_lib.sh
            printf '%s\n' "${common[@]}") | sha256sum | cut -c1-16)
  local found
  found=$(cat "$work/.stamp" 2>/dev/null)
  if [[ "$found" != "$stamp" && -n "$(ls -A "$work/arms")$(ls "$work" | grep -vx arms)" ]]; then
    local aside
    aside="$work.stale-$(date -u +%Y%m%dT%H%M%S)"
    mv "$work" "$aside"; mkdir -p "$arms" "$out"  # $out may lie inside
    echo "=== $work held runs of other code or flags (stamp '${found:-none}'): moved to $aside" >> "$log"
  fi
  echo "$stamp" > "$work/.stamp"; cp "$work/.stamp" "$arms/.stamp"
}
# The scripts resume: run the same command again (e.g. in the next device
# call on the same machine, after a `timeout`) and each arm that wrote its
# results is skipped, and an arm cut short resumes from its checkpoints
# (main.py's exact resume; ckpt.every of the config). On another machine,
# pass the last call's OUT/arms.tgz as PRIOR: each finished arm is packed
# into it at once, so a call cut by `timeout` still returns them.
run() {  # name, then extra main.py flags
  local name=$1; shift
  if [[ -f "$arms/$name.json" ]]; then
    echo "=== $name: results from an earlier call, kept" >> "$log"; return
  fi
  echo "=== $name: $* ($(date -u +%H:%M:%S))" >> "$log"
  python3 -m dipaco_jax.main --workdir="$work/$name" "${common[@]}" "$@" \
    > "$arms/$name.log" 2>&1
  if cp "$work/$name/results.json" "$arms/$name.json" 2>/dev/null; then
    # A scored arm is never resumed: its checkpoints go, or a 126M sweep
    # fills the device's 64 GiB disk (14.2 GiB per DiLoCo x8 checkpoint,
    # 2026-12-01). The base and DiPaCo's dense baseline stay: `share`
    # copies them to the next arms (comm_dipaco.sh), which would otherwise
    # train the dense baseline again.
    [[ -n "${KEEP_CHECKPOINTS:-}" ]] || find "$work/$name/runs" -mindepth 2 \
      -maxdepth 2 -name checkpoints ! -path '*/runs/base/*' \
      ! -path '*/runs/dense/*' -exec rm -rf {} +
  else
    # The job's one-line reason (a full disk, a bad flag), or its last line.
    echo "!!! $name wrote no results: $(grep -m1 '^error:' "$arms/$name.log" \
      || tail -n 1 "$arms/$name.log")" >> "$log"
  fi
  for run_name in main dipaco; do  # DiLoCo's run, or DiPaCo's paths
    cp "$work/$name/runs/$run_name/logs/train/metrics.jsonl" \
      "$arms/$name.metrics.jsonl" 2>/dev/null && break
  done
  echo "=== $name done ($(date -u +%H:%M:%S))" >> "$log"
  pack
}
pack() {  # $arms into $out/arms.tgz, one lane at a time, replaced whole
  ( flock 9
    tar czf "$out/arms.tgz.part" -C "$arms" . \
      && mv "$out/arms.tgz.part" "$out/arms.tgz" ) 9> "$work/.pack.lock"
}
share() {  # reuse the data and the dense base of run $1 in run $2
  local src
  [[ -f "$arms/$2.json" ]] && return  # kept: run $2 will not train
  src=$(stages_of "$1")
  for p in data runs/base shards/base; do
    [[ -e "$work/$2/$p" ]] && continue  # shared by an earlier call
    mkdir -p "$work/$2/$(dirname $p)"; cp -r "$work/$src/$p" "$work/$2/$p"
  done
}
# Where the shared stages are: run $1's folder, or, where $1 is _stages
# itself (comm_quality.sh) or $1's results came from PRIOR (its folder is
# on another machine), $work/_stages, built once
# by a 1-step run (H = 1) of the same config and flags: the same data (tokenized
# on the CPU, exactly), and a base of the same seed and schedule, equal up
# to the GPU's non-determinism (about 0.5% of perplexity between two runs
# of one command).
stages_of() {
  if [[ "$1" == _stages ]]; then build_stages >&2; echo _stages; return; fi
  if [[ -e "$work/$1/runs/base" || ! -f "$arms/$1.json" ]]; then
    echo "$1"; return
  fi
  build_stages >&2
  echo _stages
}
build_stages() {  # the data and the dense base, once, into $work/_stages
  # Built only when the 1-step run succeeded: a failed one leaves a base
  # half written, which each arm would then rebuild on its own (2026-12-01).
  [[ -e "$work/_stages/.built" ]] && return
  echo "=== stages: data and base ($(date -u +%H:%M:%S))" >> "$log"
  if on_gpu 0 python3 -m dipaco_jax.main --workdir="$work/_stages" \
      "${common[@]}" --config.train.num_steps=1 \
      --config.diloco.inner_steps=1 > "$work/_stages.log" 2>&1; then
    touch "$work/_stages/.built"
  else
    echo "!!! stages failed: $work/_stages.log" >> "$log"
  fi
  echo "=== stages done ($(date -u +%H:%M:%S))" >> "$log"
}
on_gpu() {  # lane index, then a command: the command on that lane's GPU
  local lane=$1; shift
  if (( ${#_gpus[@]} )); then
    CUDA_VISIBLE_DEVICES=${_gpus[lane % ${#_gpus[@]}]} "$@"
  else
    "$@"
  fi
}
# An arm's flags: ARMS[name]; a name b<N>_<arm> is <arm> at N sequences
# per replica step (train.batch_size; the shared dense base keeps its own,
# base.batch_size), so that one call holds an arm and its larger-batch twin
# (bench/comm_table.py compares it with b<N>_ of its baseline).
arm_flags() {
  if [[ $1 =~ ^b([0-9]+)_(.+)$ && -v "ARMS[${BASH_REMATCH[2]}]" ]]; then
    echo "${ARMS[${BASH_REMATCH[2]}]} --config.train.batch_size=${BASH_REMATCH[1]}"
  elif [[ -v "ARMS[$1]" ]]; then
    echo "${ARMS[$1]}"
  else
    return 1
  fi
}
# Each named arm of ARMS, $lanes at once, from the stages of arm $base
# (default diloco_x8).
run_lanes() {
  local i=0 name flags
  for name in "$@"; do
    flags=$(arm_flags "$name") || { echo "!!! $name: no such arm" >> "$log"; continue; }
    share "${base:-diloco_x8}" "$name"
    # shellcheck disable=SC2086
    on_gpu "$i" run "$name" $flags &
    i=$((i + 1))
    if (( i % lanes == 0 )); then wait; fi
  done
  wait
}
