"""Several inner steps per host round trip (`config.train.steps_per_dispatch`).

A small model's inner step takes a few milliseconds on a GPU, and the host's
work per step (the batch onto the devices, the dispatch, reading the
metrics) can take longer: then the devices wait. On 4 H100s DiPaCo 2x2's
step needs 4.26 ms of device time and the loop took 9.65 ms a step
(docs/performance.md, scaling over GPUs). With K steps per dispatch
one jitted call runs K inner steps (`Runtime.inner_k_steps`, a scan over
[K, W, B, L+1] batches), so the host's fixed work is paid once per K steps.

The loop still acts between steps where it must: after an outer step
(every H steps), a checkpoint and the last step. `plan` cuts the steps into
dispatches of K that never step over such a point, and single steps where
a dispatch of K would; only these two sizes are ever compiled.
"""

from typing import Callable

import numpy as np


def plan(start: int, stop: int, k: int,
         acts_after: Callable[[int], bool]) -> list[tuple[int, int]]:
  """(first step, number of steps) of each dispatch covering [start, stop).

  Args:
    start: the first step to run (0, or where a resumed run restarts).
    stop: one past the last step.
    k: steps per dispatch (1: every step on its own, as before).
    acts_after: whether the loop must act once `done` steps are done (an
      outer step, a checkpoint); a dispatch may end there but not pass it.
  """
  if k < 1:
    raise ValueError(f"steps per dispatch must be >= 1, got {k}")
  out = []
  step = start
  while step < stop:
    n = k if step + k <= stop and not any(
        acts_after(done) for done in range(step + 1, step + k)) else 1
    out.append((step, n))
    step += n
  return out


def host_rows(batch_of_step: Callable[[int], np.ndarray], step: int,
              n: int) -> np.ndarray:
  """A dispatch's batch on the host: step `step`'s alone when n == 1, else
  the [n, ...] stack of steps step .. step + n - 1."""
  if n == 1:
    return batch_of_step(step)
  return np.stack([batch_of_step(s) for s in range(step, step + n)])
