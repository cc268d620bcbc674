"""The sync seam: how the training loop gets its outer steps.

Every H inner steps the loop ends round r (0-based: round r ends at inner
step (r + 1) H) and asks its synchronizer for the outer step:

  state = sync.start(r, state)    hand over round r's contribution
  state = sync.finish(r, state)   apply what came back for round r

`finish(r)` is called `delay` rounds after `start(r)`: right away for
`delay = 0`, at the end of round r + 1 for DiLoCoX's one-round-late update.
A synchronizer whose `lag_steps` is tau > 0 (`delay=overlap`, Streaming
DiLoCo) is called by inner steps instead: `finish(r)` after inner step
(r + 1) H + tau, before a `start` at that same step (tau = H), and the
loop's dispatches end there too (`acts_after`). Rounds still open when
training ends are finished in order by the loop (`finish_remaining`).
Implementations:

  InProcessSync   every worker in this SPMD program: the jitted chain of
                  `diloco.outer` (or, with DiLoCoX's delay or compression,
                  of `diloco.comm_step`) runs in-process.
  islands         through a store between islands (`dipaco_jax.islands`).

With a delayed slot (`config.diloco.delay`), the in-process synchronizer is
an exact simulation of the one-round-late rule: `start(r)` runs the step
that hands round r over and applies round r - 1 (both live in the state,
so a checkpoint between them loses nothing), `finish(r - 1)` has nothing
left to do, and the last round's `finish` applies the round still in
flight (`Runtime.flush_step`). With `delay=overlap` (`lag_steps` = tau),
`start(r)` is `Runtime.handover_step`, `finish(r)` is `apply_step`, and
the last round's (due past the end) is `flush_step`; islands run the
same rule with the store in between (`islands/delayed.py`).

The worker weights of the outer step are the synchronizer's, not the
runtime's: `set_weights` changes them between rounds (0 for a worker whose
contribution is missing) without recompiling the step.
"""

from typing import Protocol

import jax
import numpy as np

from dipaco_jax.diloco import comm as comm_lib
from dipaco_jax.diloco import outer as outer_lib


class Synchronizer(Protocol):
  """What the training loop needs from an outer-step implementation."""

  delay: int  # Rounds between `start(r)` and `finish(r)`.
  # Optional: inner steps between `start(r)` and `finish(r)` when > 0
  # (then `delay` is 1, the rounds open when training ends).
  lag_steps: int

  def start(self, round_index: int, state: dict) -> dict:
    """Hands over round `round_index`'s contribution; returns the state
    (unchanged, or with e.g. error-feedback buffers updated)."""

  def finish(self, round_index: int, state: dict) -> dict:
    """Applies round `round_index`'s outer step to `state`."""


class InProcessSync:
  """The outer step of an SPMD program: all workers' contributions are in
  `state`, so `start` has nothing to send and `finish` runs the whole jitted
  chain (contributions, mixing, outer optimizer, restart) at once."""

  def __init__(self, runtime):
    self.runtime = runtime
    self.delay = comm_lib.max_delay(runtime.comms)
    self.lag_steps = runtime.overlap_steps
    self.set_weights(runtime.outer_weights_W)
    self._started = set()
    self._last_started = -1

  def set_weights(self, weights_W) -> None:
    """The workers' weights for the next outer steps (0 = left out)."""
    weights_W = outer_lib.check_weights(weights_W)
    if weights_W.shape != (self.runtime.topology.num_workers,):
      raise ValueError(f"{weights_W.shape[0]} weights for "
                       f"{self.runtime.topology.num_workers} workers")
    # A device array of a fixed shape and dtype: new values, same program.
    # (From a callback: in a multi-host run each process fills only its own
    # devices.)
    host_W = weights_W.astype(np.float32)
    self._weights_W = jax.make_array_from_callback(
        host_W.shape, jax.sharding.NamedSharding(
            self.runtime.mesh, jax.sharding.PartitionSpec()),
        lambda index: host_W[index])
    self.weights_W = weights_W

  def start(self, round_index: int, state: dict) -> dict:
    self._started.add(round_index)
    self._last_started = max(self._last_started, round_index)
    if self.lag_steps:  # Hands round r over; applies nothing.
      return self.runtime.handover_step(state, self._weights_W)
    if self.delay:  # Hands round r over; applies round r - 1.
      return self.runtime.outer_step(state, self._weights_W)
    return state

  def finish(self, round_index: int, state: dict) -> dict:
    if not self.delay:
      if round_index not in self._started:
        raise RuntimeError(f"finish({round_index}) before start")
      self._started.discard(round_index)
      return self.runtime.outer_step(state, self._weights_W)
    # A resumed run finishes a round started before its checkpoint: the
    # state holds it.
    self._started.discard(round_index)
    if self.lag_steps:
      c = self.runtime.config
      # The last round's apply would come after the end: flushed instead.
      if (round_index + 1) * c.diloco.inner_steps < c.train.num_steps:
        return self.runtime.apply_step(state)
      return self.runtime.flush_step(state)
    if round_index < self._last_started:
      return state  # Applied by start(round_index + 1).
    return self.runtime.flush_step(state)


def finish_remaining(sync: Synchronizer, last_round: int, state: dict
                     ) -> dict:
  """Finishes the rounds a delayed synchronizer still holds at the end of
  training (the last `delay` rounds, up to `last_round`), in order."""
  for r in range(max(last_round - sync.delay + 1, 0), last_round + 1):
    state = sync.finish(r, state)
  return state


def lag_steps(sync) -> int:
  """The synchronizer's `lag_steps`, 0 for one without it."""
  return getattr(sync, "lag_steps", 0)


def finish_due(sync, done: int, sync_every: int) -> int | None:
  """The round a `lag_steps` synchronizer finishes after step `done`."""
  lag = lag_steps(sync)
  if lag and sync_every and done > lag and (done - lag) % sync_every == 0:
    return (done - lag) // sync_every - 1
  return None
