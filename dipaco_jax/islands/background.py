"""A thread whose `join` hands back its function's result or error."""

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
