"""A worker's task with DiLoCoX's one-round-late outer step (`one_round`).

The rule is `diloco/comm_step.py`'s, cut where the store is: a worker
trains round r from its own anchor a^r (where its round started; the
modules of version 0 for round 0), hands its contribution c^r = a^r - x^r
to an upload thread, and waits only for module version r, which the
executors made from round r - 1's contributions while this round trained.
Its next round starts from

  a^{r+1} = x^r + (v_r[e(w)] - a^r)

(the global modules plus its own progress of round r), kept with its AdamW
state in `inner/{w}/s{(r+1)H}` = {"opt", "anchor"}, also uploaded in the
background. The executors are unchanged (version r + 1 from round r's
contributions), so the final version is what the SPMD runtime's flush
ends on.

Overlap: while the uploads of round r run, the worker already trains
round r + 1 of the same group (a pure function of what it holds, so the
result is the same whoever runs that task; it is used if the coordinator
gives this worker that task, as it does when it can: sticky leases). A
task is done, as always, when its outputs are committed. So a round costs
about its compute plus reading version r, while the contributions, the
outer step and the state go over the link during the next round's compute.
"""

import dataclasses
import threading
import time

import jax
import numpy as np

from dipaco_jax.diloco import outer as outer_lib
from dipaco_jax.islands import layout
from dipaco_jax.store import items

WAIT_TIMEOUT_S = 3600.0  # For a module version: every wait is bounded.
PHASES = ("compute", "wait", "next_round", "upload_tail")


@dataclasses.dataclass
class Trained:
  """A group's round, trained: where it started and where it ended."""
  round_index: int
  group: tuple
  anchor: dict  # [G, ...] host arrays
  params: dict  # [G, ...] host arrays
  opt_state: dict  # AdamW, on device
  loss_G: np.ndarray
  seconds: float


def inner_like(program) -> dict:
  """What a worker keeps between delayed rounds: AdamW and its anchor."""
  return {"opt": program.worker_opt_like, "anchor": program.module_like}


def _wait_for_version(runner, task, timeout_s: float = WAIT_TIMEOUT_S):
  """Blocks until every module the group uses has version r committed."""
  keys = [layout.module_dir(runner.run, name, int(e), task.round_index)
          for s, name in enumerate(runner.slot_names)
          for e in np.unique(runner.topology.assignment_WxS[
              list(task.group), s])]
  deadline = time.monotonic() + timeout_s
  while not all(layout.committed(k) for k in keys):
    if time.monotonic() > deadline:
      raise TimeoutError(f"waited {timeout_s:.0f} s for module version "
                         f"{task.round_index}")
    time.sleep(0.02)


def _start(runner, task, program):
  """(anchor [G, ...], AdamW state) the group's round starts from."""
  r, h = task.round_index, runner.spec.inner_steps
  if r == 0:
    bank, local_GxS = runner.load_bank(task, program)
    anchor = outer_lib.gather_workers(bank, local_GxS, runner.slot_names)
    return anchor, jax.device_get(
        jax.vmap(program.runtime.inner_tx.init)(anchor))
  kept = runner.kept
  if kept is not None and kept[:2] == (task.group, r * h):
    return kept[2], kept[3]
  rows = []
  for w in task.group:
    key = layout.inner_dir(runner.run, w, r * h)
    tree, _ = items.load_tree(key, inner_like(program))
    runner.meter.add("read", r, key)
    rows.append(tree)
  stacked = jax.tree.map(lambda *x: np.stack(x), *rows)
  return stacked["anchor"], stacked["opt"]


def train(runner, task, program) -> Trained:
  """H inner steps of the group from its anchor (nothing written)."""
  t0 = time.monotonic()
  r, h = task.round_index, runner.spec.inner_steps
  runtime = program.runtime
  anchor, opt_state = _start(runner, task, program)
  anchor = jax.device_get(anchor)  # The inner step donates its state.
  state = {
      "step": np.int32(r * h),
      "inner": {"params": anchor, "opt_state": opt_state},
      # The inner step passes the bank through untouched: any [G, ...]
      # tree of the bank's shapes will do.
      "outer": {"params": jax.tree.map(np.copy, anchor),
                "opt_state": outer_lib.init_outer_opt_state(
                    runtime.outer_tx, anchor)},
  }
  state = jax.device_put(state, runtime.state_shardings)
  state, losses_HxG = runner.inner_steps(task, runtime, state)
  return Trained(r, task.group, anchor,
                 jax.device_get(state["inner"]["params"]),
                 state["inner"]["opt_state"], losses_HxG.mean(axis=0),
                 time.monotonic() - t0)


class _Upload(threading.Thread):
  """A store write in the background; `join` re-raises its error."""

  def __init__(self, fn, *args):
    super().__init__(daemon=True)
    self._fn, self._args, self.error = fn, args, None

  def run(self):
    try:
      self._fn(*self._args)
    except BaseException as e:  # pylint: disable=broad-exception-caught
      self.error = e

  def join(self, timeout=None):
    super().join(timeout)
    if self.error is not None:
      raise self.error


def _write_inner(runner, task, host) -> None:
  r, h = task.round_index, runner.spec.inner_steps
  for i, w in enumerate(task.group):
    key = layout.inner_dir(runner.run, w, (r + 1) * h)
    items.save_tree(key, items.worker_of(host, i), {"round": r, "worker": w})
    runner.meter.add("written", r, key)


def run_task(runner, task, program) -> tuple[dict, dict]:
  """Runs one delayed task; returns ({worker: mean loss}, phase seconds)."""
  r, h = task.round_index, runner.spec.inner_steps
  t0 = time.monotonic()
  done = runner.speculated
  runner.speculated = None
  if done is None or (done.round_index, done.group) != (r, task.group):
    done = train(runner, task, program)
  t_compute = time.monotonic()
  contribs = jax.tree.map(
      lambda a, p: a.astype(np.float32) - p.astype(np.float32),
      done.anchor, done.params)
  uploads = [_Upload(runner.write_contributions, task, contribs,
                     done.loss_G)]
  uploads[0].start()
  _wait_for_version(runner, task)
  bank, local_GxS = runner.load_bank(task, program)
  start = outer_lib.gather_workers(bank, local_GxS, runner.slot_names)
  next_anchor = jax.tree.map(lambda p, g, a: (p + (g - a)).astype(p.dtype),
                             done.params, start, done.anchor)
  host = {"opt": jax.device_get(done.opt_state), "anchor": next_anchor}
  uploads.append(_Upload(_write_inner, runner, task, host))
  uploads[1].start()
  runner.kept = (task.group, (r + 1) * h, next_anchor, host["opt"])
  t_wait = time.monotonic()
  if r + 1 < runner.spec.num_rounds:
    runner.speculated = train(runner, type(task)(r + 1, task.group), program)
  t_next = time.monotonic()
  for upload in uploads:
    upload.join()
  runner.meter.flush()
  phases = {"compute": t_compute - t0, "wait": t_wait - t_compute,
            "next_round": t_next - t_wait,
            "upload_tail": time.monotonic() - t_next}
  return {w: float(l) for w, l in zip(task.group, done.loss_G)}, phases
