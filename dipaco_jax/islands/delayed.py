"""A worker's task with a delayed outer step: `one_round`, `overlap` and
`eager` (whose next start is `islands/eager.py`'s, from round r - 1's
payloads instead of a version).

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

`overlap` (Streaming DiLoCo's, `diloco.overlap_steps` = tau; the rule of
`diloco/overlap_step.py`): round r (r >= 1) starts from the worker's own
parameters x^{r-1} where round r - 1 ended; after tau steps it reads
version r (made from round r - 1's contributions) and moves by it,

  x <- x + (v_r[e(w)] - x^{r-1}),

then trains the round's other H - tau steps, and sends c^r = v_r - x^r
(the version is the round's anchor). Round 0 starts from version 0, as
with one_round. What a worker keeps between rounds (`inner_like`'s
"anchor") is then where its next round starts, x^r. The first tau steps
of round r + 1 need no version: they are what a worker trains while round
r's uploads run (below); the version is read, and waited for, only when
the coordinator hands it that task, so a worker never blocks inside a
round it may not be given.

Overlap: while the uploads of round r run, the worker already trains
round r + 1 of the same group (a pure function of what it holds, so the
result is the same whoever runs that task; it is used if the coordinator
gives this worker that task, as it does when it can: sticky leases), and a
thread reads version r + 1 as soon as the executors commit it. A task is
done, as always, when its outputs are committed. So a round costs about
its compute, while the contributions, the outer step, the state and the
next version go over the link during the next round's compute. Between
rounds the group's parameters, anchor and AdamW state stay on the worker's
devices; the upload threads copy what they send to the host themselves.
"""

import dataclasses
import functools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from dipaco_jax.diloco import comm as comm_lib
from dipaco_jax.islands import background
from dipaco_jax.islands import layout
from dipaco_jax.islands import replay
from dipaco_jax.islands import units as units_lib
from dipaco_jax.store import items

WAIT_TIMEOUT_S = 3600.0  # For a module version: every wait is bounded.
PHASES = ("compute", "wait", "next_round", "upload_tail")


@dataclasses.dataclass
class Trained:
  """A group's round, trained: where it started and where it ended."""
  round_index: int
  group: tuple
  anchor: dict  # [G, ...] on device
  params: dict  # [G, ...] on device
  opt_state: dict  # AdamW, on device
  carry: dict  # What the codecs carry into this round (islands/wire.py).
  outer: dict  # The inner step's pass-through bank, reused next round.
  losses_HxG: np.ndarray  # [steps run, G]
  seconds: float
  # `overlap`: the first tau steps only, before version r is applied
  # (`anchor` is then where the round started); `finish` trains the rest.
  partial: bool = False
  wait_version_s: float = 0.0  # `overlap`: waiting for version r mid-round.


def overlap_steps(runner, round_index: int) -> int:
  """tau for a round under `overlap` (none at round 0: it starts from
  version 0 itself), else 0."""
  return comm_lib.overlap_steps(runner.config) if round_index else 0


def inner_like(runner, program) -> dict:
  """What a worker keeps between delayed rounds: AdamW, its anchor, and
  what its codecs carry (if anything)."""
  like = {"opt": program.worker_opt_like, "anchor": program.module_like}
  carry = runner.wire.carry_like(program.module_like)
  if runner.eager is not None:  # Its outer state (islands/eager.py).
    carry[runner.eager.KEY] = runner.eager.like(program.module_like)
  if carry:
    like["wire"] = carry
  return like


def _version_keys(runner, task) -> list:
  return [layout.module_dir(runner.run, key, int(e), task.round_index)
          for s, slot in enumerate(runner.topology.slots)
          for e in np.unique(runner.topology.assignment_WxS[
              list(task.group), s])
          for key in units_lib.keys_of_slot(slot, runner.stages)]


def _read_version(runner, task, program, cancel=None,
                  timeout_s: float = WAIT_TIMEOUT_S):
  """Waits until every module the group uses has version r committed, then
  reads them and places each worker's copy on the devices: [G, ...], or
  None if `cancel` was set."""
  if not layout.wait_committed(_version_keys(runner, task),
                               f"module version {task.round_index}",
                               timeout_s, cancel):
    return None
  bank, local_GxS = runner.load_bank(task, program)
  return jax.device_put(
      program.gather_workers(bank, local_GxS),
      program.runtime.state_shardings["inner"]["params"])


class _Prefetch:
  """Version r of a group's modules, read by a thread once committed."""

  def __init__(self, runner, task, program):
    self.key = (task.round_index, task.group)
    self.cancel = threading.Event()
    self.thread = background.Background(_read_version, runner, task,
                                        program, self.cancel)
    self.thread.start()


def _version(runner, task, program, anchor):
  """Version r as the group's [G, ...] start: prefetched, or read now; at
  round 0 `anchor` itself (round 0 starts from version 0: the same bits,
  not read twice)."""
  prefetch, runner.prefetch = runner.prefetch, None
  if prefetch is not None:
    if prefetch.key == (task.round_index, task.group):
      return prefetch.thread.join()
    prefetch.cancel.set()  # Another group's: its reads are not needed.
  if task.round_index == 0:
    return anchor
  return _read_version(runner, task, program)


def _fresh(runner, task, program):
  """Round 0's start: version 0 of the group's modules, a fresh AdamW
  state and codec carry."""
  bank, local_GxS = runner.load_bank(task, program)
  anchor = program.gather_workers(bank, local_GxS)
  carry = runner.wire.init_carry(anchor)
  if runner.eager is not None:
    carry[runner.eager.KEY] = runner.eager.init(anchor)
  return anchor, program.init_inner_opt(anchor), carry


def _committed(runner, task, program):
  """The group's start state of `task`'s round as its workers committed
  it (`inner/{w}/s{rH}`)."""
  rows = []
  for w in task.group:
    key = layout.inner_dir(runner.run, w, task.round_index *
                           runner.spec.inner_steps)
    tree, _ = items.load_tree(key, inner_like(runner, program))
    runner.meter.add("read", task.round_index, key)
    rows.append(tree)
  stacked = jax.tree.map(lambda *x: np.stack(x), *rows)
  return stacked["anchor"], stacked["opt"], stacked.get("wire", {})


def _start(runner, task, program):
  """(anchor [G, ...], AdamW state, codec carry) the group's round starts
  from: on device when this worker trained the round before, else from the
  store, or with `inner_state_every` = K > 1 replayed from the last
  commit."""
  r, h = task.round_index, runner.spec.inner_steps
  if r == 0:
    return _fresh(runner, task, program)
  kept = runner.kept
  if kept is not None and kept[:2] == (task.group, r * h):
    return kept[2], kept[3], kept[4]
  if replay.needs_replay(runner, task, kept):
    return _replay(runner, task, program)
  return _committed(runner, task, program)


def _replay(runner, task, program):
  """`replay.py`'s rule, delayed: from the last committed start (round c;
  at 0 the fresh init) each round j < r trains again from its anchor, is
  re-encoded (the codec carry advances) and makes the next anchor from
  version j (eager: round j - 1's payloads): the same bits, none written."""
  t0 = time.monotonic()
  r = task.round_index
  c = replay.start_round(runner, task)
  past = dataclasses.replace(task, round_index=c)
  start = (_fresh(runner, past, program) if c == 0
           else _committed(runner, past, program))
  overlap = runner.config.diloco.delay == "overlap"
  for j in range(c, r):
    past = dataclasses.replace(task, round_index=j)
    # Read here, not through `_version`: that would cancel the prefetch of
    # the task being run.
    read = functools.partial(_read_version, runner, past, program)
    done = train(runner, past, program, start=start, partial=overlap)
    if done.partial:
      done = finish(runner, past, program, done, read_version=read)
    payloads, carry = runner.wire.encode_units(
        _contributions(done.anchor, done.params), done.carry,
        runner.num_units)
    if runner.eager is not None:  # The view, from round j - 1's payloads.
      next_start, carry[runner.eager.KEY], _ = runner.eager.next_view(
          runner, past, done.anchor, done.carry[runner.eager.KEY], payloads,
          prefetched=False)
    else:
      next_start = (done.params if overlap else
                    _next_anchor(done.params, read(), done.anchor))
    start = (next_start, done.opt_state, carry)
  runner.replayed_rounds += r - c
  runner.log(f"round {r} workers {list(task.group)}: start state replayed "
             f"from round {c}: {r - c} round(s) run again, nothing written, "
             f"{time.monotonic() - t0:.1f} s")
  return start


@jax.jit
def _copy(tree):
  """A fresh device copy (the inner step donates the buffers it gets)."""
  return jax.tree.map(jnp.copy, tree)


@jax.jit
def _contributions(anchor, params):
  """Eq. (1) per worker, in float32: where the round started minus where
  it ended."""
  return jax.tree.map(
      lambda a, p: a.astype(jnp.float32) - p.astype(jnp.float32),
      anchor, params)


@jax.jit
def _next_anchor(params, start, anchor):
  """x^r + (v_r - a^r): the global modules plus this round's progress."""
  return jax.tree.map(lambda p, g, a: (p + (g - a)).astype(p.dtype),
                      params, start, anchor)


def train(runner, task, program, outer=None, after_first_dispatch=None,
          start=None, partial=False) -> Trained:
  """H inner steps of the group from its anchor (nothing written). `outer`
  is a pass-through bank of the right shapes (None: made here);
  `after_first_dispatch()` runs once the device has steps queued; `start`
  is (anchor, AdamW state, codec carry), None: `_start`'s. Under
  `overlap`, version r is applied after tau steps (`finish`); with
  `partial` only those tau steps run."""
  t0 = time.monotonic()
  r, h = task.round_index, runner.spec.inner_steps
  runtime = program.runtime
  if start is None:
    start = _start(runner, task, program)
  anchor, opt_state, carry = start
  anchor = jax.device_put(anchor, runtime.state_shardings["inner"]["params"])
  if outer is None:
    # The inner step passes the bank through untouched: any [G, ...] tree
    # of the bank's shapes will do.
    outer = {"params": anchor, "opt_state": program.init_outer_opt(anchor)}
  state = {
      "step": np.int32(r * h),
      "inner": {"params": _copy(anchor), "opt_state": opt_state},
      "outer": _copy(outer),
  }
  state = jax.device_put(state, runtime.state_shardings)
  tau = overlap_steps(runner, r)
  state, losses_HxG = runner.inner_steps(task, runtime, state,
                                         after_first_dispatch,
                                         steps=tau or h)
  done = Trained(r, task.group, anchor, state["inner"]["params"],
                 state["inner"]["opt_state"], carry, state["outer"],
                 losses_HxG, time.monotonic() - t0, partial=bool(tau))
  if tau and not partial:
    return finish(runner, task, program, done)
  return done


def finish(runner, task, program, head: Trained,
           read_version=None) -> Trained:
  """`overlap`: the round after its first tau steps (`head`). Applies
  version r, x <- x + (v_r - x^{r-1}), then trains the other H - tau
  steps; the version is the round's anchor. `read_version()` gives it
  ([G, ...]; default: prefetched or read now, `_version`)."""
  t0 = time.monotonic()
  r, h = task.round_index, runner.spec.inner_steps
  tau = overlap_steps(runner, r)
  version = (_version(runner, task, program, None) if read_version is None
             else read_version())
  waited = time.monotonic() - t0
  runtime = program.runtime
  state = jax.device_put({
      "step": np.int32(r * h + tau),
      "inner": {"params": _next_anchor(head.params, version, head.anchor),
                "opt_state": head.opt_state},
      "outer": head.outer}, runtime.state_shardings)
  state, losses_HxG = runner.inner_steps(task, runtime, state,
                                         first=r * h + tau, steps=h - tau)
  losses_HxG = np.concatenate([head.losses_HxG, losses_HxG])
  return Trained(r, task.group, version, state["inner"]["params"],
                 state["inner"]["opt_state"], head.carry, state["outer"],
                 losses_HxG, head.seconds + time.monotonic() - t0,
                 wait_version_s=waited)


def _write_inner(runner, task, state) -> None:
  r, h = task.round_index, runner.spec.inner_steps
  host = jax.device_get(state)
  for i, w in enumerate(task.group):
    key = layout.inner_dir(runner.run, w, (r + 1) * h)
    items.save_tree(key, items.worker_of(host, i), {"round": r, "worker": w})
    runner.meter.add("written", r, key)


def run_task(runner, task, program, t0: float) -> tuple[dict, dict]:
  """Runs one delayed task begun at `t0` (time.monotonic(), before its
  program was built: the first task's `compute` holds that build, so a
  task's phases add up to its time); returns ({worker: mean loss}, phase
  seconds)."""
  r, h = task.round_index, runner.spec.inner_steps
  done = runner.speculated
  runner.speculated = None
  if done is None or (done.round_index, done.group) != (r, task.group):
    done = train(runner, task, program)
  elif done.partial:  # `overlap`: tau steps trained while r - 1 uploaded.
    done = finish(runner, task, program, done)
  t_compute = time.monotonic()
  loss_G = done.losses_HxG.mean(axis=0)
  payloads, carry = runner.wire.encode_units(
      _contributions(done.anchor, done.params), done.carry,
      runner.num_units)
  sent = None  # Eager: the payloads as decoded, mixed next round.
  if runner.config.diloco.delay == "overlap":
    # Version r was applied inside the round (its wait is in `compute`).
    t_version, next_anchor = 0.0, done.params
  elif runner.eager is not None:  # No version: round r - 1's payloads.
    t_version = time.monotonic()
    next_anchor, carry[runner.eager.KEY], sent = runner.eager.next_view(
        runner, task, done.anchor, done.carry[runner.eager.KEY], payloads)
    t_version = time.monotonic() - t_version
  else:
    t_version = time.monotonic()
    start = _version(runner, task, program, done.anchor)
    t_version = time.monotonic() - t_version
    next_anchor = _next_anchor(done.params, start, done.anchor)
  uploads = [background.Background(  # Each unit copies its own rows.
      runner.write_contributions, task, payloads, loss_G)]
  # Every K rounds (`RunSpec.commits_inner`; never at the last round).
  if runner.spec.commits_inner(r):
    inner = {"opt": _copy(done.opt_state), "anchor": next_anchor}
    if carry:
      inner["wire"] = carry
    uploads.append(background.Background(_write_inner, runner, task, inner))

  def start_uploads():
    # Once the next round's first steps are queued: the uploads' host work
    # (copies, orbax's Python) then contends for the GIL with a dispatch
    # loop running ahead of the device, not with the hand-over it awaits.
    for upload in uploads:
      upload.start()
  runner.kept = (task.group, (r + 1) * h, next_anchor, done.opt_state,
                 carry, sent)
  t_wait = time.monotonic()
  if r + 1 < runner.spec.num_rounds:
    following = type(task)(r + 1, task.group)
    runner.prefetch = (_Prefetch(runner, following, program)
                       if runner.eager is None  # Eager reads no version.
                       else runner.eager.prefetch(runner, following))
    # Under `overlap` only its first tau steps, which need no version.
    runner.speculated = train(runner, following, program, done.outer,
                              after_first_dispatch=start_uploads,
                              partial=True)
  else:
    start_uploads()
  t_next = time.monotonic()
  for upload in uploads:
    upload.join()
  runner.meter.flush()
  phases = {"compute": t_compute - t0, "wait": t_wait - t_compute,
            "next_round": t_next - t_wait,
            "upload_tail": time.monotonic() - t_next,
            # Part of `wait`, not drawn: the version's read (one_round),
            # or round r - 1's payloads read and mixed (eager).
            "wait_version": t_version}
  if runner.config.diloco.delay == "overlap":
    # Part of `compute`: waiting for version r after tau steps (drawn as
    # a wait at the start of the compute bar, `timeline.plot`).
    phases["wait_in_compute"] = done.wait_version_s
  return {w: float(l) for w, l in zip(task.group, loss_G)}, phases
