"""One job per workdir: a lock the job's writer process holds throughout.

Two jobs in one workdir write the same checkpoints, stages and metrics at
once: both crash, leave a temporary checkpoint behind and log every metrics
row twice. `pipeline.run` therefore takes `{workdir}/.lock` on process 0
(the only writer) for the whole job, and a second job stops at once with
`WorkdirLockedError`, which names the holder.

* Local workdirs (NFS included): `fcntl.flock` on the lock file. The kernel
  drops the lock when the holder's process ends, however it ends (SIGKILL
  and preemption included), so a dead job's lock is taken over without
  anyone deleting a file. The file holds JSON {pid, hostname, started} of
  the holder, for the refusal message; it is emptied on release, never
  deleted (a job that opened the old file and one that created a new one
  could otherwise both hold "the" lock).
* A filesystem without flock (some FUSE mounts): the JSON alone decides. A
  file naming a live process, or one on another host (which cannot be
  checked from here), refuses; one naming a dead process of this host is
  taken over. Two jobs starting in the same instant can both get it there.
* `gs://` workdirs take no lock. An object store has no lock that the
  holder's death releases, so a lock object needs a heartbeat and a timeout
  to tell a dead job from a slow one, and conditional writes that etils
  does not expose; jobs on gs:// come from launch scripts, one per workdir.
"""

import datetime
import errno
import fcntl
import json
import os
import socket

from etils import epath

from dipaco_jax import errors

LOCK_NAME = ".lock"


class WorkdirLockedError(errors.UserError):
  """Another job is running in this workdir."""


def _holder() -> dict:
  return {"pid": os.getpid(), "hostname": socket.gethostname(),
          "started": datetime.datetime.now().astimezone().isoformat(
              timespec="seconds")}


def _read(fd: int) -> dict:
  """The holder recorded in the open lock file; {} when empty or partly
  written (a holder between taking the lock and writing its name)."""
  os.lseek(fd, 0, os.SEEK_SET)
  text = b""
  while chunk := os.read(fd, 4096):
    text += chunk
  try:
    holder = json.loads(text)
  except ValueError:
    return {}
  return holder if isinstance(holder, dict) else {}


def _write(fd: int, holder: dict) -> None:
  data = json.dumps(holder).encode()
  os.ftruncate(fd, 0)
  os.pwrite(fd, data, 0)
  os.fsync(fd)


def _alive(pid) -> bool:
  try:
    os.kill(int(pid), 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # Someone else's live process.
    return True
  except (TypeError, ValueError):
    return False
  return True


def _refusal(workdir, holder: dict) -> WorkdirLockedError:
  return WorkdirLockedError(
      f"workdir {workdir} is in use by pid {holder.get('pid', '?')} on "
      f"{holder.get('hostname', '?')} since {holder.get('started', '?')}; "
      "wait for it or use another --workdir")


class WorkdirLock:
  """`with WorkdirLock(workdir):` holds `{workdir}/.lock` (module doc), or
  raises `WorkdirLockedError` at once: it never waits."""

  def __init__(self, workdir):
    self.workdir = epath.Path(workdir)
    self.path = self.workdir / LOCK_NAME
    self._fd = None

  def __enter__(self):
    self.acquire()
    return self

  def __exit__(self, *exc_info):
    self.release()

  def acquire(self) -> None:
    if str(self.workdir).startswith(("gs://", "s3://")):
      return  # No lock on an object store (module doc).
    self.workdir.mkdir(parents=True, exist_ok=True)
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      self._lock(fd)
      previous = _read(fd)
      if previous:  # Its holder ended without releasing it.
        print(f"[lock] taking over {self.path} from pid "
              f"{previous.get('pid', '?')} on {previous.get('hostname', '?')}"
              f" (since {previous.get('started', '?')}), which is no longer "
              "running", flush=True)
      _write(fd, _holder())
    except BaseException:
      os.close(fd)  # Drops the flock, if taken.
      raise
    self._fd = fd

  def _lock(self, fd: int) -> None:
    """Takes the flock, or raises the refusal."""
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      return
    except BlockingIOError:
      raise _refusal(self.workdir, _read(fd)) from None
    except OSError as e:
      if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS,
                         errno.EINVAL):
        raise
    # No flock here: the recorded holder decides.
    holder = _read(fd)
    if holder and (holder.get("hostname") != socket.gethostname()
                   or _alive(holder.get("pid"))):
      raise _refusal(self.workdir, holder)

  def release(self) -> None:
    if self._fd is None:
      return
    try:
      os.ftruncate(self._fd, 0)  # Free: nobody to name.
    finally:
      os.close(self._fd)  # Drops the flock.
      self._fd = None
