"""Test setup: 8 fake CPU devices before JAX starts; implicit rank
promotion is an error, so a broadcast that only works by accident fails.

One persistent compilation cache for the whole session: the tests build
the same tiny programs over and over (a Runtime per config and process
jits anew: the job's processes and island roles started by the tests, the
tests of one config in another xdist worker), and a 2-core CPU has no time
to compile them again. An identical program (same HLO, devices, options and
flags: JAX's cache key) runs the very executable a fresh compile gives, so
no number changes. The directory is handed on through the environment, so
the xdist workers and every process a test starts share it; the process
that made it removes it at exit."""

import atexit
import os
import shutil
import sys
import tempfile

# Where bytecode is never written (PYTHONDONTWRITEBYTECODE=1, as set on
# the 2-core test machines, while .ci/run installs with --no-compile),
# every Python process compiles the source of JAX, Flax, Orbax and the
# package anew at import: 2.6 s of a 5.3 s import of an island role on 2
# cores, paid by every process a test starts (the main job's; the island
# roles', five at a time and again after each kill). One bytecode cache for
# the session instead, outside the source tree and site-packages
# (PYTHONPYCACHEPREFIX), handed on through the environment like the
# compilation cache below and removed at exit by the process that made it.
# Python checks each cached file against its source's size and mtime, so an
# edited module is compiled again; the same code runs either way.
if sys.dont_write_bytecode:
  if "PYTHONPYCACHEPREFIX" not in os.environ:
    _PYC_DIR = tempfile.mkdtemp(prefix="dipaco_jax_tests_pyc_")
    os.environ["PYTHONPYCACHEPREFIX"] = _PYC_DIR
    atexit.register(shutil.rmtree, _PYC_DIR, ignore_errors=True)
  os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
  sys.pycache_prefix = os.environ["PYTHONPYCACHEPREFIX"]
  sys.dont_write_bytecode = False

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _CACHE_DIR = tempfile.mkdtemp(prefix="dipaco_jax_tests_xla_")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE_DIR
  atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)
# Every program, however quick to compile (the default keeps only those
# over 1 s).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# LLVM without its optimization passes: the tests' programs are tiny and
# run a few steps, so compiling them is what costs (a third less CPU time
# for the whole suite on 2 cores). XLA's own passes (fusion, layout,
# sharding) run as ever, so the tests see the HLO that runs elsewhere.
# Float results move in their last bits (no fused multiply-adds: measured,
# at most 5e-7 on the golden step's losses), well within the pinned golden
# values' 1e-5; every bit-for-bit comparison in the suite is between runs
# that both compile so. Inherited, like the cache, by every process a test
# starts.
# And XLA:CPU's loop fusions through its older emitter instead of the MLIR
# fusion emitters, whose code generation owned most of what stayed of a
# compile (2-core AMD EPYC, jaxlib 0.10.2, 2026-12-01, cold cache:
# test_outer, test_golden_step and test_train 106 s -> 87 s, the merged
# slots' K-step test 29 s -> 19-22 s; the same pinned values pass).
for _flag in ("--xla_backend_optimization_level=0",
              "--xla_cpu_use_fusion_emitters=false"):
  if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = " ".join(filter(None, [
        os.environ.get("XLA_FLAGS"), _flag]))

import jax  # pylint: disable=g-import-not-at-top
import pytest  # pylint: disable=g-import-not-at-top

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")
# Also where a plugin imported JAX before this file set the environment.
jax.config.update("jax_compilation_cache_dir",
                  os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", float(
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))


# The modules whose tests start processes or train several runs (a minute
# or more each on 2 cores) go first: pytest-xdist hands tests out in this
# order, so the long ones start while the short ones still fill both
# workers, instead of one worker finishing a long test alone at the end.
# Only the order changes; every test runs.
_LONG_MODULES = ("test_islands_gcs.py", "test_paper_config.py",
                 "test_multihost.py",
                 "test_pipeline.py", "test_islands_processes.py",
                 "test_islands.py", "test_islands_replay.py", "test_islands_repair.py",
                 "test_results_rerun.py",
                 "test_gcs_emulator.py", "test_gcs_processes.py",
                 "test_delay.py", "test_overlap.py",
                 "test_download.py", "test_dense_scaling.py",
                 "test_pipelined.py", "test_merged_slots.py",
                 "test_dispatch.py", "test_hlo_kernels.py",
                 "test_contribution_fidelity.py", "test_train.py",
                 "test_sharded_checkpoint.py")


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(_LONG_MODULES)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_configure(config):
  # xdist's load scheduler starts each worker on a run of consecutive tests
  # a quarter of its share long (57 of 685 on 3 workers): with the long
  # modules first, the first worker got nearly all of them. Two at a time
  # deals them out in turn (`--maxschedchunk` on the command line wins).
  if getattr(config.option, "maxschedchunk", 0) is None:
    config.option.maxschedchunk = 2
  # ml_collections loads a config file with SourceFileLoader.load_module,
  # which Python deprecates (one warning per file loaded, raised inside
  # importlib, so only its message names it). Ours never calls it.
  config.addinivalue_line(
      "filterwarnings",
      r"ignore:the load_module\(\) method is deprecated:DeprecationWarning")
