r"""Throughput, MFU, bubble and per-device memory of the pipelined inner step.

  python bench/pipeline_throughput.py --stages=2,4,1 --microbatches=8,16 \
      --shape=1x1 --schedules=gpipe,circular --layers=32 --d_model=3072 \
      --heads=24 --head_dim=128 --mlp=8192 --batch=32 --seq=1024 \
      --remat=full --out=/tmp/pp.json                   # 4 GPUs, 3.8B
  python bench/pipeline_throughput.py --stages=1,2 --microbatches=4,8 \
      --devices=2 --plain_devices=1                     # 150M: 2 GPUs vs 1
  python bench/pipeline_throughput.py --fake_devices=8 --stages=1,2,4 \
      --microbatches=4,8 --layers=4 --d_model=64 --heads=2 --head_dim=32 \
      --mlp=256 --vocab=1024 --seq=64 --batch=16 --steps=2 \
      --warmup=1                                        # CPU smoke test

For each S in --stages, M in --microbatches and schedule in --schedules
it times the framework's jitted inner step (`Runtime.inner_step`, the
schedules of model/pipelined.py, config.pipeline.stages = S,
microbatches = M, schedule) of
--paths vmapped workers on the first --devices devices (mesh path x stage
S x data: the rest), on random tokens already on the device. S = 1 is the
plain step (M unused) on --plain_devices devices. The shape flags and the
FLOPs/token of MFU are bench/step_throughput.py's; here MFU divides by the
peak of all the devices used, so 2 GPUs at the same tokens/s as 1 halve it.

Each row also has the bubble fraction ((S-1)/(M+S-1) for GPipe,
(S-1)/(G M+S-1) for the circular schedule over G segments), the bytes of the
training state each device holds (its stage's layers with their AdamW and
outer state, plus the replicated embedding and head), and the compiled
step's per-device memory (arguments + temporaries, XLA's memory
analysis). Each row runs in a process of its own (`--row_timeout`
seconds): a row that does not fit, or that XLA aborts, reports its error
and the next starts on empty devices; a failed row keeps XLA's first fatal
line. `--first_collective_timeout` raises XLA's 40 s limit on the devices'
first collective, which aborted the 4-stage 3.8B row on 4 H100s.
1F1B is not built (it changes memory, not the bubble).
"""

import argparse
import itertools
import json
import os
import re
import subprocess
import sys

import jax
import numpy as np

from dipaco_jax import testing
from dipaco_jax.parallel import mesh as mesh_lib
import step_throughput  # bench/step_throughput.py (this folder is on sys.path)
import timing  # bench/timing.py


def _ints(text: str) -> list[int]:
  return [int(x) for x in text.split(",") if x]


def _state_bytes_per_device(state) -> int:
  """Bytes of the state's shards on the first device (every device of a
  stage holds as much; stages differ only if their layers do)."""
  device = jax.devices()[0]
  return sum(s.data.nbytes for leaf in jax.tree.leaves(state)
             for s in leaf.addressable_shards if s.device == device)


def bench_row(args, stages: int, microbatches: int, num_devices: int,
              schedule: str):
  config = step_throughput.make_config(args, args.paths)
  config.paths.shape = args.shape
  config.pipeline.stages = stages
  config.pipeline.microbatches = microbatches if stages > 1 else 1
  config.pipeline.schedule = schedule
  devices = jax.devices()[:num_devices]
  runtime = testing.tiny_runtime(config, vocab_size=args.vocab,
                                 devices=devices)
  holder = {"state": runtime.init_state(jax.random.key(0))}
  rng = np.random.default_rng(0)
  batch = runtime.worker_rows(rng.integers(
      0, args.vocab, (args.paths, args.batch, args.seq + 1)).astype(np.int32))
  compiled = runtime.inner_step.jitted.lower(holder["state"], batch).compile()

  def step():
    holder["state"], metrics = runtime.inner_step(holder["state"], batch)
    return metrics["loss"]

  seconds = timing.seconds_per_call(step, args.steps, args.warmup)
  fpt, params = step_throughput.flops_per_token(runtime, args.seq)
  tokens_per_s = args.paths * args.batch * args.seq / seconds
  row = {"stages": stages, "microbatches": config.pipeline.microbatches,
         "schedule": schedule if stages > 1 else "-",
         "devices": len(devices), "mesh": dict(runtime.mesh.shape),
         "bubble_fraction": runtime.bubble_fraction,
         "seconds_per_step": seconds, "tokens_per_s": tokens_per_s,
         "mfu": tokens_per_s * fpt / (step_throughput.PEAK_FLOPS *
                                      len(devices)),
         "params_per_path": params,
         "state_bytes_per_device": _state_bytes_per_device(holder["state"])}
  memory = compiled.memory_analysis()
  if memory is not None:
    row["step_bytes_per_device"] = int(
        memory.argument_size_in_bytes + memory.temp_size_in_bytes)
    row["temp_bytes_per_device"] = int(memory.temp_size_in_bytes)
  return row


def _device_facts(fake_devices: int) -> dict:
  """Device count and kind and the jax version, from a child process."""
  code = ("import json, jax; from dipaco_jax.parallel import mesh; "
          f"mesh.setup_fake_devices({fake_devices}); "
          "print(json.dumps({'count': jax.device_count(), 'kind': "
          "jax.devices()[0].device_kind, 'jax': jax.__version__}))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, check=True, timeout=120).stdout
  return json.loads(out.strip().splitlines()[-1])


_REASON = re.compile(
    r"^F\d{4} |Check failed|RESOURCE_EXHAUSTED|Error:|may be stuck")


def _run_row_in_child(stages: int, micro: int, devices: int, schedule: str,
                      timeout: int, first_collective_s: int) -> dict:
  """One row in a process of its own: an out-of-memory error or an XLA
  abort (a collective that never rendezvouses when one device's thread
  fails) then costs only that row, and every row starts on empty devices."""
  base = {"stages": stages, "microbatches": micro, "devices": devices,
          "schedule": schedule}
  # The child gets the parent's flags (it writes no --out: it only prints).
  cmd = [sys.executable, __file__, *sys.argv[1:],
         f"--row={stages},{micro},{devices},{schedule}"]
  env = dict(os.environ)
  if first_collective_s:
    # XLA aborts a process whose devices do not all reach their first
    # collective within 40 s; on 4 stages of a 3.8B model two of the four
    # device threads did not (docs/pipeline.md), so the limit
    # is raised to tell a slow first call from a deadlock.
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_first_"
                        f"collective_call_terminate_timeout_seconds="
                        f"{first_collective_s}")
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          timeout=timeout, env=env)
  except subprocess.TimeoutExpired as e:
    # What XLA said before the limit (e.g. device threads waiting at a
    # collective for the others) tells a hang from a slow compile.
    said = e.stderr.decode() if isinstance(e.stderr, bytes) else e.stderr
    return dict(base, error=f"timed out after {timeout} s" + "".join(
        f" | {x}" for x in _reasons(said or "")))
  rows = [x for x in proc.stdout.splitlines() if x.startswith("ROW ")]
  if rows:
    return json.loads(rows[-1][len("ROW "):])
  lines = [x for x in proc.stderr.splitlines() if x.strip()]
  return dict(base, error=f"exit {proc.returncode}: " + " | ".join(
      _reasons(proc.stderr) + lines[-2:]))


def _reasons(stderr: str) -> list[str]:
  """An abort's last lines are a stack trace; its reason is the first fatal
  (F...) or error line, kept beside the tail."""
  return [x for x in stderr.splitlines() if _REASON.search(x)][:2]


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  step_throughput.add_shape_flags(p)
  p.add_argument("--paths", type=int, default=1, help="workers vmapped")
  p.add_argument("--stages", default="1,2", help="S values; 1 = plain step")
  p.add_argument("--microbatches", default="4,8", help="M values (M >= S)")
  p.add_argument("--devices", type=int, default=0, help="0: all")
  p.add_argument("--plain_devices", type=int, default=0,
                 help="devices of the S = 1 rows; 0: as --devices")
  p.add_argument("--fake_devices", type=int, default=0,
                 help="N CPU devices (before JAX starts; CPU only)")
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--row_timeout", type=int, default=300,
                 help="seconds for one row's process")
  p.add_argument("--first_collective_timeout", type=int, default=300,
                 help="seconds XLA waits for every device's first "
                 "collective before aborting (its default: 40); 0 keeps "
                 "XLA's")
  p.add_argument("--schedules", default="gpipe",
                 help="pipeline.schedule values: gpipe, circular")
  p.add_argument("--shape", default="1",
                 help="paths.shape of the one path: 1x1 makes two layer "
                 "segments, which the circular schedule runs as one lap each")
  p.add_argument("--row", default="", help=argparse.SUPPRESS)
  p.add_argument("--out", default="")
  args = p.parse_args()
  if args.row:  # A child: one row, printed for the parent.
    mesh_lib.setup_fake_devices(args.fake_devices)
    *numbers, schedule = args.row.split(",")
    stages, micro, devices = (int(x) for x in numbers)
    try:
      row = bench_row(args, stages, micro, devices, schedule)
    except Exception as e:  # pylint: disable=broad-except
      # Out of memory (the point of the larger shapes) or a config that
      # does not split: reported as the row's result.
      row = {"stages": stages, "microbatches": micro, "devices": devices,
             "schedule": schedule,
             "error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
    print("ROW " + json.dumps(row), flush=True)
    return
  # The parent never starts JAX on the GPUs: it would hold their memory
  # (XLA preallocates) while the children run.
  facts = _device_facts(args.fake_devices)
  num_devices = args.devices or facts["count"]
  results = []
  for stages in _ints(args.stages):
    counts = [1] if stages == 1 else [m for m in _ints(args.microbatches)
                                      if m >= stages]
    schedules = ["gpipe"] if stages == 1 else args.schedules.split(",")
    for micro, schedule in itertools.product(counts, schedules):
      devices = (args.plain_devices or num_devices) if stages == 1 else (
          num_devices)
      row = _run_row_in_child(stages, micro, devices, schedule,
                              args.row_timeout, args.first_collective_timeout)
      results.append(row)
      print(json.dumps(row), flush=True)
  summary = {"device": facts["kind"], "jax": facts["jax"],
             "args": vars(args), "results": results}
  timing.report(summary, args.out)


if __name__ == "__main__":
  main()
