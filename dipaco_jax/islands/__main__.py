r"""The main job with its multi-worker runs trained as islands.

  python -m dipaco_jax.islands --config=experiments/quickstart.py \
      --workdir=/tmp/dipaco_islands --num_workers=2 [--fake_devices=8] \
      [--paths_per_task=1] [--num_executors=1]

The same stages as `python -m dipaco_jax.main` (data, base, routing, shards,
then evaluation and the report, the same results.json), except that every
run with more than one worker (DiPaCo's paths, DiLoCo's replicas) is trained
by a coordinator, `--num_workers` worker processes and `--num_executors`
outer executors started on this machine, which share only the store
`{workdir}/islands/{run}` (`launcher.py`). Every flag of dipaco_jax.main
applies; `--fake_devices` is the main process's device count
(`--worker_fake_devices` each worker's).
"""

from absl import app
from absl import flags

from dipaco_jax import cli_errors
from dipaco_jax import main as main_lib

_NUM_WORKERS = flags.DEFINE_integer(
    "num_workers", 2, "Worker processes started here (each takes tasks: one "
    "round of --paths_per_task paths); 0 = only workers started elsewhere "
    "(`python -m dipaco_jax.islands.worker --store=...`).", lower_bound=0)
_GPUS = flags.DEFINE_integer(
    "gpus_per_worker_machine", 0, "Give worker i only GPU i % N of this "
    "machine (CUDA_VISIBLE_DEVICES); 0 = every worker sees every device.",
    lower_bound=0)
_PATHS_PER_TASK = flags.DEFINE_integer(
    "paths_per_task", 1, "Workers (paths x replicas) a task trains at once, "
    "vmapped in one program.", lower_bound=1)
_NUM_EXECUTORS = flags.DEFINE_integer(
    "num_executors", 0, "Outer executor processes (modules are dealt "
    "round-robin); 0 = one per module, at most 8.", lower_bound=0)
_WORKER_FAKE_DEVICES = flags.DEFINE_integer(
    "worker_fake_devices", -1, "Fake CPU devices of each worker process; "
    "-1 = --paths_per_task when --fake_devices is set (one device per path: "
    "no collectives between a worker's devices, which time out on a busy "
    "CPU), else none.", lower_bound=-1)
_SLOW_WORKERS = flags.DEFINE_list(
    "slow_workers", [], "ID:SECONDS pairs: those local workers sleep that "
    "long after each inner step (to see a slow island get fewer tasks).")
_LINK_MBPS = flags.DEFINE_float(
    "link_mbps", 0.0, "Emulate a link of this many Mbit/s between each role "
    "and the store (every array read and write takes latency + bytes / "
    "bandwidth at least); 0 = the disk's speed.", lower_bound=0.0)
_LINK_LATENCY = flags.DEFINE_float(
    "link_latency_ms", 0.0, "Emulated latency of every store operation "
    "(a marker, a control file, a listing, an array transfer), e.g. 50 for an "
    "object store across a region; 0 = none.", lower_bound=0.0)
_INNER_STATE_EVERY = flags.DEFINE_integer(
    "inner_state_every", 1, "Commit the workers' AdamW states (and codec "
    "carries) every K rounds, not every round: fewer bytes "
    "written; a task that moves to another worker, or a restarted one, "
    "replays up to K - 1 rounds, and the store keeps up to K module "
    "versions (with a delay the anchor is part of the state and is "
    "committed with it; eager's view and outer optimizer state too, and "
    "its store keeps one round more of contributions for its replays).",
    lower_bound=1)
_STORE_FSYNC = flags.DEFINE_bool(
    "store_fsync", False, "Sync a local store's writes to disk before each "
    "commit marker, so committed keys survive a crashed machine (power, "
    "kernel), not only killed processes; costs the disk's write time per "
    "round (docs/reliability.md, the durability policy). No effect on "
    "gs://, whose uploads are durable when they return.")
_WORKER_DOWNLOAD_CACHE = flags.DEFINE_float(
    "worker_download_cache_mb", None, "Each local worker's host memory "
    "for its copies of the modules with diloco.download_compression (the "
    "least recently used goes first and is read whole when needed again); "
    "0 = no limit; default: the worker's (4096).", lower_bound=0.0)
_LEASE_TIMEOUT = flags.DEFINE_float(
    "lease_timeout_s", 20.0, "A worker whose heartbeat is this old loses "
    "its task.", lower_bound=1.0)
_ROLE_LOG_DIR = flags.DEFINE_string(
    "role_log_dir", "", "Where the local roles' output files go; default: "
    "{store}/logs, or for a gs:// workdir a directory under this machine's "
    "temporary directory named after the store (printed at start).")


def main(argv):
  from dipaco_jax.islands import launcher  # pylint: disable=g-import-not-at-top
  options = launcher.IslandOptions(
      num_workers=_NUM_WORKERS.value, paths_per_task=_PATHS_PER_TASK.value,
      num_executors=_NUM_EXECUTORS.value,
      fake_devices=(_WORKER_FAKE_DEVICES.value
                    if _WORKER_FAKE_DEVICES.value >= 0 else
                    _PATHS_PER_TASK.value if flags.FLAGS.fake_devices
                    else 0),
      lease_timeout_s=_LEASE_TIMEOUT.value,
      gpus_per_machine=_GPUS.value,
      link_mbps=_LINK_MBPS.value, link_latency_ms=_LINK_LATENCY.value,
      inner_state_every=_INNER_STATE_EVERY.value,
      store_fsync=_STORE_FSYNC.value,
      download_cache_mb=_WORKER_DOWNLOAD_CACHE.value,
      log_dir=_ROLE_LOG_DIR.value,
      slowdown_s={w: float(t) for w, t in (
          item.split(":") for item in _SLOW_WORKERS.value)})
  main_lib.main(argv, islands=options)


if __name__ == "__main__":
  app.run(main, flags_parser=cli_errors.parse_flags)
