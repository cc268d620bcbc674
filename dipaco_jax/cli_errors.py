"""One-line errors for `dipaco_jax.main`: flags, config overrides, workdir.

A mistake on the command line should cost one readable line, not a
55-line traceback from inside absl or ml_collections: `parse_flags` replaces
absl's flag parser and explains what went wrong (an unknown config field
with its closest match, a value of the wrong type, a bad flag), and
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
from typing import NoReturn

from absl import flags
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
  reported as one line naming the flag or config field."""
  try:
    remaining = flags.FLAGS(argv)
  except Exception as e:  # pylint: disable=broad-except
    if wants_traceback(argv):
      raise
    if isinstance(e, (OSError, SyntaxError)):
      # Overrides make absl load the --config file while parsing.
      fail(config_file_message(e, argv))
    message = flag_error_message(e, argv)
    if message is None:
      raise  # Not a mistake on the command line we can explain: a bug.
    fail(message)
  _check_config_loaded(argv)
  return remaining


def _check_config_loaded(argv) -> None:
  """ml_collections defers a missing or unreadable --config file to the
  first access of the config; report it now, before any compute."""
  try:
    flags.FLAGS[_CONFIG_FLAG].value.get("seed")
  except (OSError, SyntaxError) as e:
    if wants_traceback(argv):
      raise
    fail(config_file_message(e, argv))


def config_file_message(error: OSError | SyntaxError, argv) -> str:
  """One line for a --config file that is missing, unreadable or not
  Python: the file, what is wrong, and (for Python) where."""
  prefix = f"--{_CONFIG_FLAG}={_config_argument(argv)}: cannot load the config"
  if isinstance(error, SyntaxError):
    return (f"{prefix} file: it is not valid Python ({error.msg}, "
            f"{error.filename} line {error.lineno}); fix the file, or point "
            "--config at an experiments/*.py file.")
  last = [l for l in str(error).splitlines() if l.strip()][-1].strip()
  return (f"{prefix} file ({last}); give the path of an existing "
          "experiments/*.py file.")


def flag_error_message(error: Exception, argv) -> str | None:
  """One line for a failed parse of `argv`, or None when it is not a flag
  mistake (then the caller keeps the traceback)."""
  unknown = _first_unknown_override(argv)
  if unknown is not None:
    return unknown
  if not isinstance(error, flags.Error):
    return None
  message = str(error)
  if "Error whilst parsing config file" in message:
    # ml_collections wraps an exception of get_config() with its whole
    # traceback; its last line says what went wrong.
    flag, _, rest = message.partition(": ")
    last = [l for l in rest.splitlines() if l.strip()][-1].strip()
    return (f"{flag.removeprefix('flag ')}: get_config() raised {last} "
            "(--verbose for the traceback)")
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
def user_errors(verbose: bool):
  """Reports a user error raised inside as one line and exits 2; anything
  else (a bug) propagates with its traceback, as does everything with
  `verbose`."""
  try:
    yield
  except Exception as e:  # pylint: disable=broad-except
    if verbose or not is_user_error(e):
      raise
    fail(str(e))
