"""A worker's liveness: `control/heartbeat/{worker_id}.json`, written by it
alone from a thread, a counter that changes while it lives (the
coordinator times the changes on its own clock) and the task it holds.
"""

import os
import socket
import threading
import time

from dipaco_jax.islands import layout
from dipaco_jax.store import atomic
from dipaco_jax.train import preemption


class Heartbeat:
  """Writes the worker's liveness file every `interval_s` from a thread."""

  def __init__(self, run, worker_id: str, interval_s: float):
    self.path = layout.control(run, "heartbeat", f"{worker_id}.json")
    self.interval_s = interval_s
    self.info = {"worker": worker_id, "pid": os.getpid(),
                 "host": socket.gethostname(), "beat": 0, "task": None,
                 "done_seq": -1}
    self._lock = threading.Lock()
    self._write_lock = threading.Lock()
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._loop, daemon=True)

  def update(self, **fields) -> None:
    with self._lock:
      self.info.update(fields)
    self.beat()

  def beat(self) -> None:
    # One write at a time (the thread's beats and the worker's updates),
    # so the file's counter never goes back.
    with self._write_lock:
      with self._lock:
        self.info["beat"] += 1
        self.info["time"] = time.time()
        info = dict(self.info)
      atomic.write_json(self.path, info, indent=None)

  def _loop(self):
    while not self._stop.wait(self.interval_s):
      self.beat()

  def __enter__(self):
    self.beat()
    self._thread.start()
    return self

  def __exit__(self, exc_type, *exc):
    self._stop.set()
    self._thread.join(timeout=5)
    if exc_type is not None and issubclass(exc_type, preemption.Preempted):
      # Its last beat says it left: the coordinator re-queues its task at
      # once instead of after the lease timeout.
      self.update(leaving=True)
