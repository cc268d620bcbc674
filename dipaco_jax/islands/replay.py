"""A round's training, and the replay of rounds whose inner state was not
committed (`RunSpec.inner_state_every` = K > 1).

With K > 1 a task of round r commits its workers' inner states (AdamW
state, codec carry) only when (r + 1) % K == 0 (`RunSpec.commits_inner`;
with any K, never at the last round, which no task starts from). A worker
that runs the same group's next round keeps them in memory
(`TaskRunner._kept`); one that does not (the task moved to another worker,
or the worker restarted) rebuilds the start state of round r from the last
committed one, at round c = (r // K) * K (at c = 0 the fresh init): for j =
c .. r - 1 it loads the group's modules at version j, runs round j's H
inner steps and encodes the contributions to advance the codec carry,
writing nothing (those rounds' contributions are committed already, and a
re-run would write the same bytes). Every input is the same pure function
of the store as in the first run (modules at version j, batches of seed,
worker and step), so the replayed state is the same bits. A delayed task
(`islands/delayed.py`) replays by the same rule, its anchor part of the
state (`delayed._replay`).
"""

import dataclasses
import time

import jax
import numpy as np

from dipaco_jax.errors import UserError
from dipaco_jax.islands import layout


def train_round(runner, task, program, bank, local_GxS, inner_params,
                opt_state, carry):
  """Round `task.round_index` of `task.group` from `bank` (version r) and
  the workers' start state: (state after H inner steps, losses [H, G],
  contribution payloads (on device), codec carry)."""
  runtime = program.runtime
  state = {
      "step": np.int32(task.round_index * runner.spec.inner_steps),
      "inner": {"params": inner_params, "opt_state": opt_state},
      # Passed through the inner step untouched.
      "outer": {"params": bank,
                "opt_state": program.init_outer_opt(bank)},
  }
  state = jax.device_put(state, runtime.state_shardings)
  state, losses_HxG = runner.inner_steps(task, runtime, state)
  contribs = program.contributions(bank, state["inner"]["params"],
                                   local_GxS)
  # Compressed slots: their payloads, and what their codecs carry on.
  payloads, carry = runner.wire.encode_units(contribs, carry,
                                             runner.num_units)
  return state, losses_HxG, payloads, carry


def needs_replay(runner, task, kept) -> bool:
  """Whether round r's start state must be rebuilt: r is not a commit
  boundary (with K = 1 every round is: never) and the state is neither
  `kept` by this worker ((group, step, ...) or None) nor committed."""
  r, group = task.round_index, task.group
  if runner.spec.last_commit_round(r) == r:
    return False
  step = r * runner.spec.inner_steps
  if kept is not None and kept[:2] == (group, step):
    return False
  return not all(layout.committed(layout.inner_dir(runner.run, w, step))
                 for w in group)


def start_round(runner, task) -> int:
  """The latest round c < r whose start state every worker of the group
  committed, else 0 (the fresh init): (r // K) * K, found on the store
  itself (a store keeps its K: `launcher.check_spec`)."""
  h = runner.spec.inner_steps
  for c in range(task.round_index - 1, 0, -1):
    if all(layout.committed(layout.inner_dir(runner.run, w, c * h))
           for w in task.group):
      return c
  return 0


def replay(runner, task, program):
  """The group's (AdamW state, codec carry) at the start of `task`'s round,
  rebuilt from the last committed state; logs one line."""
  t0 = time.monotonic()
  r = task.round_index
  c = start_round(runner, task)
  opt_state = carry = None
  for j in range(c, r):
    past = dataclasses.replace(task, round_index=j)
    bank, local_GxS = runner.load_bank(past, program)
    inner_params = program.gather_workers(bank, local_GxS)
    if j == c:  # Committed at step cH (or the fresh init at c = 0).
      opt_state, carry = runner.load_inner_at(past, program, inner_params)
    state, _, _, carry = train_round(runner, past, program, bank, local_GxS,
                                     inner_params, opt_state, carry)
    opt_state = state["inner"]["opt_state"]
  runner.replayed_rounds += r - c
  runner.log(f"round {r} workers {list(task.group)}: start state replayed "
             f"from round {c}: {r - c} round(s) run again, nothing written, "
             f"{time.monotonic() - t0:.1f} s")
  return opt_state, carry


def check_options(inner_state_every) -> None:
  """`inner_state_every` (None: the default, 1) must be at least 1."""
  every = 1 if inner_state_every is None else int(inner_state_every)
  if every < 1:
    raise UserError(f"--inner_state_every ({every}) must be at least 1")
