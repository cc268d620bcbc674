"""The workdir lock: a second job is refused while the first runs; a dead
job's lock is taken over."""

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from dipaco_jax.store import lock as lock_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WAIT_S = 60  # Every wait on a child process is bounded by this.

_HOLDER = textwrap.dedent("""
    import sys, time
    from dipaco_jax.store import lock
    with lock.WorkdirLock(sys.argv[1]):
      time.sleep(float(sys.argv[2]))
""")

_CONTENDER = textwrap.dedent("""
    import sys
    from dipaco_jax.store import lock
    try:
      with lock.WorkdirLock(sys.argv[1]):
        print("got it")
    except lock.WorkdirLockedError as e:
      print(e)
      sys.exit(3)
""")


def _python(script, *args, **kwargs):
  return subprocess.Popen([sys.executable, "-c", script, *map(str, args)],
                          cwd=REPO, text=True, **kwargs)


def _holder_record(workdir) -> dict:
  try:
    return json.loads((workdir / ".lock").read_text())
  except (FileNotFoundError, ValueError):
    return {}


@pytest.fixture
def holder(tmp_path):
  """A child process holding the lock of `tmp_path`; killed at the end."""
  proc = _python(_HOLDER, tmp_path, 2 * WAIT_S, stderr=subprocess.PIPE)
  try:
    deadline = time.monotonic() + WAIT_S
    while _holder_record(tmp_path).get("pid") != proc.pid:
      if proc.poll() is not None:
        pytest.fail(f"the holder exited: {proc.stderr.read()}")
      if time.monotonic() > deadline:
        pytest.fail("the holder did not take the lock in time")
      time.sleep(0.05)
    yield proc
  finally:
    if proc.poll() is None:
      proc.kill()
    proc.wait(timeout=WAIT_S)
    proc.stderr.close()


def test_a_second_job_is_refused_then_takes_over_a_killed_one(
    tmp_path, holder, capsys):
  message = (f"workdir {tmp_path} is in use by pid {holder.pid} on "
             f"{socket.gethostname()} since ")
  # Another process...
  contender = _python(_CONTENDER, tmp_path, stdout=subprocess.PIPE)
  out, _ = contender.communicate(timeout=WAIT_S)
  assert contender.returncode == 3, out
  assert out.startswith(message) and out.rstrip().endswith(
      "; wait for it or use another --workdir")
  assert len(out.strip().splitlines()) == 1
  # ... and this one are refused while the holder runs.
  with pytest.raises(lock_lib.WorkdirLockedError, match=message):
    with lock_lib.WorkdirLock(tmp_path):
      pass

  holder.send_signal(signal.SIGKILL)  # No cleanup of any kind.
  holder.wait(timeout=WAIT_S)
  capsys.readouterr()
  with lock_lib.WorkdirLock(tmp_path):
    assert _holder_record(tmp_path)["pid"] == os.getpid()
    said = capsys.readouterr().out
    assert f"from pid {holder.pid} on {socket.gethostname()}" in said
    assert "no longer running" in said and len(said.splitlines()) == 1
  # Released: emptied, and taken again without a word.
  assert (tmp_path / ".lock").read_text() == ""
  with lock_lib.WorkdirLock(tmp_path):
    pass
  assert capsys.readouterr().out == ""


def test_the_same_process_cannot_take_it_twice(tmp_path):
  with lock_lib.WorkdirLock(tmp_path / "new"):  # Creates the workdir.
    with pytest.raises(lock_lib.WorkdirLockedError,
                       match=f"in use by pid {os.getpid()} "):
      lock_lib.WorkdirLock(tmp_path / "new").acquire()


def test_without_flock_the_recorded_holder_decides(tmp_path, monkeypatch,
                                                   capsys):
  def no_flock(fd, op):
    del fd, op
    raise OSError(errno.ENOLCK, "No locks available")
  monkeypatch.setattr(lock_lib.fcntl, "flock", no_flock)
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait(timeout=WAIT_S)
  here = socket.gethostname()
  records = {"dead": (dead.pid, here), "live": (os.getppid(), here),
             "elsewhere": (1, "another-host")}
  for name, (pid, host) in records.items():
    (tmp_path / name).mkdir()
    (tmp_path / name / ".lock").write_text(json.dumps(
        {"pid": pid, "hostname": host, "started": "then"}))
  with lock_lib.WorkdirLock(tmp_path / "dead"):
    assert f"from pid {dead.pid} on {here}" in capsys.readouterr().out
  for name in ("live", "elsewhere"):
    pid, host = records[name]
    with pytest.raises(lock_lib.WorkdirLockedError,
                       match=f"in use by pid {pid} on {host} since then"):
      lock_lib.WorkdirLock(tmp_path / name).acquire()


def test_object_store_workdirs_take_no_lock():
  with lock_lib.WorkdirLock("gs://some-bucket/workdir") as lock:
    assert lock._fd is None  # pylint: disable=protected-access


def test_the_main_job_refuses_a_busy_workdir_in_one_line(tmp_path, holder):
  run = subprocess.run(
      [sys.executable, "-m", "dipaco_jax.main",
       "--config=experiments/quickstart.py", f"--workdir={tmp_path}"],
      capture_output=True, text=True, check=False, cwd=REPO,
      timeout=4 * WAIT_S, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert run.returncode == 2, run.stderr[-3000:]
  assert run.stderr.strip() == (
      f"error: workdir {tmp_path} is in use by pid {holder.pid} on "
      f"{socket.gethostname()} since {_holder_record(tmp_path)['started']}; "
      "wait for it or use another --workdir")
  assert sorted(os.listdir(tmp_path)) == [".lock"]  # Nothing written.
