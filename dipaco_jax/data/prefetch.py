"""Builds the next batches on a background thread while the device computes.

Batches are a pure function of the step (`batches.batch_for_step`), so the
prefetcher only moves that work off the critical path; it holds no state a
checkpoint would need. numpy indexing releases the GIL for large copies, so
a thread is enough.
"""

import queue
import threading
from typing import Any, Callable, Iterator

_POLL_S = 0.05  # How often a blocked thread checks whether to stop.


class _Failure:
  """Carries a producer exception to the consumer."""

  def __init__(self, step: int, error: BaseException):
    self.step = step
    self.error = error


_DONE = object()


class Prefetcher:
  """Yields `(step, produce(step))` for step in [start, stop), in order.

  At most `depth` results wait in the queue. An exception raised by
  `produce(step)` is re-raised by the iteration (with a note naming the
  step). `close()` (or leaving the `with` block) stops the thread.
  """

  def __init__(self, produce: Callable[[int], Any], start: int, stop: int,
               depth: int = 2):
    if depth < 1:
      raise ValueError(f'depth must be >= 1, got {depth}.')
    self._produce = produce
    self._start = start
    self._stop = stop
    self._queue = queue.Queue(maxsize=depth)
    self._stopping = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True,
                                    name='dipaco-prefetch')
    self._thread.start()

  def _put(self, item: Any) -> bool:
    """Puts `item` unless closed first; True when it was put."""
    while not self._stopping.is_set():
      try:
        self._queue.put(item, timeout=_POLL_S)
        return True
      except queue.Full:
        continue
    return False

  def _run(self) -> None:
    for step in range(self._start, self._stop):
      if self._stopping.is_set():
        return
      try:
        item = (step, self._produce(step))
      except BaseException as e:  # pylint: disable=broad-except
        self._put(_Failure(step, e))
        return
      if not self._put(item):
        return
    self._put(_DONE)

  def __iter__(self) -> Iterator[tuple[int, Any]]:
    while not self._stopping.is_set():
      try:
        item = self._queue.get(timeout=_POLL_S)
      except queue.Empty:
        if not self._thread.is_alive() and self._queue.empty():
          return  # The thread ended and everything it put was taken.
        continue
      if item is _DONE:
        return
      if isinstance(item, _Failure):
        item.error.add_note(
            f'Raised by the prefetch producer at step {item.step}.')
        raise item.error
      yield item

  def close(self, timeout: float = 5.0) -> None:
    """Stops the thread; results not yet taken are dropped."""
    self._stopping.set()
    # Drain so a producer blocked on a full queue sees the stop promptly.
    while True:
      try:
        self._queue.get_nowait()
      except queue.Empty:
        break
    self._thread.join(timeout)

  def __enter__(self) -> 'Prefetcher':
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()
