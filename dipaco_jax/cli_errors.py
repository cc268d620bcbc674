"""One-line errors for `dipaco_jax.main`: flags, config overrides, workdir.

A mistake on the command line should cost one readable line, not a
55-line traceback from inside absl or ml_collections: `parse_flags` replaces
absl's flag parser and explains what went wrong (an unknown config field
with its closest match, a value of the wrong type, a bad flag, a --config
file that is missing, not Python, raising or returning no config), and
`user_errors` turns the errors meant for the user (`errors.UserError` and a
few known others) raised by the job into `error: <message>`. Both exit with
status 2; `--verbose` keeps the traceback. Nothing here imports JAX.
"""

import contextlib
import difflib
import os
import pathlib
import re
import sys
import sysconfig
import traceback
from typing import NoReturn

from absl import flags
from absl import logging as absl_logging
import ml_collections
from ml_collections.config_flags import config_flags

from dipaco_jax import errors

EXIT_USAGE = 2  # As argparse: the command line (or config) is wrong.
_CONFIG_FLAG = "config"
# `--config.a.b=1`, `--config.a.b 1` and, for booleans, `--noconfig.a.b`.
_OVERRIDE = re.compile(rf"^--?(?:no)?{_CONFIG_FLAG}\.([^=\s]+)")


def one_line(message) -> str:
  """`message` with its lines joined: a terminal, a log grep and a CI
  summary all keep the whole of it."""
  parts = [line.strip() for line in str(message).splitlines() if line.strip()]
  out = ""
  for part in parts:
    if out:
      out += " " if out.endswith((":", ".", ";", ",")) else "; "
    out += part
  return out


def fail(message) -> NoReturn:
  print(f"error: {one_line(message)}", file=sys.stderr, flush=True)
  sys.exit(EXIT_USAGE)


def wants_traceback(argv) -> bool:
  """`--verbose` read straight from argv: it must work when flag parsing
  itself is what failed."""
  return any(a in ("--verbose", "--verbose=true", "--verbose=True", "-verbose")
             for a in argv)


# --- Flag parsing -----------------------------------------------------------


def parse_flags(argv):
  """`app.run(..., flags_parser=parse_flags)`: absl's parse, with failures
  reported as one line naming the flag, the config field or the file."""
  try:
    with _quiet_config_loader():
      remaining = flags.FLAGS(argv)
  except Exception as e:  # pylint: disable=broad-except
    if wants_traceback(argv):
      raise
    # Overrides make absl load the --config file while parsing; whatever
    # the file raises escapes absl unwrapped (or as a TypeError/ValueError
    # holding its traceback).
    message = config_file_problem(argv) or flag_error_message(e, argv)
    if message is None:
      raise  # Not a mistake on the command line we can explain: a bug.
    fail(message)
  _check_config_loaded(argv)
  return remaining


def _check_config_loaded(argv) -> None:
  """ml_collections defers a missing or unreadable --config file to the
  first access of the config, and takes any value get_config() returns;
  report either now, before any compute."""
  value = flags.FLAGS[_CONFIG_FLAG].value if _CONFIG_FLAG in flags.FLAGS else (
      ml_collections.ConfigDict())
  if isinstance(value, ml_collections.ConfigDict):
    return
  if wants_traceback(argv):
    value.get("seed")  # Raises the loader's error, with its traceback.
  fail(config_file_problem(argv) or f"--{_CONFIG_FLAG}: no config loaded.")


# --- The --config file ------------------------------------------------------


def config_file_problem(argv) -> str | None:
  """One line for the --config file of `argv` when it gives no config
  (missing, not Python, raising while it loads or in get_config(), without
  get_config(), returning something else); None when it loads, or when
  argv has no --config."""
  path = _config_argument(argv)
  if path is None:
    return None
  try:
    with _quiet_config_loader():
      config = config_flags.ConfigFileFlagParser(
          _CONFIG_FLAG, lock_config=False).parse(path)
    if type(config).__name__ == "_ErrorConfig":
      config.get("seed")  # Raises the load error ml_collections deferred.
  except Exception as e:  # pylint: disable=broad-except
    return config_file_message(e.__cause__ if _deferred(e) else e, argv)
  if not isinstance(config, ml_collections.ConfigDict):
    got = "None" if config is None else f"a {type(config).__name__}"
    return (f"--{_CONFIG_FLAG}={path}: get_config() returned {got}, not a "
            "ConfigDict; end it with `return config`, as experiments/*.py "
            "do.")
  return None


def _deferred(error: Exception) -> bool:
  """ml_collections' IOError standing for the load error it kept."""
  return isinstance(error, OSError) and error.__cause__ is not None and (
      "earlier failure to load" in str(error))


def config_file_message(error: Exception, argv) -> str:
  """One line for a --config file that is missing, unreadable, not Python
  or raising: the file, what is wrong, where, and the fix."""
  path = _config_argument(argv)
  prefix = f"--{_CONFIG_FLAG}={path}: cannot load the config"
  if isinstance(error, SyntaxError):
    return (f"{prefix} file: it is not valid Python ({error.msg}, "
            f"{error.filename} line {error.lineno}); fix the file, or point "
            "--config at an experiments/*.py file.")
  if isinstance(error, OSError):
    last = [l for l in str(error).splitlines() if l.strip()][-1].strip()
    return (f"{prefix} file ({last}); give the path of an existing "
            "experiments/*.py file.")
  if isinstance(error, AttributeError) and getattr(
      error, "name", None) == "get_config":
    return (f"{prefix}: the file defines no get_config(); an experiments/*.py "
            "file defines get_config() returning a ConfigDict.")
  text = str(error)
  if "Error whilst parsing config file" in text:
    # ml_collections re-raises a TypeError/ValueError of get_config() with
    # the original traceback as its message: its last line is the error.
    what = [l for l in text.splitlines() if l.strip()][-1].strip()
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', text)
  else:
    what = f"{type(error).__name__}: {one_line(text)}"
    frames = [(f.filename, f.lineno, f.name)
              for f in traceback.extract_tb(error.__traceback__)]
  frame = _innermost_own_frame(frames)
  where = f" ({frame[0]} line {frame[1]})" if frame else ""
  raised = ("importing it raised" if frame and frame[2] == "<module>" else
            "get_config() raised")
  # A TypeError or ValueError is most often a check saying what to change
  # (`experiments/quickstart.py:tiny`); anything else, a bug in the file.
  fix = "" if isinstance(error, (TypeError, ValueError)) else "; fix the file"
  return (f"--{_CONFIG_FLAG}={path}: {raised} {what}{where}{fix} "
          "(--verbose for the traceback).")


def _innermost_own_frame(frames):
  """(file, line, function) of the innermost frame outside installed
  packages and Python itself: in the config file or what it calls."""
  stdlib = sysconfig.get_paths()["stdlib"]
  ours = [f for f in frames if not f[0].startswith(("<", stdlib)) and
          not {"site-packages", "dist-packages"} & set(pathlib.Path(
              f[0]).parts)]
  return ours[-1] if ours else None


@contextlib.contextmanager
def _quiet_config_loader():
  """Drops ml_collections' own log lines while the --config file loads
  (`get_config() returned None, did you forget...`): the error says it."""
  def keep(record):
    return not record.pathname.endswith("config_flags.py")
  logger = absl_logging.get_absl_logger()
  logger.addFilter(keep)
  try:
    yield
  finally:
    logger.removeFilter(keep)


def flag_error_message(error: Exception, argv) -> str | None:
  """One line for a failed parse of `argv`, or None when it is not a flag
  mistake (then the caller keeps the traceback)."""
  unknown = _first_unknown_override(argv)
  if unknown is not None:
    return unknown
  if not isinstance(error, flags.Error):
    return None
  message = str(error)
  return _override_value_message(message, argv) or one_line(
      message.removeprefix("flag "))


def _override_value_message(message: str, argv) -> str | None:
  """'flag --config.train.num_steps=abc: invalid literal...' ->
  'config.train.num_steps: expects an integer, got 'abc' (invalid ...)'."""
  m = re.match(rf"flag --{_CONFIG_FLAG}\.([\w.]+)=(.*?): (.*)", message,
               re.DOTALL)
  if not m:
    return None
  field, value, detail = m.groups()
  kind = _describe_type(_default_of(field, argv))
  expects = f"expects {kind}, " if kind else ""
  return one_line(f"{_CONFIG_FLAG}.{field}: {expects}got {value!r} "
                  f"({detail})")


def _describe_type(value) -> str | None:
  for kind, text in ((bool, "True or False"), (int, "an integer"),
                     (float, "a number"), (str, "a string"),
                     (tuple, "a tuple"),
                     (ml_collections.ConfigDict, "a section of fields")):
    if isinstance(value, kind):
      return text
  return None


# --- Unknown config fields --------------------------------------------------


def _first_unknown_override(argv) -> str | None:
  """The message for the first `--config.X` override naming no field."""
  overrides = [m.group(1) for m in map(_OVERRIDE.match, argv) if m]
  if not overrides:
    return None
  known = field_names(_experiment_config(argv))
  for name in overrides:
    if name not in known:
      return unknown_field_message(name, known)
  return None


def unknown_field_message(name: str, known) -> str:
  guesses = _close_fields(name, sorted(known))
  hint = (f"did you mean {' or '.join(f'{_CONFIG_FLAG}.{g}' for g in guesses)}?"
          if guesses else "the fields are listed in dipaco_jax/config_base.py.")
  return f"Unknown config field {_CONFIG_FLAG}.{name}; {hint}"


def _close_fields(name: str, known: list[str]) -> list[str]:
  """Fields with the same last name in another section first (a field
  given the wrong section: `train.warmup_steps`), else the spelling's
  nearest (`train.num_stepz`)."""
  leaf = name.rsplit(".", 1)[-1]
  moved = [k for k in known if k.rsplit(".", 1)[-1] == leaf]
  return moved[:3] or difflib.get_close_matches(name, known, n=1)


def field_names(config, prefix: str = "") -> set[str]:
  """Dotted names of every field and section of a ConfigDict."""
  names = set()
  for key, value in config.items():
    names.add(prefix + key)
    if isinstance(value, ml_collections.ConfigDict):
      names |= field_names(value, f"{prefix}{key}.")
  return names


def _experiment_config(argv) -> ml_collections.ConfigDict:
  """The config the --config file builds (it may add fields), else the
  base config: the suggestion must not depend on the file loading."""
  from dipaco_jax import config_base  # pylint: disable=g-import-not-at-top
  path = _config_argument(argv)
  if path is not None:
    try:
      config = config_flags.ConfigFileFlagParser(
          _CONFIG_FLAG, lock_config=False).parse(path)
      if isinstance(config, ml_collections.ConfigDict):
        return config
    except Exception:  # pylint: disable=broad-except
      pass  # Its own error is reported once the field names are right.
  return config_base.base_config()


def _config_argument(argv) -> str | None:
  """The value of `--config=PATH` or `--config PATH` in argv; the last one,
  as absl takes."""
  found = None
  for i, arg in enumerate(argv):
    m = re.match(rf"^--?{_CONFIG_FLAG}(=(.*))?$", arg)
    if m and m.group(1) is not None:
      found = m.group(2)
    elif m and i + 1 < len(argv):
      found = argv[i + 1]
  return found


def _default_of(field: str, argv):
  value = _experiment_config(argv)
  for key in field.split("."):
    if not isinstance(value, ml_collections.ConfigDict) or key not in value:
      return None
    value = value[key]
  return value


# --- --workdir --------------------------------------------------------------


def check_workdir(path: str | None) -> bool:
  """absl validator of --workdir: refuses a path that can never be a run
  directory before anything is computed or created (the OS error would
  come mid-run, without naming the flag). Raises flags.ValidationError."""
  if path is None:
    return True  # The required-flag check reports it.
  if not path.strip():
    raise flags.ValidationError("is empty; give the run's directory.")
  if "://" in path:
    return True  # gs:// and other remote stores: checked when written.
  target = pathlib.Path(path).absolute()
  if target.exists() and not target.is_dir():
    raise flags.ValidationError("is an existing file; give a directory (new "
                                "or existing).")
  existing = next(p for p in (target, *target.parents) if p.exists())
  if not existing.is_dir():
    raise flags.ValidationError(f"{existing} is a file, so no directory can "
                                "be created under it.")
  if not os.access(existing, os.W_OK | os.X_OK):
    raise flags.ValidationError(f"{existing} is not writable.")
  return True


# --- Errors raised by the job -----------------------------------------------


def is_user_error(error: BaseException) -> bool:
  """Whether `error` is meant for the user (one line) rather than a bug
  (a traceback)."""
  if isinstance(error, (errors.UserError, FloatingPointError)):
    return True  # FloatingPointError: the divergence guard of the loop.
  # Only when the module is loaded can its errors have been raised; this
  # keeps JAX and orbax out of a failure before the job started.
  checkpoint = sys.modules.get("dipaco_jax.train.checkpoint")
  if checkpoint is not None and isinstance(error, tuple(
      getattr(checkpoint, name) for name in (
          "CheckpointMismatchError", "CheckpointDamagedError")
      if hasattr(checkpoint, name))):
    return True
  if isinstance(error, FileNotFoundError):
    # Built with our own message (errno unset): an OS error has an errno.
    return error.errno is None
  if isinstance(error, ValueError):
    # Older checks raise ValueError; those meant for the user name the
    # config field or the flag to change.
    return bool(re.search(r"\bconfig\.\w|(^|\s)--\w", str(error)))
  return False


@contextlib.contextmanager
def user_errors(verbose: bool, disk_flag: str = "--workdir"):
  """Reports a user error raised inside as one line and exits 2: an error
  meant for the user, a full disk (`disk_flag` is where the writes can go
  instead), device memory exhausted; anything else (a bug) propagates with
  its traceback, as does everything with `verbose`."""
  if not verbose:
    errors.quiet_noise()
  try:
    yield
  except Exception as e:  # pylint: disable=broad-except
    if verbose:
      raise
    message = None
    if not isinstance(e, errors.UserError):  # Whose message says it.
      message = errors.disk_full_message(e, disk_flag) or _memory_message(e)
    if message is None and not is_user_error(e):
      raise
    fail(message or str(e))


def _memory_message(error: Exception) -> str | None:
  """One line for device memory exhausted, naming the config fields that
  size a step (`train/memory_estimate.py`, loaded once a config is)."""
  estimate = sys.modules.get("dipaco_jax.train.memory_estimate")
  return None if estimate is None else estimate.out_of_memory_message(error)
