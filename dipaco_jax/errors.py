"""Errors meant for the person running the job, not for a debugger.

`dipaco_jax.main` prints a `UserError` as one line (`error: <message>`) and
exits with status 2, without a traceback (`--verbose` shows it). Raise it, or
a subclass, wherever the fix is on the user's side (a flag, a config field,
the data, the workdir), with a message that names what to change. Anything
else that escapes is a bug and keeps its traceback.

A full disk is the user's to fix too, wherever it strikes (a checkpoint, a
data stage, the results): `disk_full_message` finds it anywhere in an
exception's chain, as an `OSError` (ENOSPC) or as the text tensorstore
gives it under orbax's wrappers, and says in one line what was being
written, how big it is, and how much is free. Nothing here imports JAX.
"""

import errno
import io
import logging
import os
import re
import shutil
import sys
import traceback

# How tensorstore (under orbax) says ENOSPC: a status text, not an OSError.
_DISK_FULL_TEXT = re.compile(r"No space left on device|os_error_code='?28\b")
_FAILED_WRITE = re.compile(r"Failed to write (\d+) bytes")
_QUOTED_PATH = re.compile(r'"((?:/|[a-z][a-z0-9]*://)[^"]+)"')
# Orbax writes step N into `N.orbax-checkpoint-tmp...` and renames it once
# complete: what failed is checkpoint step N, and N itself was never made.
_ORBAX_TMP = re.compile(r"^(.*?)\.orbax-checkpoint-tmp[^/]*")
_ATOMIC_TMP = re.compile(r"^(.*/)?\.([^/]+)\.tmp-\d+-[0-9a-f]{32}$")


class UserError(Exception):
  """A problem the user fixes; the message names the flag or field."""


def exception_chain(error: BaseException, limit: int = 32) -> list:
  """`error`, its causes and contexts, and the members of exception
  groups, each once, outermost first."""
  seen, todo = [], [error]
  while todo and len(seen) < limit:
    e = todo.pop(0)
    if e is None or any(e is s for s in seen):
      continue
    seen.append(e)
    todo += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
  return seen


def mentions_disk_full(text: str) -> bool:
  return bool(_DISK_FULL_TEXT.search(text))


def disk_full_message(error: BaseException,
                      flag: str = "--workdir") -> str | None:
  """One line for a write that failed on a full disk anywhere in `error`'s
  chain, or None; `flag` is where the user points the writes instead. The
  first failure (the innermost of the chain) that names its file wins:
  later ones are often cleanups failing the same way."""
  found = []
  for e in reversed(exception_chain(error)):
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
      path = e.filename if isinstance(e.filename, str) else _open_file(e)
      found.append((path, None))
    elif mentions_disk_full(text := str(e)):
      paths = _QUOTED_PATH.findall(text)
      write = _FAILED_WRITE.search(text)
      found.append((paths[0] if paths else None,
                    int(write.group(1)) if write else None))
  if not found:
    return None
  path, failed_write = next((f for f in found if f[0]), found[0])
  return _disk_full(path, failed_write, flag)


def _open_file(error: BaseException) -> str | None:
  """The file being written where `error` was raised: an OSError of a
  write carries no file name, but the frames hold the file object (the
  innermost one open for writing). An atomic write's temporary name is
  given as the file it stands for (`store/atomic.py`)."""
  frames = [frame for frame, _ in traceback.walk_tb(error.__traceback__)]
  for frame in reversed(frames):
    for value in frame.f_locals.values():
      name = getattr(value, "name", None)
      if isinstance(value, io.IOBase) and isinstance(name, str) and (
          set(getattr(value, "mode", "")) & set("wax+")):
        return _ATOMIC_TMP.sub(r"\1\2", name)
  return None


def _disk_full(path: str | None, failed_write: int | None, flag: str) -> str:
  where, size = path, None
  if path and (m := _ORBAX_TMP.match(path)):
    where = m.group(1)
    size = _newest_checkpoint_bytes(os.path.dirname(where))
  facts = []
  if size:
    facts.append(f"the checkpoint is about {format_bytes(size)}")
  elif failed_write:
    facts.append(f"needs at least {format_bytes(failed_write)} more")
  free = _free_bytes(where)
  if free is not None:
    facts.append(f"{format_bytes(free)} free there")
  detail = f" ({', '.join(facts)})" if facts else ""
  return (f"disk full writing {where or 'a file'}{detail}; free space or "
          f"point {flag} elsewhere.")


def _newest_checkpoint_bytes(directory: str) -> int | None:
  """Bytes of the newest finished step under a checkpoint directory: the
  size the failed one would have had (the state's shapes do not change)."""
  try:
    steps = [n for n in os.listdir(directory) if n.isdigit()]
  except OSError:
    return None
  if not steps:
    return None
  total = 0
  for root, _, files in os.walk(os.path.join(directory,
                                             max(steps, key=int))):
    total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
  return total


def _free_bytes(path: str | None) -> int | None:
  if not path or "://" in path:
    return None
  path = os.path.abspath(path)
  while not os.path.exists(path) and os.path.dirname(path) != path:
    path = os.path.dirname(path)
  try:
    return shutil.disk_usage(path).free
  except OSError:
    return None


def format_bytes(n: float) -> str:
  """1536 -> '1.5 KiB'."""
  for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB"):
    if n < 1024 or unit == "PiB":
      return f"{n:,.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
    n /= 1024
  raise AssertionError("unreachable")


# --- What would print around the one line -----------------------------------


def quiet_noise() -> None:
  """Keeps what follows from burying a one-line error: orbax's logs of a
  full disk, asyncio's closed-loop tracebacks after a failed read."""
  if not hasattr(sys.unraisablehook, "quiet"):
    sys.unraisablehook = quiet_closed_loops(sys.unraisablehook)
  _drop_disk_full_logs()


class DiskFullLogFilter(logging.Filter):
  """Drops log records about a full disk: orbax logs each of its failed
  writer threads with a traceback (hundreds of lines) before the error
  reaches `user_errors`, which then says it in one line."""

  def filter(self, record):
    try:
      text = record.getMessage()
    except Exception:  # pylint: disable=broad-except
      text = str(record.msg)
    if record.exc_info and record.exc_info[1] is not None:
      text += str(record.exc_info[1])
    return not mentions_disk_full(text)


def _drop_disk_full_logs() -> None:
  drop = DiskFullLogFilter()
  for logger in (logging.getLogger(), logging.getLogger("absl")):
    if not any(isinstance(f, DiskFullLogFilter) for f in logger.filters):
      logger.addFilter(drop)
    for handler in logger.handlers:  # Records of child loggers pass here.
      if not any(isinstance(f, DiskFullLogFilter) for f in handler.filters):
        handler.addFilter(drop)


def quiet_closed_loops(previous):
  """An unraisable-exception hook without asyncio's `Event loop is closed`:
  after a failed orbax read, tensorstore's other reads still finish and
  call back into the loop orbax has closed, each printing a traceback,
  after the error's one line (or before it)."""
  def hook(unraisable):
    e = unraisable.exc_value
    if not (isinstance(e, RuntimeError) and str(e) == "Event loop is closed"):
      previous(unraisable)
  hook.quiet = True
  return hook
