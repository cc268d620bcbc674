"""Several processes (hosts) running one job: who writes, and when to wait.

Every process runs the same pipeline, in the same order. Training is
collective: every process runs it and feeds only the batch rows its own
devices hold (`train.state.Runtime.worker_rows`); orbax coordinates the
checkpoint writes. The cached stages that only compute on local data
(tokenizer and token documents, routing features, routers, shards) run on
process 0 first, which writes them; the other processes wait at a barrier
and then load what it wrote (`first_on_writer`). Logs, plots and results
are written by process 0 alone.

Code run by `first_on_writer` must not run computations over the global mesh
(only process 0 would join them): it works on host arrays.
"""

import json
from typing import Callable, TypeVar

import jax
from jax.experimental import multihost_utils
import numpy as np

T = TypeVar("T")


def initialize(coordinator_address: str | None = None,
               num_processes: int | None = None,
               process_id: int | None = None) -> None:
  """`jax.distributed.initialize`; on CPU (tests: several local processes
  with fake devices) cross-process collectives go through gloo."""
  if jax.config.jax_platforms == "cpu":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes,
                             process_id=process_id)


def is_writer() -> bool:
  """Whether this process writes shared files (process 0)."""
  return jax.process_index() == 0


def barrier(name: str) -> None:
  """Waits until every process reaches the barrier `name`."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def any_process(flag: bool) -> bool:
  """Whether `flag` holds on some process (a collective with several: every
  process must call it)."""
  if jax.process_count() == 1:
    return bool(flag)
  return bool(np.any(multihost_utils.process_allgather(np.int32(flag))))


def from_writer(x: np.ndarray) -> np.ndarray:
  """`x` as process 0 has it, on every process (a collective with several:
  every process must call it)."""
  if jax.process_count() == 1:
    return np.asarray(x)
  return np.asarray(multihost_utils.broadcast_one_to_all(x))


def all_gather_json(value) -> list:
  """`value` (JSON-serializable) of every process, in process order (a
  collective with several: every process must call it). Each process holds
  all of them: for small things, such as digests, never arrays."""
  if jax.process_count() == 1:
    return [value]
  data = np.frombuffer(json.dumps(value).encode("utf-8"), np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(np.int64(data.size)))
  padded = np.zeros(int(sizes.max()), np.uint8)
  padded[:data.size] = data
  rows = np.asarray(multihost_utils.process_allgather(padded))
  return [json.loads(rows[i, :size].tobytes().decode("utf-8"))
          for i, size in enumerate(sizes)]


def to_host(tree):
  """Host copies of (possibly sharded) global arrays; with several processes
  this is a collective, so every process must call it."""
  if jax.process_count() == 1:
    return jax.device_get(tree)
  return multihost_utils.process_allgather(tree, tiled=True)


def first_on_writer(compute_or_load: Callable[[], T], name: str) -> T:
  """Runs a cached stage on process 0, then on the others.

  `compute_or_load()` must load its result when it is already stored and
  otherwise compute and store it: process 0 computes and stores it, the
  others wait, then load it.
  """
  if jax.process_count() == 1:
    return compute_or_load()
  result, error = None, None
  if is_writer():
    try:
      result = compute_or_load()
    except Exception as e:  # pylint: disable=broad-exception-caught
      error = e
  # A collective all processes join, like a barrier, that also tells the
  # others whether process 0 failed: they stop with an error instead of
  # waiting for files that will never come.
  failed = int(multihost_utils.broadcast_one_to_all(
      np.int32(error is not None)))
  if error is not None:
    raise error
  if failed:
    raise RuntimeError(f"Process 0 failed in the stage {name!r} (its log has "
                       "the error); stopping this process too.")
  return result if is_writer() else compute_or_load()
