"""Failures a user causes or meets are one line naming what to change
(issue 41): a --config file that gives no config, a damaged or occupied
export, a full disk, a step too big for the device. The command-line
behaviour itself (one line, exit status 2) is tested by subprocess in
tests/test_config_validation.py; here the messages, in process."""

import sys

import pytest

from dipaco_jax import cli_errors


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
