"""Every field is validated before compute, and command-line mistakes cost
one line on stderr (exit 2) instead of a traceback or a wasted run."""

import importlib.util
import math
import os
import pathlib
import subprocess
import sys

import ml_collections
import pytest

from dipaco_jax import cli_errors
from dipaco_jax import config_base
from dipaco_jax import errors
from dipaco_jax import testing

_ROOT = pathlib.Path(__file__).parent.parent
_EXPERIMENTS = _ROOT / "experiments"


def _set(config, field, value):
  *sections, key = field.split(".")
  for s in sections:
    config = config[s]
  config[key] = value


def _untyped(config):
  """A copy that takes values of any type: ml_collections refuses them on
  assignment, but a config built otherwise (or a derived one) may carry
  them."""
  return ml_collections.ConfigDict(config.to_dict(), type_safe=False)


# --- config_base.validate ---------------------------------------------------


@pytest.mark.parametrize("field,value,match", [
    # Values once measured to run, crash late or delete checkpoints.
    ("inner_opt.learning_rate", -1.0, r"must be > 0 \(got -1.0\)"),
    ("ckpt.keep", 0, r"must be >= 1 \(got 0\); keep=0 would delete every "
     "checkpoint, the final one included"),
    ("train.eval_batch_size", 0, r"must be >= 1 \(got 0\)"),
    ("inner_opt.warmup_steps", -5, r"must be >= 0 \(got -5\)"),
    ("ckpt.every", -5, r"must be >= 0 \(got -5\); 0 = save only the last"),
    ("data.prefetch", -1, r"must be >= 1 \(got -1\)"),
    ("data.prefetch", 0, r"must be >= 1 \(got 0\)"),
    # A few more of each kind of range.
    ("diloco.outer_lr", 0.0, r"must be > 0"),
    ("diloco.outer_momentum", 1.0, r"must be in \[0, 1\)"),
    ("inner_opt.b1", 1.0, r"must be in \[0, 1\)"),
    ("inner_opt.b2", -0.1, r"must be in \[0, 1\)"),
    ("inner_opt.weight_decay", -0.1, r"must be >= 0"),
    ("inner_opt.grad_clip", -1.0, r"must be >= 0"),
    ("inner_opt.final_lr_fraction", 1.5, r"must be in \[0, 1\]"),
    ("inner_opt.learning_rate", math.inf, r"must be finite"),
    ("inner_opt.learning_rate", math.nan, r"must be finite"),
    ("data.validation_fraction", 0.0, r"must be in \(0, 1\)"),
    ("data.max_doc_chars", 0, r"must be >= 1"),
    ("data.prefix_len", 0, r"must be >= 1"),
    ("model.rope_base", 1.0, r"must be > 1"),
    ("model.init_std", 0.0, r"must be > 0"),
    ("model.scan_unroll", -1, r"must be >= 0"),
    ("routing.min_shard_fraction", 1.5, r"must be in \[0, 1\]"),
    ("routing.kmeans_iters", -1, r"must be >= 0"),
    ("eval.reroute_every", -16, r"must be >= 0"),
    ("train.log_every", 0, r"must be >= 1"),
    ("base.batch_size", -8, r"must be >= 0"),
    ("seed", -1, r"must be >= 0"),
    ("routing.discriminative_steps", 6,
     r"6 must be a multiple of diloco.inner_steps=4"),
    ("model.remat", "partial", r"'partial': use none, full or dots"),
    ("routing.replica_shards", "random", r"'random': use iid or kmeans"),
    ("diloco.sparse_aggregate", "median", r"'median': use mean or senders"),
    ("model.attention", "cudnn", r"cudnn needs model.dtype 16-bit, not "
     "float32"),
])
def test_bad_values_name_the_field(field, value, match):
  config = testing.tiny_config("2x2", inner_steps=4, num_steps=8)
  _set(config, field, value)
  with pytest.raises(config_base.ConfigError,
                     match=rf"^config\.{field}: {match}"):
    config_base.validate(config, num_devices=8)


@pytest.mark.parametrize("field,value,match", [
    ("train.batch_size", 8.0, "must be an integer"),
    ("train.num_steps", True, "must be a number"),
    ("inner_opt.learning_rate", "3e-3", "must be a number"),
    ("ckpt.async_save", "yes", "must be True or False"),
    ("eval.dense_same_flops", 1, "must be True or False"),
])
def test_wrong_types_name_the_field(field, value, match):
  config = _untyped(testing.tiny_config())
  _set(config, field, value)
  with pytest.raises(config_base.ConfigError, match=rf"^config\.{field}: "
                     f"{match}"):
    config_base.validate(config, num_devices=8)


def _numeric_fields(config, prefix=""):
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict):
      yield from _numeric_fields(value, f"{prefix}{key}.")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
      yield prefix + key, value


_NUMERIC = [f for f in _numeric_fields(config_base.base_config())
            if not f[0].startswith("mesh.")]  # resolve_mesh_shape's (-1)


@pytest.mark.parametrize("field,default", _NUMERIC,
                         ids=[f for f, _ in _NUMERIC])
def test_every_numeric_field_refuses_a_negative_value(field, default):
  """A new field of base_config() without a range fails here."""
  config = testing.tiny_config("2x2", inner_steps=4, num_steps=8)
  _set(config, field, type(default)(-10**6))
  with pytest.raises(config_base.ConfigError, match=rf"^config\.{field}: "):
    config_base.validate(config, num_devices=8)


def test_a_missing_field_is_named():
  config = _untyped(testing.tiny_config())
  del config.ckpt["keep"]
  with pytest.raises(config_base.ConfigError, match=r"config\.ckpt\.keep: is "
                     "missing"):
    config_base.validate(config, num_devices=8)


@pytest.mark.parametrize("field,value", [
    ("ckpt.every", 0),  # only the last step
    ("inner_opt.grad_clip", 0.0),  # no clipping
    ("inner_opt.b1", 0.0),
    ("inner_opt.final_lr_fraction", 1.0),  # constant after warmup
    ("inner_opt.warmup_steps", 1000),  # clamped to the run (derived runs)
    ("diloco.outer_lr", 1.0),  # outer SGD with 1.0 = plain averaging
    ("diloco.outer_momentum", 0.0),
    ("data.max_corpus_chars", 0),  # the whole corpus
    ("data.max_documents", 0),  # the whole split
    ("routing.kmeans_iters", 0),
    ("eval.reroute_every", 0),  # off
    ("base.batch_size", 0),  # = train.batch_size
    ("model.scan_unroll", 1),
])
def test_documented_sentinels_and_edges_stay_valid(field, value):
  config = testing.tiny_config("2x2", inner_steps=4, num_steps=8)
  if field == "diloco.outer_lr":
    config.diloco.outer_optimizer = "sgd"
  _set(config, field, value)
  config_base.validate(config, num_devices=8)


def _load(path):
  spec = importlib.util.spec_from_file_location(path.stem, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_every_sweep_point_validates():
  """Sweep points are not files of their own, so test_config's check of
  every experiment does not see their overrides."""
  from dipaco_jax import pipeline  # pylint: disable=g-import-not-at-top
  for path in sorted(_EXPERIMENTS.glob("sweep_*.py")):
    module = _load(path)
    for point in module.get_sweep():
      config = module.get_config()
      for field, value in point.items():
        _set(config, field, value)
      pipeline.check_config(config)


def test_config_error_is_a_user_error_and_still_a_value_error():
  assert issubclass(config_base.ConfigError, errors.UserError)
  assert issubclass(config_base.ConfigError, ValueError)


# --- cli_errors, in process -------------------------------------------------


def test_unknown_field_suggests_the_close_match():
  known = cli_errors.field_names(config_base.base_config())
  assert cli_errors.unknown_field_message("train.num_stepz", known) == (
      "Unknown config field config.train.num_stepz; did you mean "
      "config.train.num_steps?")
  # The right name in the wrong section: the section it lives in.
  assert "config.inner_opt.warmup_steps?" in cli_errors.unknown_field_message(
      "optimizer.warmup_steps", known)
  assert "config_base.py" in cli_errors.unknown_field_message("zzz", known)


def test_one_line_keeps_every_line():
  assert cli_errors.one_line("A run differs:\n  data: a != b\n  model: c\n"
                             "Use a fresh --workdir.") == (
                                 "A run differs: data: a != b; model: c; "
                                 "Use a fresh --workdir.")


@pytest.mark.parametrize("error,expected", [
    (config_base.ConfigError("config.x: bad"), True),
    (errors.UserError("anything"), True),
    (FloatingPointError("Non-finite loss"), True),
    (ValueError("No files match; check config.data.text_glob."), True),
    (ValueError("--fake_devices=8 needs the CPU platform"), True),
    (FileNotFoundError("C4 is not prepared in data_dir=None"), True),
    (ValueError("x_NxD must be 2-D, got shape (3,)."), False),  # a bug
    (FileNotFoundError(2, "No such file or directory"), False),  # the OS's
    (KeyError("step"), False),
])
def test_user_errors_are_told_from_bugs(error, expected):
  assert cli_errors.is_user_error(error) == expected


def test_checkpoint_errors_are_user_errors():
  from dipaco_jax.train import checkpoint  # pylint: disable=g-import-not-at-top
  assert cli_errors.is_user_error(
      checkpoint.CheckpointMismatchError("belongs to a different run"))


# --- python -m dipaco_jax.main: fails before any compute ----------------------


def _main(*args, workdir):
  return subprocess.run(
      [sys.executable, "-m", "dipaco_jax.main",
       "--config=experiments/quickstart.py", f"--workdir={workdir}", *args],
      capture_output=True, text=True, check=False, timeout=120, cwd=_ROOT,
      env={**os.environ, "JAX_PLATFORMS": "cpu"})


def _one_error_line(run) -> str:
  assert run.returncode == 2, run.stderr[-3000:]
  lines = run.stderr.splitlines()
  assert len(lines) == 1, run.stderr[-3000:]
  assert lines[0].startswith("error: ")
  return lines[0]


def test_unknown_field_is_one_line_with_the_close_match(tmp_path):
  workdir = tmp_path / "run"
  line = _one_error_line(_main("--config.train.num_stepz=5", workdir=workdir))
  assert line == ("error: Unknown config field config.train.num_stepz; did "
                  "you mean config.train.num_steps?")
  assert not workdir.exists()


def test_bad_value_type_is_one_line_naming_the_field(tmp_path):
  workdir = tmp_path / "run"
  line = _one_error_line(_main("--config.train.num_steps=abc",
                               workdir=workdir))
  assert "config.train.num_steps: expects an integer, got 'abc'" in line
  assert not workdir.exists()


def test_out_of_range_field_is_one_line_before_anything_is_created(tmp_path):
  workdir = tmp_path / "run"
  line = _one_error_line(_main("--config.ckpt.keep=0", "--fake_devices=8",
                               workdir=workdir))
  assert line.startswith("error: config.ckpt.keep: must be >= 1 (got 0)")
  assert not workdir.exists()


@pytest.mark.parametrize("under", [False, True], ids=["file", "under_file"])
def test_workdir_that_is_a_file_is_one_line(tmp_path, under):
  a_file = tmp_path / "notes.txt"
  a_file.write_text("not a directory")
  workdir = a_file / "run" if under else a_file
  line = _one_error_line(_main(workdir=workdir))
  assert line.startswith(f"error: --workdir={workdir}: ")
  assert a_file.read_text() == "not a directory"


def test_negative_fake_devices_is_one_line(tmp_path):
  workdir = tmp_path / "run"
  line = _one_error_line(_main("--fake_devices=-1", workdir=workdir))
  assert line.startswith("error: --fake_devices=-1: ")
  assert not workdir.exists()


def test_verbose_keeps_the_traceback(tmp_path):
  run = _main("--config.train.num_stepz=5", "--verbose",
              workdir=tmp_path / "run")
  assert run.returncode != 0
  assert "Traceback" in run.stderr


@pytest.mark.parametrize("overrides", [(), ("--config.seed=1",)],
                         ids=["alone", "with_overrides"])
@pytest.mark.parametrize("problem", ["missing", "not_python", "raises"])
def test_a_config_file_that_cannot_load_is_one_line(tmp_path, problem,
                                                    overrides):
  # With overrides absl loads the file while parsing, without them the
  # first read of the config does: one line either way, naming the file.
  # (tests/test_user_errors.py has every other way a file can fail.)
  config_file = tmp_path / "experiment.py"
  if problem == "not_python":
    config_file.write_text("def get_config(:\n")
  if problem == "raises":
    config_file.write_text("def get_config():\n  return base_config()\n")
  workdir = tmp_path / "run"
  line = _one_error_line(_main(f"--config={config_file}", *overrides,
                               workdir=workdir))
  assert line.startswith(f"error: --config={config_file}: "), line
  if problem == "not_python":
    assert "not valid Python" in line and "line 1" in line, line
  elif problem == "raises":
    assert line.endswith(
        "get_config() raised NameError: name 'base_config' is not defined "
        f"({config_file} line 2); fix the file (--verbose for the "
        "traceback)."), line
  else:
    assert "cannot load the config file" in line, line
    assert "No such file" in line, line
  assert not workdir.exists()


def test_the_index_code_needs_chunks_and_reaches_the_download():
  from dipaco_jax import paths as paths_lib  # pylint: disable=g-import-not-at-top
  from dipaco_jax.diloco import comm as comm_lib  # pylint: disable=g-import-not-at-top
  config = testing.comm_config(compression="topk",
                               compression_index_code="elias_fano")
  with pytest.raises(config_base.ConfigError,
                     match=r"diloco.compression_index_code: "
                     r".*compression_topk_chunk > 0"):
    config_base.validate(config, num_devices=8)
  config.diloco.compression_topk_chunk = 4096
  config.diloco.download_compression = "topk"
  config_base.validate(config, num_devices=8)
  slots = paths_lib.topology_from_config(config).slots
  for comm in comm_lib.comm_by_slot(config, slots).values():
    assert comm.spec.index_code == comm.download_spec.index_code == (
        "elias_fano")


def test_the_sparse_aggregate_is_top_ks_alone():
  from dipaco_jax import paths as paths_lib  # pylint: disable=g-import-not-at-top
  from dipaco_jax.diloco import comm as comm_lib  # pylint: disable=g-import-not-at-top
  # The default, senders, applies to top-k slots; every other codec takes
  # the plain mean (a zero of a dense payload is a value).
  config = testing.comm_config(compression="int4",
                               per_slot="level=compression:topk")
  assert config.diloco.sparse_aggregate == "senders"
  comms = comm_lib.comm_by_slot(
      config, paths_lib.topology_from_config(config).slots)
  assert {n: c.spec.aggregate for n, c in comms.items()} == {
      "embed_head": "mean", "layers_00_01": "senders",
      "layers_02_03": "senders"}
  config_base.validate(config, num_devices=8)
  # Top-k under eager: the workers' views assume the mean's weights.
  config = testing.comm_config(compression="topk", delay="eager")
  with pytest.raises(config_base.ConfigError, match=r"^config\.diloco\."
                     r"sparse_aggregate: senders \(top-k's default\) is not "
                     r"built for delay eager"):
    config_base.validate(config, num_devices=8)
  config.diloco.sparse_aggregate = "mean"
  config_base.validate(config, num_devices=8)


@pytest.mark.parametrize("dtype,want", [("float32", "xla"),
                                        ("bfloat16", "cudnn")])
def test_auto_attention_takes_cudnn_only_where_it_runs(monkeypatch, dtype,
                                                       want):
  # cuDNN's fused attention raised NotImplementedError on a float32 model
  # on a GPU (quickstart.py); auto leaves it to XLA there.
  from dipaco_jax.model import layers  # pylint: disable=g-import-not-at-top
  config = testing.tiny_config("2x2", inner_steps=4, num_steps=8)
  config.model.dtype = dtype
  monkeypatch.setattr(layers.jax, "default_backend", lambda: "gpu")
  assert layers.dims_from_config(config.model, 256).attention == want
