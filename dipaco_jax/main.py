r"""Command line: runs the main job for a config.

  python -m dipaco_jax.main --config=experiments/quickstart.py \
      --workdir=/tmp/dipaco_quickstart [--fake_devices=8] \
      [--config.train.num_steps=100] [--verbose]

A mistake on the command line or in the config (an unknown field, a value
out of range, an unusable --workdir) and the errors meant for the user that
the job raises later are printed as one line, `error: <message>`, with exit
status 2; `--verbose` shows their traceback. Other exceptions are bugs and
keep theirs. SIGTERM or SIGINT (a preemption notice) saves a checkpoint at
the end of the current step and exits with status 75 (`train/preemption.py`);
the same command resumes.
"""

import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from dipaco_jax import cli_errors

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "An experiments/*.py config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None,
                               "Run directory (local path or gs://).")
_FAKE_DEVICES = flags.DEFINE_integer(
    "fake_devices", 0, "Run on N fake CPU devices (CPU only); 0 = off.",
    lower_bound=0)
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "Multi-host: call jax.distributed.initialize() "
    "(Cloud TPU pods and slices detect their peers themselves; elsewhere give "
    "--coordinator_address, --num_processes and --process_id).")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "With --distributed: host:port of process 0.")
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None, "With --distributed: how many processes.",
    lower_bound=1)
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, "With --distributed: this process's index.",
    lower_bound=0)
_VERBOSE = flags.DEFINE_bool(
    "verbose", False, "On an error meant for the user, print the full "
    "traceback instead of one line.")
flags.mark_flags_as_required(["config", "workdir"])
# At parse time, so that a bad --workdir fails before anything is created.
flags.register_validator("workdir", cli_errors.check_workdir)


def main(argv, islands=None):
  """Runs the job; `islands` (`islands.launcher.IslandOptions`) trains its
  multi-worker runs through the island runtime (`python -m
  dipaco_jax.islands`)."""
  del argv
  if not flags.FLAGS["verbosity"].present:
    # Library INFO logs (orbax, absl) would bury the progress lines.
    logging.set_verbosity(logging.WARNING)
  from dipaco_jax.train import preemption  # pylint: disable=g-import-not-at-top
  with preemption.handle_signals():
    try:
      with cli_errors.user_errors(verbose=_VERBOSE.value):
        _run(islands)
    except preemption.Preempted as e:
      print(f"error: {e}", file=sys.stderr, flush=True)
      sys.exit(preemption.EXIT_PREEMPTED)


def _run(islands):
  from dipaco_jax.parallel import mesh  # pylint: disable=g-import-not-at-top
  from dipaco_jax.parallel import multihost  # pylint: disable=g-import-not-at-top
  if _DISTRIBUTED.value:
    # Before anything starts JAX's backends; fake devices are per process.
    mesh.setup_fake_devices(_FAKE_DEVICES.value, check=False)
    multihost.initialize(_COORDINATOR.value, _NUM_PROCESSES.value,
                         _PROCESS_ID.value)
    mesh.verify_fake_devices(_FAKE_DEVICES.value)
  else:
    mesh.setup_fake_devices(_FAKE_DEVICES.value)
  from dipaco_jax import pipeline  # pylint: disable=g-import-not-at-top
  config = _CONFIG.value
  pipeline.check_config(config)  # ConfigError: one line, exit 2 (above)
  pipeline.run(config, _WORKDIR.value, islands)


if __name__ == "__main__":
  app.run(main, flags_parser=cli_errors.parse_flags)
