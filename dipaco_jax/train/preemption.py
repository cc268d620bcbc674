"""A preemption notice (SIGTERM, or SIGINT from a terminal) as a saved
checkpoint and a distinct exit status, not a lost stretch of training.

TPU and cloud VMs get SIGTERM some seconds before they are taken (about
30 s on Cloud TPU spot/preemptible VMs; Kubernetes' default grace is 30 s).
While the training loop runs, the signal only sets a flag: the loop
finishes the dispatch in flight, saves a checkpoint at its end
(`train/loop.py`) and raises `Preempted`; the command line prints one line
and exits with `EXIT_PREEMPTED`, and rerunning the same command resumes
exactly (a checkpoint at any step resumes bit for bit, DESIGN invariant 3).
Outside the loop (data stage, routing, evaluation: stages that are cached
whole or not at all) there is nothing to save, so the signal raises
`Preempted` at once.

If the save has not finished `grace_s` seconds after the signal, the
process exits with the same status anyway: the platform would kill it
soon, and the previous checkpoint stays whole (orbax commits a step only
once it is complete). A second signal exits at once.
"""

import contextlib
import os
import signal
import sys
import threading

# EX_TEMPFAIL (sysexits.h): "try again later", which is what a scheduler
# should do with a preempted job; distinct from an error (1, 2).
EXIT_PREEMPTED = 75

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(BaseException):
  """Stopped by a preemption signal; `step` is the step saved, or None
  when nothing needed saving. A BaseException, as KeyboardInterrupt: raised
  from the signal handler anywhere, no `except Exception` may swallow it."""

  def __init__(self, signal_name: str, step: int | None):
    self.signal_name, self.step = signal_name, step
    saved = (f"checkpoint saved at step {step}" if step is not None else
             "nothing to save (every finished stage is cached)")
    super().__init__(f"preempted by {signal_name}: {saved}; run the same "
                     "command again to resume")


class _Watch:
  """What the handler and the training loop share."""

  def __init__(self):
    self.signal_name = None
    self.in_loop = 0  # Training loops running (they save on the signal).
    self.grace_s = 30.0
    self.timer = None
    self.finished = False  # The job's work is committed (`finished`).


_watch = _Watch()


def _handler(signum, frame):
  del frame
  if _watch.finished:  # Nothing left to stop: end quietly, at once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # pylint: disable=protected-access
  name = signal.Signals(signum).name
  if _watch.signal_name is not None:  # Second signal: stop now.
    _exit_now(f"{name} again: exiting without waiting for the save")
  _watch.signal_name = name
  if not _watch.in_loop:
    raise Preempted(name, None)
  print(f"[preemption] {name}: saving a checkpoint at the end of the "
        f"current step (at most {_watch.grace_s:.0f} s)", file=sys.stderr,
        flush=True)
  _watch.timer = threading.Timer(_watch.grace_s, _exit_now, args=(
      f"the checkpoint was not saved within {_watch.grace_s:.0f} s of "
      f"{name}; exiting (the previous checkpoint stays)",))
  _watch.timer.daemon = True
  _watch.timer.start()


def _exit_now(line: str) -> None:
  print(f"error: {line}", file=sys.stderr, flush=True)
  os._exit(EXIT_PREEMPTED)  # pylint: disable=protected-access


@contextlib.contextmanager
def handle_signals():
  """Installs the handlers for the whole job (main thread only; elsewhere,
  e.g. a job started from a thread, signals keep their defaults)."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  _watch.finished = False
  previous = {s: signal.signal(s, _handler) for s in SIGNALS}
  try:
    yield
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
    reset()


@contextlib.contextmanager
def saving_on_signal(grace_s: float):
  """Marks a training loop: a signal inside only sets the flag
  (`requested`), and the loop saves within `grace_s` seconds."""
  _watch.in_loop += 1
  _watch.grace_s = float(grace_s)
  try:
    yield
  finally:
    _watch.in_loop -= 1


def finished() -> None:
  """The job's work is done and committed (an islands role that saw the
  run end): a signal from now on ends the process at once with status 0.
  Raised instead, it would land wherever the interpreter is as the role
  winds down, e.g. in a garbage collector's callback, whose exception
  Python only prints ("Exception ignored in ...", a traceback in the
  role's log), and the launcher stops every role as soon as the run is
  done."""
  _watch.finished = True


def reset() -> None:
  """Forgets a signal that was handled (a job that trains on after it:
  tests; the command line exits instead) and a `finished` job."""
  if _watch.timer is not None:
    _watch.timer.cancel()
  _watch.signal_name, _watch.timer = None, None
  _watch.finished = False


def requested() -> str | None:
  """The signal's name once one arrived, else None."""
  return _watch.signal_name


def saved(step: int) -> Preempted:
  """The exception the loop raises once it saved `step`."""
  if _watch.timer is not None:
    _watch.timer.cancel()
  return Preempted(_watch.signal_name, step)
