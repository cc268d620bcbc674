"""An emulated slow link between islands: latency per store operation and
bandwidth per transfer, and a count of the operations.

On one machine every role reaches the store at disk speed; to see how a
run behaves when islands share a 1 Gbps or 100 Mbps link, or talk to a
store whose every request takes 50 ms (an object store across a region),
the store's operations can be made to take at least

  latency                          a small one: a marker, a control file,
                                   an existence check, a listing, a delete
  latency + bytes / bandwidth      an array transfer (`items.save_tree` /
                                   `items.load_tree`: one key, one object)

seconds each (the operation sleeps for what the real one did not take).
Every role of a run sets the same link from the run's spec
(`RunSpec.link_mbps`, `link_latency_ms`; `--link_mbps` and
`--link_latency_ms` of `python -m dipaco_jax.islands`). Array transfers of
one process share its link, one at a time, as on a real NIC; small
operations only wait out their latency (requests in flight at once do not
queue behind each other on an object store). Roles on one machine each get
their own link (islands do not share one).

Every operation is counted by kind, per thread (`thread_counts`), so that a
role can say how many operations a phase of its own made: the round-time
model of docs/islands.md ("A slow store") multiplies them by the latency.
"""

import collections
import contextlib
import threading
import time

_lock = threading.Lock()
_link = {"bytes_per_s": 0.0, "latency_s": 0.0}
_local = threading.local()

# The kinds of store operation (`operation(kind)`); a transfer is "put" or
# "get".
KINDS = ("exists", "list", "read", "write", "delete", "put", "get")


def set_link(mbps: float, latency_ms: float) -> None:
  """This process's link: `mbps` Mbit/s per transfer (0 = unlimited) and
  `latency_ms` per operation (0 = none)."""
  _link["bytes_per_s"] = mbps * 1e6 / 8
  _link["latency_s"] = latency_ms / 1e3


def transfer_s(num_bytes: int) -> float:
  """How long a transfer of `num_bytes` takes on the emulated link."""
  rate = _link["bytes_per_s"]
  return _link["latency_s"] + (num_bytes / rate if rate else 0.0)


def thread_counts() -> collections.Counter:
  """The store operations this thread has made, by kind (a live counter:
  copy it to take a difference later)."""
  counts = getattr(_local, "counts", None)
  if counts is None:
    counts = _local.counts = collections.Counter()
  return counts


def since(before: collections.Counter) -> dict[str, int]:
  """This thread's operations since `before` (a copy of `thread_counts`)."""
  return dict(thread_counts() - before)


def operation(kind: str) -> None:
  """Counts one small store operation and waits out the link's latency."""
  thread_counts()[kind] += 1
  if _link["latency_s"]:
    time.sleep(_link["latency_s"])


@contextlib.contextmanager
def transfer(num_bytes: int, kind: str):
  """Wraps one array transfer ("put" or "get"); pads it to the link's
  time."""
  thread_counts()[kind] += 1
  if not (_link["bytes_per_s"] or _link["latency_s"]):
    yield
    return
  with _lock:
    t0 = time.monotonic()
    yield
    rest = transfer_s(num_bytes) - (time.monotonic() - t0)
    if rest > 0:
      time.sleep(rest)
