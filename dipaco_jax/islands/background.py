"""A thread whose `join` hands back its function's result or error, and
one that a loop starts without waiting for it."""

import threading


class Background(threading.Thread):
  """`fn(*args)` in the background; `join` re-raises its error and returns
  its result, so a failed upload or read fails the task that waits on it."""

  def __init__(self, fn, *args):
    super().__init__(daemon=True)
    self._fn, self._args, self.error, self.result = fn, args, None, None

  def run(self):
    try:
      self.result = self._fn(*self._args)
    except BaseException as e:  # pylint: disable=broad-exception-caught
      self.error = e

  def join(self, timeout=None):
    super().join(timeout)
    if self.error is not None:
      raise self.error
    return self.result


class OneAtATime:
  """`fn(*args)` in a thread unless its previous run is still going: work a
  polling loop should not wait for (the coordinator's deletions), started
  again by a later pass with newer arguments. A failed run fails the next
  `start` or `join`."""

  def __init__(self, fn):
    self._fn, self._thread = fn, None

  @property
  def running(self) -> bool:
    return self._thread is not None and self._thread.is_alive()

  def start(self, *args) -> None:
    if self.running:
      return
    self.join()
    self._thread = Background(self._fn, *args)
    self._thread.start()

  def join(self) -> None:
    thread, self._thread = self._thread, None
    if thread is not None:
      thread.join()
