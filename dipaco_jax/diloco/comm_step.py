"""The outer step with DiLoCoX communication: compressed contributions and
outer updates applied one round late, slot by slot.

The chain of `diloco/outer.py` (contributions, compress, mix, optimize,
restart) with two additions per slot (`diloco/comm.py` says which):

**Compression** (`diloco/compress.py`). Worker w sends C(c_w + e_w) instead
of c_w; with error feedback it keeps e_w <- c_w + e_w - C(c_w + e_w) for the
next round. The module's pseudo-gradient is mixed from what was sent.

**Compressed downloads** (`diloco/download.py` has the rule): with delay
none, rounds start from the workers' copy p of the modules, which takes
each module's change compressed after the outer step.

**Delay** `one_round` (DiLoCoX's one-step-delay overlap; our reading, the
paper's equations were not available, see docs/DESIGN.md). Round r's
contributions travel while every worker trains round r + 1 from its own
parameters; the outer step of round r is applied at the end of round r + 1:

  c_w^r   = a_w^r - x_w^r                 (a: the worker's anchor, where
                                           round r started)
  D^r     = mix(C(c^r))                   (sent now, in flight)
  g^{r}   = OuterOpt(g^{r-1}, D^{r-1})    (the round that has arrived)
  x_w     <- x_w^r + (g^r[e(w)] - a_w^r)  (the new global, plus the own
                                           progress not yet in it)
  a_w^{r+1} = x_w

so a worker's parameters are always the global modules plus its own
unaveraged progress of the last round, and the outer optimizer (its
momentum) sees each round's pseudo-gradient exactly once, one round late.
Before round 0's pseudo-gradient arrives nothing is applied. When training
ends, `flush` applies the round in flight and restarts every worker from
the global modules.

**Delay** `naive` (the eager-updates paper's baseline): as `one_round`,
but a worker restarts from the delayed global, dropping its own round:
x_w <- g^r[e(w)], a_w^{r+1} = x_w. A lower bound, not a setting to use.

**Delay** `lookahead` (ours; not from a paper). As `one_round`, but a
worker does not add its own round raw: it predicts the next global
modules by applying the outer optimizer, with the global modules' own
state (their momentum), to its own contribution as its estimate of the
module's mixed pseudo-gradient (s[e] c_w, s the sqrt-users scale of
Eq. 2, 1 without it):

  x_w     <- OuterOpt(g^r[e(w)], state^r[e(w)]; s[e] c_w^r)   (not kept)
  a_w^{r+1} = x_w

With outer SGD at lr 1 without momentum this is `one_round`'s rule
(g - c = x + (g - a)); with the outer Nesterov the worker's start also
takes the momentum's share of the step, which `one_round` applies a
round late, and differs from the undelayed start only by lr (1 + beta)
s (c_w - D) for Nesterov's beta. Each new anchor is made from the true
global, so a worker's prediction errors do not accumulate.

**Delay** `eager` (Kale, Douillard, Donchev 2025, "Eager updates", arXiv
2502.12996; the equation is from secondary summaries of its Algorithm 3,
not the paper itself). The global modules advance exactly as with
`one_round` (that is the model of record, and what the flush ends on), but
a worker does not wait for its own contribution to come back: it replaces
its stale term in the delayed average by its fresh one and applies the
outer optimizer to that at once, on its own copy (view v_w, momentum):

  E_w^r   = D^{r-1}[e(w)] + s[e] a[w, e] (C(c_w^r) - C(c_w^{r-1}))
  v_w, m_w <- OuterOpt(v_w, m_w; E_w^r)     (per worker)
  x_w     <- v_w,  a_w^{r+1} = v_w

(a, s: the mixing weight and the sqrt-users scale of Eq. 2). Each
worker's contribution thus enters its own view once, on time, and every
other worker's one round late; the views differ by one round of own
progress. Extra state: the previous round's sent contribution and the
per-worker outer optimizer state.

**Delay** `overlap` (Streaming DiLoCo, Douillard et al. 2025, arXiv
2501.18512: the outer step's communication overlaps tau inner steps of the
next round, 1 <= tau <= H = `diloco.overlap_steps`). Two halves, in
`diloco/overlap_step.py`, called by the loop (round k ends at step
(k + 1) H):

  handover, step (k + 1) H:
    c_w^k   = a_w - x_w                   (compressed as one_round's)
    D^k     = mix(C(c^k))                 (in flight)
    h_w     <- x_w                        (the parameters handed over)
  apply, step (k + 1) H + tau:
    g       <- OuterOpt(g, D^k)
    x_w     <- x_w + (g[e(w)] - h_w)      (the new global, plus the own
                                           progress since the handover)
    a_w     <- g[e(w)]

so the next handover's c_w = g - x_w is the worker's whole round (tau
steps before the apply and H - tau after), each pseudo-gradient reaches
the outer optimizer once, tau steps late. With tau = H the apply of round
k - 1 comes first at the step of round k's handover, which is
`one_round` in exact arithmetic (not bit for bit: one_round's c = a - x
has a = x_prev + (g - a_prev), ours g - x with x = x_prev + (g - h); in
float32 they round differently, ~1e-7). Our reading: the paper also
merges the arriving global with the local parameters by a weight alpha,
and streams fragments of the model at staggered times; we do neither
(alpha = 1 on the global, every module at once), and keep the worker's
own progress since the handover as one_round does. At the end of
training the last handover's apply is `flush`ed.

Everything lives in the state, so a checkpoint holds the round in flight:
  inner.anchor         {slot: [W, ...]}  delayed slots
  inner.handover       {slot: [W, ...]}  overlap: x at the last handover
  inner.residual       {slot: [W, ...]}  error feedback
  inner.codec_state    {slot: ...}       stateful compressors (low rank)
  inner.sent_bytes_W   [W]               payload bytes of the last round
  inner.prev_sent      {slot: [W, ...]}  eager: last round's C(c_w)
  inner.eager_opt      {slot: state}     eager: per-worker outer optimizer
  outer.pending        {slot: [K, ...]}  the mixed pseudo-gradient in flight
  outer.pending_users  {slot: [K]}       its weighted users per module
  outer.has_pending    int32             1 once a round is in flight
  outer.published_state {slot: ...}     a stateful download codec's state
  outer.published      {slot: [K, ...]}  compressed downloads: the
                                         workers' copy of the modules
  inner.recv_bytes_W   [W]               bytes read per worker: its
                                         payload, or the modules whole,
                                         + leader_topk's indices or
                                         lowrank_shared's means P, Q
"""

import jax
import jax.numpy as jnp

from dipaco_jax.diloco import compress
from dipaco_jax.diloco import compress_apply
from dipaco_jax.diloco import delay_views
from dipaco_jax.diloco import download as download_lib
from dipaco_jax.diloco import outer as outer_lib


def copy_top(part: dict) -> dict:
  """A copy of a state part whose dicts of slots can be replaced slot by
  slot without touching the caller's (the arrays are shared)."""
  return {k: dict(v) if isinstance(v, dict) else v for k, v in part.items()}


def init_extra(comms: dict, inner_params: dict, bank: dict,
               tx=None) -> tuple[dict, dict]:
  """The state the communication adds: (inner extras, outer extras), empty
  when every slot is plain. `tx` (the outer optimizer) is needed for eager
  slots."""
  inner, outer = {}, {}
  delayed = [n for n, c in comms.items() if c.delayed]
  eager = [n for n, c in comms.items() if c.delay == "eager"]
  if eager:
    inner["prev_sent"] = {n: compress_apply.init_residuals(inner_params[n])
                          for n in eager}
    inner["eager_opt"] = {n: jax.vmap(tx.init)(inner_params[n])
                          for n in eager}
  feedback = [n for n, c in comms.items() if c.spec.error_feedback]
  stateful = [n for n, c in comms.items()
              if compress.make_codec(c.spec).stateful]
  num_workers = jax.tree.leaves(inner_params)[0].shape[0]
  if delayed:
    inner["anchor"] = {n: jax.tree.map(jnp.copy, inner_params[n])
                       for n in delayed}
    outer["pending"] = {n: jax.tree.map(
        lambda x: jnp.zeros(x.shape, jnp.float32), bank[n]) for n in delayed}
    outer["pending_users"] = {
        n: jnp.zeros((jax.tree.leaves(bank[n])[0].shape[0],), jnp.float32)
        for n in delayed}
    outer["has_pending"] = jnp.zeros((), jnp.int32)
  overlap = [n for n, c in comms.items() if c.delay == "overlap"]
  if overlap:  # h: each worker's parameters at the last handover.
    inner["handover"] = {n: jax.tree.map(jnp.copy, inner_params[n])
                         for n in overlap}
  if feedback:
    inner["residual"] = {n: compress_apply.init_residuals(inner_params[n])
                         for n in feedback}
  if stateful:
    inner["codec_state"] = {
        n: compress_apply.init_states(compress.make_codec(comms[n].spec),
                                inner_params[n]) for n in stateful}
  if not all(c.plain for c in comms.values()):
    inner["sent_bytes_W"] = jnp.zeros((num_workers,), jnp.float32)
  outer.update(download_lib.init_outer(comms, bank))
  if "published" in outer or any(compress_apply.reads_while_sending(c.spec)
                                 for c in comms.values()):
    inner["recv_bytes_W"] = jnp.zeros((num_workers,), jnp.float32)
  return inner, outer


def _send(comm, contribs_W, inner: dict, name: str, num_workers: int,
          a_WxK, experts_W):
  """What the slot's workers send: (sent, residual, codec state, bytes
  sent, bytes read inside the upload or None)."""
  residual = inner.get("residual", {}).get(name)
  state = inner.get("codec_state", {}).get(name)
  if comm.spec.name == "none" and not comm.spec.error_feedback:
    return (contribs_W, residual, state,
            compress_apply.float32_bytes_W(contribs_W, num_workers), None)
  if compress_apply.encodes_together(comm.spec):  # Needs the worker axis.
    return compress_apply.compress_together(comm.spec, contribs_W, residual,
                                            state, a_WxK, experts_W)
  codec = compress.make_codec(comm.spec)
  return (*compress_apply.compress_tree(codec, contribs_W, residual, state),
          None)


def contribute(comm, anchor_W, x_W, inner: dict, new_inner: dict,
               name: str, num_workers: int, a_WxK, experts_W):
  """c_w = a_w - x_w and what the slot's workers send of it: (c, sent,
  bytes sent [W], bytes read inside the upload [W]: leader_topk's
  indices); sets the slot's new residual and codec state in `new_inner`.
  `a_WxK` (the slot's mixing weights) and `experts_W` (each worker's
  module) are what a codec shared by a module's users needs."""
  contribs_W = jax.tree.map(
      lambda a, x: a.astype(jnp.float32) - x.astype(jnp.float32),
      anchor_W, x_W)
  sent, residual, codec_state, bytes_W, read_W = _send(
      comm, contribs_W, inner, name, num_workers, a_WxK, experts_W)
  if residual is not None:
    new_inner["residual"][name] = residual
  if codec_state is not None:
    new_inner["codec_state"][name] = codec_state
  if read_W is None:
    read_W = jnp.zeros((num_workers,), jnp.float32)
  return contribs_W, sent, bytes_W, read_W


def outer_update(outer: dict, inner: dict, tx, *, comms: dict,
                 assignment_WxS, slot_names, weights_W,
                 rescale_by_sqrt_users: bool) -> tuple[dict, dict]:
  """One round's outer step of every slot with its communication settings.
  Returns (outer, inner): the new outer and inner parts of the state."""
  bank, opt_state = outer["params"], outer["opt_state"]
  num_experts = [jax.tree.leaves(bank[n])[0].shape[0] for n in slot_names]
  num_workers = assignment_WxS.shape[0]
  users = outer_lib.users_per_module(assignment_WxS, weights_W, num_experts)
  mixing = outer_lib.mixing_matrices(assignment_WxS, weights_W, num_experts)
  published = outer.get("published", {})
  # A round starts from the workers' copy of the modules: the global
  # modules themselves, or with compressed downloads what was sent of them.
  start = outer_lib.gather_workers(
      {n: published.get(n, bank[n]) for n in slot_names}, assignment_WxS,
      slot_names)
  has_pending = outer.get("has_pending", jnp.zeros((), jnp.int32)) > 0
  new_outer = copy_top(outer)
  new_inner = copy_top(inner)
  new_outer["params"], new_outer["opt_state"] = {}, {}
  bytes_W = jnp.zeros((num_workers,), jnp.float32)
  recv_W = jnp.zeros((num_workers,), jnp.float32)
  for s, name in enumerate(slot_names):
    comm = comms[name]
    if comm.delay == "overlap":  # Two halves, tau steps apart.
      raise ValueError("delay overlap: use diloco.overlap_step")
    x_W = inner["params"][name]
    anchor_W = inner["anchor"][name] if comm.delayed else start[name]
    contribs_W, sent, slot_bytes_W, read_W = contribute(
        comm, anchor_W, x_W, inner, new_inner, name, num_workers, mixing[s],
        assignment_WxS[:, s])
    bytes_W, recv_W = bytes_W + slot_bytes_W, recv_W + read_W
    if name not in published:  # Read whole (counted if leader_topk reads).
      recv_W = recv_W + compress_apply.float32_bytes_W(x_W, num_workers)
    delta_K = outer_lib.mix({name: sent}, (name,), [mixing[s]], [users[s]],
                            rescale_by_sqrt_users,
                            [comm.spec.aggregate])[name]
    if not comm.delayed:
      b, o = _optimize(tx, bank, opt_state, name, delta_K, users[s] > 0)
      copy_K = b
      if name in published:
        copy_K, recv_K = download_lib.publish_slot(outer, new_outer, comm,
                                                   name, b)
        recv_W = recv_W + recv_K[assignment_WxS[:, s]]
      new_inner["params"][name] = _gather(copy_K, assignment_WxS, s)
    else:
      b, o = _optimize(tx, bank, opt_state, name, outer["pending"][name],
                       outer["pending_users"][name] > 0)
      b, o = _where(has_pending, (b, o), (bank[name], opt_state[name]))
      if comm.delay == "eager":
        delayed_W = _gather(outer["pending"][name], assignment_WxS, s)
        x_W, new_inner["eager_opt"][name] = delay_views.eager_views(
            tx, inner, name, sent, delayed_W, has_pending,
            delay_views.own_scale_W(mixing[s], users[s],
                                    assignment_WxS[:, s],
                                    rescale_by_sqrt_users), anchor_W)
        new_inner["prev_sent"][name] = sent
      elif comm.delay == "lookahead":
        x_W = delay_views.lookahead_views(
            tx, b, o, assignment_WxS, s, contribs_W,
            delay_views.mix_scale_W(users[s], assignment_WxS[:, s],
                                    rescale_by_sqrt_users), x_W)
      elif comm.delay == "naive":  # The worker's round is dropped.
        x_W = jax.tree.map(lambda x, g: g.astype(x.dtype), x_W,
                           _gather(b, assignment_WxS, s))
      else:
        global_W = _gather(b, assignment_WxS, s)
        x_W = jax.tree.map(lambda x, g, a: (x + (g - a)).astype(x.dtype),
                           x_W, global_W, anchor_W)
      new_inner["params"][name] = x_W
      new_inner["anchor"][name] = x_W
      new_outer["pending"][name] = delta_K
      new_outer["pending_users"][name] = users[s]
    new_outer["params"][name], new_outer["opt_state"][name] = b, o
  if "has_pending" in outer:
    new_outer["has_pending"] = jnp.ones((), jnp.int32)
  if "sent_bytes_W" in inner:
    new_inner["sent_bytes_W"] = bytes_W
  if "recv_bytes_W" in inner:
    new_inner["recv_bytes_W"] = recv_W
  return new_outer, new_inner


def flush(outer: dict, inner: dict, tx, *, comms: dict, assignment_WxS,
          slot_names) -> tuple[dict, dict]:
  """Applies the round still in flight (at the end of training) and
  restarts every worker of a delayed slot from the global modules."""
  if "has_pending" not in outer:
    return outer, inner
  has_pending = outer["has_pending"] > 0
  new_outer = copy_top(outer)
  new_inner = copy_top(inner)
  for s, name in enumerate(slot_names):
    if not comms[name].delayed:
      continue
    b, o = _optimize(tx, outer["params"], outer["opt_state"], name,
                     outer["pending"][name], outer["pending_users"][name] > 0)
    b, o = _where(has_pending, (b, o), (outer["params"][name],
                                        outer["opt_state"][name]))
    new_outer["params"][name], new_outer["opt_state"][name] = b, o
    if name in outer.get("published", {}):  # Training ends: the copy is
      new_outer["published"][name] = b     # the global, read whole.
    x_W = _gather(b, assignment_WxS, s)
    new_inner["params"][name] = x_W
    new_inner["anchor"][name] = x_W
    new_outer["pending"][name] = jax.tree.map(jnp.zeros_like,
                                              outer["pending"][name])
    new_outer["pending_users"][name] = jnp.zeros_like(
        outer["pending_users"][name])
  new_outer["has_pending"] = jnp.zeros((), jnp.int32)
  return new_outer, new_inner


def _gather(slot_bank_K, assignment_WxS, s: int):
  """Each worker's copy of its module of slot `s`: [K, ...] -> [W, ...]."""
  return jax.tree.map(lambda x: x[assignment_WxS[:, s]], slot_bank_K)


def _optimize(tx, bank, opt_state, name, delta_K, active_K):
  b, o = outer_lib.optimize(tx, {name: bank[name]}, {name: opt_state[name]},
                            {name: delta_K}, {name: active_K})
  return b[name], o[name]


def _where(flag, new, old):
  return jax.tree.map(lambda n, o: jnp.where(flag, n, o), new, old)
