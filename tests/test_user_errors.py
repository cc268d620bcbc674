"""Failures a user causes or meets are one line naming what to change: a
--config file that gives no config, an occupied export directory, a full
disk (tests/test_generate.py: a damaged export; test_memory_estimate.py: a
step too big for the device). The command-line behaviour itself (one line,
exit status 2) is tested by subprocess in tests/test_config_validation.py;
here the messages, in process."""

import errno
import logging
import os
import re
import shutil
import sys
import types

from etils import epath
import pytest

from dipaco_jax import cli_errors
from dipaco_jax import errors


# --- A --config file that gives no config -----------------------------------


@pytest.fixture(autouse=True)
def _fresh_config_module(monkeypatch):
  # ml_collections loads every --config file as module `config_config`, into
  # the one already there: a get_config() would outlive its file here.
  monkeypatch.delitem(sys.modules, "config_config", raising=False)


@pytest.mark.parametrize("source,expected", [
    ("def get_config(:\n", "cannot load the config file: it is not valid "
     "Python (invalid syntax, {file} line 1); fix the file"),
    ("import no_such_module_here\n", "importing it raised "
     "ModuleNotFoundError: No module named 'no_such_module_here' ({file} "
     "line 1); fix the file (--verbose for the traceback)."),
    ("def get_config():\n  return undefined_name\n", "get_config() raised "
     "NameError: name 'undefined_name' is not defined ({file} line 2); fix "
     "the file (--verbose for the traceback)."),
    # A ValueError is a check of its own: its message says what to change.
    ("def get_config():\n  raise ValueError('size must be small')\n",
     "get_config() raised ValueError: size must be small ({file} line 2) "
     "(--verbose for the traceback)."),
    ("X = 1\n", "cannot load the config: the file defines no get_config()"),
    ("def get_config():\n  pass\n", "get_config() returned None, not a "
     "ConfigDict; end it with `return config`"),
    ("def get_config():\n  return {'seed': 1}\n", "get_config() returned a "
     "dict, not a ConfigDict"),
], ids=["syntax", "import", "name", "value", "no_get_config", "none", "dict"])
@pytest.mark.parametrize("overrides", [(), ("--config.seed=1",)],
                         ids=["alone", "with_overrides"])
def test_a_config_file_giving_no_config_is_one_line(tmp_path, source,
                                                   expected, overrides):
  config_file = tmp_path / "experiment.py"
  config_file.write_text(source)
  argv = ["main", f"--config={config_file}", *overrides, "--workdir=/w"]
  message = cli_errors.config_file_problem(argv)
  assert message.startswith(f"--config={config_file}: "), message
  assert expected.format(file=config_file) in message, message
  assert "\n" not in message


def test_a_missing_config_file_or_directory_names_it(tmp_path):
  message = cli_errors.config_file_problem(
      ["main", f"--config={tmp_path / 'missing.py'}", "--config.seed=1"])
  assert "No such file or directory" in message and "missing.py" in message
  message = cli_errors.config_file_problem(["main", f"--config={tmp_path}"])
  assert message == (f"--config={tmp_path}: cannot load the config file "
                     f"([Errno 21] Is a directory: '{tmp_path}'); give the "
                     "path of an existing experiments/*.py file.")


def test_a_config_file_that_loads_is_no_problem():
  assert cli_errors.config_file_problem(
      ["main", "--config=experiments/quickstart.py:small"]) is None
  assert cli_errors.config_file_problem(["main", "--workdir=/w"]) is None


# --- Exporting into an occupied --out ----------------------------------------


def _fake_export(directory, path=0):
  """What save_path writes, without a model (`inference/exported.py`)."""
  (directory / "params" / "item").mkdir(parents=True)
  (directory / "params" / "item" / "array").write_text(f"path {path}")
  (directory / "model.json").write_text("{}")
  (directory / "spm.model").write_text("tokenizer")


@pytest.fixture
def fake_export(monkeypatch):
  """command_export.export on a stand-in workdir of 4 paths, whose save
  writes `_fake_export` (or fails when the test says)."""
  from dipaco_jax.inference import command_export  # pylint: disable=g-import-not-at-top
  fails = []

  def save_path(w, path, out, params=None):
    del w, params
    _fake_export(epath.Path(out), path)
    if fails:
      raise OSError(28, "No space left on device")
    return f"path {path} -> {out}"
  monkeypatch.setattr(command_export.workdir_lib, "TrainedWorkdir",
                      lambda workdir: types.SimpleNamespace(num_paths=4))
  monkeypatch.setattr(command_export, "save_path", save_path)

  def export(out, path, overwrite=False, fail=False):
    fails[:] = [True] if fail else []
    return command_export.export("/w", str(out), path, False, False,
                                 overwrite)
  return export


def _tree(directory):
  return {str(p.relative_to(directory)): p.read_text()
          for p in sorted(directory.rglob("*")) if p.is_file()}


def test_export_into_a_non_empty_directory_is_refused(tmp_path, fake_export):
  out = tmp_path / "notes"
  out.mkdir()
  (out / "todo.txt").write_text("mine")
  for overwrite in (False, True):  # --overwrite replaces only an export.
    with pytest.raises(errors.UserError, match=re.escape(
        f"--out={out} is not empty (todo.txt) and holds no export; give a "
        "new or empty directory (--overwrite replaces an export, nothing "
        "else).")):
      fake_export(out, 1, overwrite)
  # An export with a file of the user's beside it: refused too.
  _fake_export(tmp_path / "export")
  (tmp_path / "export" / "README.txt").write_text("mine")
  with pytest.raises(errors.UserError, match=r"holds files an export does "
                     r"not write \(README\.txt\)"):
    fake_export(tmp_path / "export", 1, overwrite=True)
  assert sorted(os.listdir(tmp_path)) == ["export", "notes"]
  assert _tree(out) == {"todo.txt": "mine"}


def test_overwrite_replaces_an_export_and_a_failure_keeps_it(tmp_path,
                                                            fake_export):
  out = tmp_path / "out"
  assert fake_export(out, 2) == [f"path 2 -> {out}"]
  with pytest.raises(errors.UserError, match="already holds an export; give "
                     "--overwrite to replace it, or another --out."):
    fake_export(out, 1)
  (out / "path_007").mkdir()  # Left by an earlier export of everything.
  before = _tree(out)
  # A failed export (a full disk) leaves the earlier one as it was
  # ("path 1", "{}", "tokenizer": 17 bytes written when it failed).
  with pytest.raises(errors.UserError, match=re.escape(
      f"disk full writing --out={out} (the export had reached 17 bytes, and "
      "is removed); free space or point --out elsewhere.")):
    fake_export(out, 1, overwrite=True, fail=True)
  assert _tree(out) == before and (out / "path_007").is_dir()
  assert fake_export(out, 1, overwrite=True) == [f"path 1 -> {out}"]
  assert _tree(out) == {"model.json": "{}", "params/item/array": "path 1",
                        "spm.model": "tokenizer"}
  assert not (out / "path_007").exists()
  assert os.listdir(tmp_path) == ["out"]  # Nothing staged is left.


def test_after_a_failed_read_closed_loop_noise_is_dropped():
  # Tensorstore's reads that finish after orbax closed its event loop
  # print a traceback each, around the error's one line.
  seen = []
  hook = errors.quiet_closed_loops(seen.append)
  for error in (RuntimeError("Event loop is closed"), RuntimeError("other"),
                ValueError("Event loop is closed")):
    hook(types.SimpleNamespace(exc_value=error))
  assert [str(u.exc_value) for u in seen] == ["other", "Event loop is closed"]


# --- A full disk --------------------------------------------------------------

_ORBAX_DISK_FULL = (
    'RESOURCE_EXHAUSTED: Error writing "opt_state.1.0.count/0" in OCDBT '
    'database at local file "{ckpt}/300.orbax-checkpoint-tmp/inner.orbax-'
    'checkpoint-tmp/ocdbt.process_0/": Failed writing: "{ckpt}/300.orbax-'
    'checkpoint-tmp/inner.orbax-checkpoint-tmp/ocdbt.process_0/d/6848": '
    "Failed to write 9478144 bytes to file 22: No space left on device "
    "[os_error_code='28']")


def _free(path):
  return errors.format_bytes(shutil.disk_usage(path).free)


def _raised(error, cause=None):
  """`error` as raised (with a traceback), from `cause`."""
  try:
    raise error from cause
  except Exception as e:  # pylint: disable=broad-except
    return e


def test_disk_full_in_a_checkpoint_names_the_step_and_its_size(tmp_path):
  ckpt = tmp_path / "runs" / "dipaco" / "checkpoints"
  (ckpt / "150" / "inner").mkdir(parents=True)
  (ckpt / "150" / "inner" / "data").write_bytes(b"x" * 3000)
  # As orbax raises it: tensorstore's status in a ValueError, wrapped again.
  error = _raised(RuntimeError("save failed"), _raised(ValueError(
      _ORBAX_DISK_FULL.format(ckpt=ckpt))))
  assert errors.disk_full_message(error) == (
      f"disk full writing {ckpt}/300 (the checkpoint is about 2.9 KiB, "
      f"{_free(tmp_path)} free there); free space or point --workdir "
      "elsewhere.")
  # The run's first checkpoint: what the failed write needed, at least.
  shutil.rmtree(ckpt / "150")
  assert errors.disk_full_message(error, "--out").startswith(
      f"disk full writing {ckpt}/300 (needs at least 9.0 MiB more, ")


def test_disk_full_in_a_plain_write_names_the_file(tmp_path):
  # An OSError of a write has no file name: the open file in the frame
  # where it was raised has it (an atomic write's temporary stands for the
  # file it becomes).
  def write(path):
    with open(path, "wb") as f:
      f.write(b"")
      raise OSError(errno.ENOSPC, "No space left on device")
  tmp = tmp_path / f".train.npz.tmp-12-{'a' * 32}"
  with pytest.raises(OSError) as e:
    write(tmp)
  # A cleanup that failed the same way after it: the first failure wins.
  later = _raised(OSError(errno.ENOSPC, "No space left on device"), None)
  later.__context__ = e.value
  assert errors.disk_full_message(later) == (
      f"disk full writing {tmp_path}/train.npz ({_free(tmp_path)} free "
      "there); free space or point --workdir elsewhere.")
  named = OSError(errno.ENOSPC, "No space left on device",
                  str(tmp_path / "results.json"))
  assert errors.disk_full_message(named).startswith(
      f"disk full writing {tmp_path}/results.json (")


@pytest.mark.parametrize("error", [
    OSError(errno.EACCES, "Permission denied", "/w/x"),
    ValueError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
               "123 bytes."),
    KeyError("step"),
])
def test_other_errors_are_no_full_disk(error):
  assert errors.disk_full_message(error) is None


def test_a_full_disk_is_one_line_and_orbax_logs_of_it_are_dropped(
    tmp_path, capsys):
  ckpt = tmp_path / "checkpoints"
  with pytest.raises(SystemExit) as e, cli_errors.user_errors(verbose=False):
    raise ValueError(_ORBAX_DISK_FULL.format(ckpt=ckpt))
  assert e.value.code == 2
  assert capsys.readouterr().err == (
      f"error: disk full writing {ckpt}/300 (needs at least 9.0 MiB more, "
      f"{_free(tmp_path)} free there); free space or point --workdir "
      "elsewhere.\n")
  keep = errors.DiskFullLogFilter().filter
  record = logging.LogRecord("absl", logging.ERROR, "future.py", 387,
                             "_SignalingThread.run() raised an exception: "
                             "%s", (ValueError(_ORBAX_DISK_FULL),), None)
  assert not keep(record)
  record.args = (ValueError("another failure"),)
  assert keep(record)
