"""A worker's next start under `delay=eager` on islands.

The rule is `diloco/comm_step.py`'s (Kale, Douillard, Donchev 2025), cut
where the store is. The executors are `one_round`'s: version r + 1 from
round r's contributions, the model of record and what a run ends on. A
worker never waits for a version. At the end of round r it steps the
outer optimizer on its own view v_w (where round r started, its anchor),
with its own outer optimizer state m_w:

  E_w^r = D^{r-1}[e(w)] + s[e] a[w, e] (C(c_w^r) - C(c_w^{r-1}))
  v_w, m_w <- OuterOpt(v_w, m_w; E_w^r),  round r + 1 starts from v_w

D^{r-1} is the module's mixed round r - 1, which the worker mixes itself
from that round's contributions on the store. It reads them as the
executors do (compressed payloads decoded by `islands/wire.py`, mixed by
the executors' own program), except its group's own C(c_w^{r-1}) when it
ran that round itself: those it keeps from the round's end (the last
field of `runner.kept`), the bits it wrote, so it neither waits for its
own uploads nor reads them back. So an eager worker reads its modules'
other users' payloads of the round before, where a `one_round` worker
reads the module's new version. With top-k that is SparseLoCo's
all-gather; in float32 it is up to U - 1 times a version's bytes for a
module of U users. At round 0 nothing has been mixed: E is
the worker's own share, as in the SPMD runtime before its first pending
round. Round r - 1's payloads are all committed before round r starts
(the coordinator's `task_ready`), so a thread reads and mixes them while
round r trains (`prefetch`), as `one_round` reads its version; and they
stay on the store until every group has passed round r
(`coordinator.collect_garbage`).

What a worker keeps between rounds gains m_w (per slot, the optimizer's
state of a [G, ...] group), under the codec carry's key `EagerViews.KEY`
(so it is committed with the AdamW state and a task moved to another
worker goes on exactly). With `inner_state_every` = K > 1 a replay
(`delayed._replay`) steps the view of each replayed round j from round
j - 1's payloads, read as the first run read them (`next_view`'s
`prefetched=False`); the coordinator keeps one round more of
contributions for it (`Coordinator.collect_garbage`).
"""

import threading

import jax
import jax.numpy as jnp
import numpy as np

from dipaco_jax.diloco import delay_views
from dipaco_jax.diloco import outer as outer_lib
from dipaco_jax.errors import UserError
from dipaco_jax.islands import background
from dipaco_jax.islands import executor as executor_lib
from dipaco_jax.islands import layout
from dipaco_jax.islands import unit_io
from dipaco_jax.islands import units as units_lib

WAIT_TIMEOUT_S = 3600.0  # For a round's payloads: every wait is bounded.


def check_config(config, delays) -> None:
  """What islands' `eager` does not combine with (nothing to check unless
  `delays` holds it): it reads round r - 1's payloads whole, not a version
  (so no stages, no compressed downloads)."""
  if "eager" not in delays:
    return
  if units_lib.num_stages(config) > 1:
    raise UserError("config.diloco.delay: eager on islands reads whole "
                    "modules' payloads; set config.pipeline.stages to 1, "
                    "or use one_round or overlap with stages.")
  if getattr(config.diloco, "download_compression", "none") != "none":
    raise UserError("config.diloco.download_compression: eager workers "
                    "read no module versions, only their users' payloads; "
                    "set it to none.")


class EagerViews:
  """A run's eager rule for one worker process: the outer optimizer, each
  module's mixing, and each worker's own share s[e] a[w, e] per slot."""

  KEY = "eager_outer_state"  # Its key in the codec carry: no slot's name.

  def __init__(self, spec: layout.RunSpec, config):
    self.tx = outer_lib.outer_optimizer(config.diloco)
    self.stepper = executor_lib.ModuleStepper(spec)
    self.likes = executor_lib.module_likes(spec)
    topology = spec.topology()
    self.slot_names = [s.name for s in topology.slots]
    assignment_WxS = topology.assignment_WxS
    self.assignment_WxS = assignment_WxS
    k = [s.num_experts for s in topology.slots]
    weights_W = np.asarray(spec.weights_W, np.float64)
    a_SxWxK = outer_lib.mixing_matrices(assignment_WxS, weights_W, k)
    users_SxK = outer_lib.users_per_module(assignment_WxS, weights_W, k)
    self.own_scale_SxW = [np.asarray(delay_views.own_scale_W(
        a_SxWxK[s], users_SxK[s], assignment_WxS[:, s],
        bool(config.diloco.rescale_by_sqrt_users)))
                          for s in range(len(k))]
    self._init = jax.jit(jax.vmap(self.tx.init))
    self._step = jax.jit(self._step_fn)

  def init(self, anchor_G: dict) -> dict:
    """Each worker's fresh outer optimizer state, per slot."""
    return {name: self._init(anchor_G[name]) for name in self.slot_names}

  def like(self, module_like: dict) -> dict:
    """One worker's outer optimizer state as host restore targets."""
    return jax.eval_shape(
        lambda: {name: self.tx.init(module_like[name])
                 for name in self.slot_names})

  def _step_fn(self, view_G, opt_G, sent_G, stale_G, delayed_G, scale_SxG):
    views, states = {}, {}
    for s, name in enumerate(self.slot_names):
      inner = {"prev_sent": {name: stale_G[name]},
               "eager_opt": {name: opt_G[name]}}
      # Round 0's D and stale share are zeros: nothing pending to mask.
      views[name], states[name] = delay_views.eager_views(
          self.tx, inner, name, sent_G[name], delayed_G[name], True,
          scale_SxG[s], view_G[name])
    return views, states

  def _module_round(self, runner, round_index: int, s: int, expert: int,
                    own: dict):
    """(users, D^{round}[expert] of slot s, the users' decoded
    contributions [U, ...]), read and mixed as an executor does; users
    found in `own` ({worker: its row}) taken from there, not read."""
    name = self.slot_names[s]
    users, a_Ux1, users_1 = self.stepper.mixing(s, expert)
    params_like = self.likes((s, expert, 0))[0]
    others = [w for w in users if int(w) not in own]
    read_U = unit_io.read_contributions(
        runner.run, runner.wire, runner.meter, round_index, others, name,
        name, params_like)
    contribs_U = read_U
    if len(others) < len(users):  # In the users' order: the mix's sum.
      rows, j = [], 0
      for w in users:
        if int(w) in own:
          rows.append(own[int(w)])
        else:
          rows.append(jax.tree.map(lambda x, j=j: x[j], read_U))
          j += 1
      contribs_U = jax.tree.map(lambda *x: jnp.stack(x), *rows)
    delta = self.stepper.mix(name, contribs_U, a_Ux1, users_1)
    return users, delta, contribs_U

  @staticmethod
  def _own(runner, task):
    """The group's decoded payloads of round r - 1 [G, ...] per slot, if
    this worker ran that round and kept them (`runner.kept`), else None."""
    kept = runner.kept
    step = task.round_index * runner.spec.inner_steps
    if kept is None or kept[:2] != (task.group, step):
      return None
    return kept[5]

  def _keys(self, runner, task, own) -> list:
    """Round r - 1's contribution keys of every user of the group's
    modules that is not in `own`."""
    group = list(task.group)
    return [layout.contrib_dir(runner.run, task.round_index - 1, int(w),
                               name)
            for s, name in enumerate(self.slot_names)
            for e in np.unique(self.assignment_WxS[group, s])
            for w in self.stepper.mixing(s, int(e))[0]
            if own is None or int(w) not in task.group]

  def _read_when_committed(self, runner, task, own, cancel, timeout_s):
    """`_round_before` once every key it reads is committed (None if
    `cancel` was set first)."""
    if not layout.wait_committed(
        self._keys(runner, task, own),
        f"round {task.round_index - 1}'s contributions", timeout_s, cancel):
      return None
    return self._round_before(runner, task, own)

  def prefetch(self, runner, task, timeout_s: float = WAIT_TIMEOUT_S):
    """Starts reading and mixing what `task` (round r >= 1) will need,
    round r - 1's payloads, as they are committed: while the task trains,
    off its critical path (as `one_round` prefetches its version). An
    object with `key`, `cancel` and `thread`, as `delayed._Prefetch`."""
    fetch = _Prefetch((task.round_index, task.group))
    fetch.thread = background.Background(
        self._read_when_committed, runner, task, self._own(runner, task),
        fetch.cancel, timeout_s)
    fetch.thread.start()
    return fetch

  def _round_before(self, runner, task, own):
    """(D^{r-1} of each group worker's modules, each worker's own
    C(c^{r-1})), [G, ...] per slot; r >= 1. `own`: the group's decoded
    payloads of round r - 1 (`_own`), or None to read them too."""
    r, group = task.round_index, list(task.group)
    delayed, stale = {}, {}
    for s, name in enumerate(self.slot_names):
      mine = {} if own is None else {
          int(w): jax.tree.map(lambda x, i=i: x[i], own[name])
          for i, w in enumerate(group)}
      d_rows, own_rows = [None] * len(group), [None] * len(group)
      for e in np.unique(self.assignment_WxS[group, s]):
        users, d, contribs_U = self._module_round(runner, r - 1, s, int(e),
                                                  mine)
        for i, w in enumerate(group):
          if self.assignment_WxS[w, s] == e:
            d_rows[i] = d
            u = list(users).index(w)
            own_rows[i] = jax.tree.map(lambda x, u=u: x[u], contribs_U)
      delayed[name] = jax.tree.map(lambda *x: jnp.stack(x), *d_rows)
      stale[name] = jax.tree.map(lambda *x: jnp.stack(x), *own_rows)
    return delayed, stale

  def _sent(self, runner, payloads, num: int) -> dict:
    """Each group worker's C(c_w^r), as the executors will decode it."""
    sent = {}
    for s, name in enumerate(self.slot_names):
      if name not in runner.wire.codecs:  # float32, as written
        sent[name] = payloads[name]
        continue
      like = self.likes((s, 0, 0))[0]
      rows = [runner.wire.from_wire(
          name, runner.wire.to_wire(name, payloads[name], i), like)
              for i in range(num)]
      sent[name] = jax.tree.map(lambda *x: jnp.stack(x), *rows)
    return sent

  def next_view(self, runner, task, anchor_G, opt_G, payloads,
                prefetched=True):
    """(round r + 1's start [G, ...], the workers' new outer optimizer
    states, their decoded payloads of round r [G, ...]: what the next
    round mixes for them) from round r's anchors and payloads.
    `prefetched`: take round r - 1's mix from the runner's prefetch if it
    is this task's; False (a replay) reads it now and leaves the prefetch,
    the task's being run, alone."""
    group = list(task.group)
    sent = self._sent(runner, payloads, len(group))
    fetch = None
    if prefetched:
      fetch, runner.prefetch = runner.prefetch, None
    if fetch is not None and fetch.key != (task.round_index, task.group):
      fetch.cancel.set()  # Another task's.
      fetch = None
    if task.round_index == 0:  # Nothing mixed yet.
      delayed = stale = jax.tree.map(jnp.zeros_like, sent)
    elif fetch is not None:
      delayed, stale = fetch.thread.join()
    else:
      delayed, stale = self._round_before(runner, task,
                                          self._own(runner, task))
    scale_SxG = [jnp.asarray(x[group], jnp.float32)
                 for x in self.own_scale_SxW]
    view, opt = self._step(anchor_G, opt_G, sent, stale, delayed, scale_SxG)
    return view, opt, sent


class _Prefetch:
  """A round's payloads being read and mixed by a thread (`prefetch`)."""

  def __init__(self, key):
    self.key = key
    self.cancel = threading.Event()
    self.thread = None
