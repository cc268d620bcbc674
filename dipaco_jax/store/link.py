"""An emulated slow link between islands: bandwidth and latency per transfer.

On one machine every role reaches the store at disk speed; to see how a
run behaves when islands share a 1 Gbps or 100 Mbps link, the store's
array reads and writes (`items.save_tree` / `items.load_tree`) can be made
to take at least

  latency + bytes / bandwidth

seconds each (the transfer sleeps for what the real one did not take).
Every role of a run sets the same link from the run's spec
(`RunSpec.link_mbps`, `link_latency_ms`; `--link_mbps` of
`python -m dipaco_jax.islands`). Transfers of one process share its link,
one at a time, as on a real NIC; roles on one machine each get their own
link (islands do not share one).
"""

import contextlib
import threading
import time

_lock = threading.Lock()
_link = {"bytes_per_s": 0.0, "latency_s": 0.0}


def set_link(mbps: float, latency_ms: float) -> None:
  """Limits this process's store transfers; 0 Mbps = unlimited."""
  _link["bytes_per_s"] = mbps * 1e6 / 8
  _link["latency_s"] = latency_ms / 1e3


def transfer_s(num_bytes: int) -> float:
  """How long a transfer of `num_bytes` takes on the emulated link."""
  if not _link["bytes_per_s"]:
    return 0.0
  return _link["latency_s"] + num_bytes / _link["bytes_per_s"]


@contextlib.contextmanager
def transfer(num_bytes: int):
  """Wraps one store transfer; pads it to the link's time."""
  if not _link["bytes_per_s"]:
    yield
    return
  with _lock:
    t0 = time.monotonic()
    yield
    rest = transfer_s(num_bytes) - (time.monotonic() - t0)
    if rest > 0:
      time.sleep(rest)
