"""Failures a user causes or meets are one line naming what to change
(issue 41): a --config file that gives no config, a damaged or occupied
export, a full disk, a step too big for the device. The command-line
behaviour itself (one line, exit status 2) is tested by subprocess in
tests/test_config_validation.py; here the messages, in process."""

import os
import re
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
  # A failed export (a full disk) leaves the earlier one as it was.
  with pytest.raises(OSError):
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
  hook = cli_errors.quiet_closed_loops(seen.append)
  for error in (RuntimeError("Event loop is closed"), RuntimeError("other"),
                ValueError("Event loop is closed")):
    hook(types.SimpleNamespace(exc_value=error))
  assert [str(u.exc_value) for u in seen] == ["other", "Event loop is closed"]
