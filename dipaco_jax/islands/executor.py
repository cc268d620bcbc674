r"""The outer executor role: the outer step of its modules, from the store.

  python -m dipaco_jax.islands.executor --store=RUN_DIR \
      [--shard=0 --num_shards=1]

Executor i of n owns every n-th unit (slot, expert, stage) in a fixed
order, so a large bank spreads over many executors; a unit is a module, or
with pipeline stages one stage's share of a layer slot's module
(`islands/units.py`), which steps alone: the outer step is elementwise. For
each unit (below: module), once every user's round-r contribution is
committed, it takes the module at version r (its parameters and outer
optimizer state: kept in memory from its own last step, read from the
store after a start) and loads those contributions, runs the rest of the
chain of `diloco.outer` (mix over the module's users, then the outer
optimizer; nothing re-written here; compressed contributions are decoded
first, `islands/wire.py`), and commits version r + 1: the
optimizer state first (with compressed downloads, then the workers'
compressed copy, `islands/downloads.py`), the parameters last. A module's
step waits only for its own users. A killed executor is restarted and carries on from the
newest committed version of each module; a re-run step writes the same
bytes.

A module that no worker uses (weight 0 for all) is frozen: version r + 1
keeps its parameters and momentum, as in the SPMD runtime.
"""

import functools
import time

from absl import flags
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dipaco_jax.diloco import comm as comm_lib
from dipaco_jax.diloco import outer as outer_lib
from dipaco_jax.islands import downloads as downloads_lib
from dipaco_jax.islands import layout
from dipaco_jax.islands import repair
from dipaco_jax.islands import role_cli
from dipaco_jax.islands import timeline
from dipaco_jax.islands import unit_io
from dipaco_jax.islands import units as units_lib
from dipaco_jax.islands import wire as wire_lib
from dipaco_jax.model import layers
from dipaco_jax.model import transformer
from dipaco_jax.store import atomic
from dipaco_jax.store import integrity
from dipaco_jax.store import items
from dipaco_jax.store import link
from dipaco_jax.train import preemption


def _add_expert_axis(tree):
  """A module as a one-expert slot ([1, ...]); scalar leaves (step counts,
  shared by a slot's experts) stay scalars, as in `items.module_of`."""
  return jax.tree.map(lambda x: x if np.ndim(x) == 0 else x[None], tree)


def _drop_expert_axis(tree):
  return jax.tree.map(lambda x: x if np.ndim(x) == 0 else x[0], tree)


# What an executor keeps of the versions it committed, so that its next
# step of a module reads only the round's contributions from the store: a
# parameter server's memory. Past it, the oldest are read back instead.
HOLD_BYTES = 4 << 30


# An outer step's seconds: version r and the round's contributions read,
# the step (on this process's device, the copy back to the host included),
# version r + 1 committed (the outer state, compressed downloads, the
# parameters); summed over the steps in the executor's stats.
EXECUTOR_PHASES = ("read", "step", "write")

# How often an executor looks for damaged versions to rebuild: a listing of
# control/repair/, which on gs:// costs a request's latency.
REPAIR_POLL_S = 1.0


class ModuleStepper:
  """The outer step of one module of a slot, jitted once per slot shape."""

  def __init__(self, spec: layout.RunSpec):
    config = spec.config_dict()
    self.tx = outer_lib.outer_optimizer(config.diloco)
    self.rescale = bool(config.diloco.rescale_by_sqrt_users)
    self.assignment_WxS = spec.topology().assignment_WxS
    self.weights_W = np.asarray(spec.weights_W, np.float64)
    slots = spec.topology().slots
    self.num_experts = [s.num_experts for s in slots]
    # Each slot's aggregation of its users' contributions (outer.mix).
    self.aggregate = {name: c.spec.aggregate for name, c in
                      comm_lib.comm_by_slot(config, slots).items()}
    self._step = jax.jit(self._step_fn, static_argnums=0)
    self._mix = jax.jit(self._mix_fn, static_argnums=0)
    self._mixing = {}

  def mixing(self, slot_index: int, expert: int):
    """(users, their a[w, e] as [U, 1], weighted users as [1]): Eq. (2)
    over the whole assignment, cut to this module; fixed for the run, so
    worked out once per module."""
    if (slot_index, expert) not in self._mixing:
      self._mixing[slot_index, expert] = self._mixing_of(slot_index, expert)
    return self._mixing[slot_index, expert]

  def _mixing_of(self, slot_index: int, expert: int):
    column_Wx1 = self.assignment_WxS[:, [slot_index]]
    k = [self.num_experts[slot_index]]
    a_WxK = outer_lib.mixing_matrices(column_Wx1, self.weights_W, k)[0]
    users_K = outer_lib.users_per_module(column_Wx1, self.weights_W, k)[0]
    users = layout.users_of(self.assignment_WxS, slot_index, expert)
    return (users, np.asarray(a_WxK)[users][:, expert:expert + 1],
            np.asarray(users_K)[expert:expert + 1])

  def _deltas(self, slot: str, contribs_U, a_Ux1, users_1) -> dict:
    """{slot: the module's pseudo-gradient [1, ...]}: Eq. (2) over its
    users' contributions [U, ...]."""
    return outer_lib.mix({slot: contribs_U}, [slot], [a_Ux1], [users_1],
                         self.rescale, [self.aggregate[slot]])

  def _mix_fn(self, slot: str, contribs_U, a_Ux1, users_1):
    return _drop_expert_axis(
        self._deltas(slot, contribs_U, a_Ux1, users_1)[slot])

  def mix(self, slot: str, contribs_U, a_Ux1, users_1):
    """The module's pseudo-gradient alone (no outer step), as `__call__`
    mixes it: what an eager worker reads of a round (islands/eager.py)."""
    return self._mix(slot, contribs_U, jnp.asarray(a_Ux1, jnp.float32),
                     jnp.asarray(users_1, jnp.float32))

  def _step_fn(self, slot: str, params, opt_state, contribs_U, a_Ux1,
               users_1):
    deltas = self._deltas(slot, contribs_U, a_Ux1, users_1)
    bank, state = outer_lib.optimize(
        self.tx, {slot: _add_expert_axis(params)},
        {slot: _add_expert_axis(opt_state)}, deltas, {slot: users_1 > 0})
    return _drop_expert_axis(bank[slot]), _drop_expert_axis(state[slot])

  def __call__(self, slot, params, opt_state, contribs_U, a_Ux1, users_1):
    return self._step(slot, params, opt_state, contribs_U,
                      jnp.asarray(a_Ux1, jnp.float32),
                      jnp.asarray(users_1, jnp.float32))


class Executor:
  """Outer steps of the units `modules` [(slot index, expert, stage)]."""

  def __init__(self, run, spec: layout.RunSpec, modules, role_id: str,
               log=print, hold_bytes: int = HOLD_BYTES):
    self.run, self.spec, self.log = run, spec, log
    slots = spec.topology().slots
    self.slot_names = [s.name for s in slots]
    stages = units_lib.num_stages(spec.config)
    self.num_units = [units_lib.slot_stages(s, stages) for s in slots]
    self.modules = list(modules)
    self.stepper = ModuleStepper(spec)
    self.wire = wire_lib.Wire(spec.config_dict(), spec.topology().slots)
    self.downloads = downloads_lib.Downloads(spec.config_dict(),
                                             spec.topology().slots)
    self.meter = layout.ByteMeter(run, role_id)
    self.stats_path = layout.control(run, "stats", f"{role_id}.json")
    self.stats = layout.read_json(self.stats_path) or {"outer_steps": 0,
                                                       "seconds": 0.0}
    self.next_version = {m: self._first_missing(m) for m in self.modules}
    # {unit: (version, params, opt_state)}: what the last step committed,
    # oldest first, at most `hold_bytes` in all.
    self.held = {}
    self.hold_bytes = hold_bytes

  def key(self, module) -> str:
    """The unit's slot part of its store keys."""
    s, _, stage = module
    return units_lib.unit_key(self.slot_names[s], stage, self.num_units[s])

  def _first_missing(self, module) -> int:
    latest = layout.latest_module_version(self.run, self.key(module),
                                          module[1])
    return 1 if latest is None else latest + 1

  def ready(self, module, round_index: int) -> bool:
    s, e, _ = module
    users = layout.users_of(self.stepper.assignment_WxS, s, e)
    return all(layout.committed(layout.contrib_dir(
        self.run, round_index, int(w), self.key(module))) for w in users)

  def step(self, module, round_index: int, likes, hold: bool = True
           ) -> None:
    """Version r + 1 of `module` from version r and round r's
    contributions; `hold`: keep it in memory for the next step (not for
    a rebuild of an older version)."""
    started = time.monotonic()
    ops_before = link.thread_counts().copy()
    s, e, _ = module
    name, unit, r = self.slot_names[s], self.key(module), round_index
    params_like, _ = likes
    params, opt_state = self._version(module, r, likes)
    users, a_Ux1, users_1 = self.stepper.mixing(s, e)
    contribs_U = unit_io.read_contributions(self.run, self.wire, self.meter,
                                            r, users, name, unit,
                                            params_like)
    t_read = time.monotonic()
    params, opt_state = jax.device_get(self.stepper(
        name, params, opt_state, contribs_U, a_Ux1, users_1))
    t_step = time.monotonic()
    meta = {"round": r, "users": [int(w) for w in users]}
    key = layout.outer_state_dir(self.run, unit, e, r + 1)
    items.save_tree(key, opt_state, meta)
    self.meter.add("written", r, key)
    if self.downloads.compressed(name):
      self._publish(module, r, params, params_like, meta)
    key = layout.module_dir(self.run, unit, e, r + 1)
    items.save_tree(key, params, meta)
    self.meter.add("written", r, key)
    self.meter.flush()
    if hold:
      self._hold(module, r + 1, params, opt_state)
    # Load, step and commit: the time a round waits on this module.
    done = time.monotonic()
    self.stats["outer_steps"] += 1
    self.stats["seconds"] += done - started
    phases = self.stats.setdefault("phases_s", dict.fromkeys(
        EXECUTOR_PHASES, 0.0))
    for kind, seconds in zip(EXECUTOR_PHASES, (
        t_read - started, t_step - t_read, done - t_step)):
      phases[kind] += seconds
    # The store operations of the step (read, write, the meter's file):
    # what a slow store charges its latency for (store/link.py).
    ops = self.stats.setdefault("store_ops", {})
    for kind, count in link.since(ops_before).items():
      ops[kind] = ops.get(kind, 0) + count
    atomic.write_json(self.stats_path, self.stats, indent=None)

  def _version(self, module, r: int, likes):
    """(parameters, outer optimizer state) of `module` at version r: the
    ones this executor committed last round, kept in memory (the same
    bytes as the store's: saved without loss), or read from the store
    (the first step after a start or a restart)."""
    held = self.held.get(module)
    if held is not None and held[0] == r:
      del self.held[module]
      return held[1], held[2]
    s, e, _ = module
    unit = self.key(module)
    params_like, opt_like = likes
    key = layout.module_dir(self.run, unit, e, r)
    params, _ = items.load_tree(key, params_like)
    self.meter.add("read", r, key)
    key = layout.outer_state_dir(self.run, unit, e, r)
    opt_state, _ = items.load_tree(key, opt_like)
    self.meter.add("read", r, key)
    return params, opt_state

  def _hold(self, module, version: int, params, opt_state) -> None:
    self.held[module] = (version, params, opt_state)
    size = lambda held: sum(x.nbytes for x in jax.tree.leaves(held[1:]))
    while sum(size(h) for h in self.held.values()) > self.hold_bytes:
      del self.held[next(iter(self.held))]

  def _publish(self, module, r: int, params, params_like, meta) -> None:
    """The workers' copy of version r + 1: its change from their copy of
    version r, compressed, and the new copy whole."""
    s, e, _ = module
    name, unit = self.slot_names[s], self.key(module)
    copy = self.downloads.held(unit, e, r)
    if copy is None:  # Restarted: the copy of version r as it was written.
      copy = self.downloads.whole(self.run, unit, e, r, params_like,
                                  self.meter, r)
    trimmed, copy = self.downloads.publish(name, params, copy, r)
    for key, tree in ((layout.download_dir(self.run, unit, e, r + 1),
                       trimmed),
                      (layout.published_dir(self.run, unit, e, r + 1), copy)):
      items.save_tree(key, tree, meta)
      self.meter.add("written", r, key)
    self.downloads.remember(unit, e, r + 1, copy)

  def finished(self) -> bool:
    return all(v > self.spec.num_rounds for v in self.next_version.values())

  def poll(self, likes_of, role: str = "executor") -> int:
    """Steps every module whose next round is complete; returns how many.
    A damaged input is reported and the module waits for its rebuild."""
    stepped = 0
    for module in self.modules:
      version = self.next_version[module]
      if version > self.spec.num_rounds or not self.ready(module,
                                                          version - 1):
        continue
      try:
        self.step(module, version - 1, likes_of(module))
      except integrity.DamagedKeyError as e:
        repair.report(self.run, e, role, self.log)
        continue
      except items.NotCommittedError:
        continue  # Set aside by another reader meanwhile: rebuilt soon.
      self.next_version[module] += 1
      stepped += 1
    return stepped


def module_likes(spec: layout.RunSpec):
  """`likes_of(unit) -> (params_like, opt_state_like)`: host restore
  targets of a unit's parameters and outer optimizer state, from the
  model's shapes (no device work)."""
  config = spec.config_dict()
  topology = spec.topology()
  model = transformer.build_model(
      layers.dims_from_config(config.model, spec.vocab_size), topology)
  path = jax.eval_shape(model.init, jax.random.key(0),
                        jnp.zeros((1, 8), jnp.int32))["params"]
  path = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                      nn.unbox(path))
  tx = outer_lib.outer_optimizer(config.diloco)
  slot_names = [s.name for s in topology.slots]
  stages = units_lib.num_stages(config)
  num_units = [units_lib.slot_stages(s, stages) for s in topology.slots]

  @functools.lru_cache(maxsize=None)
  def of_slot(s: int):
    # Every stage's share has the same shapes.
    params = units_lib.share_like(path[slot_names[s]], num_units[s])
    opt = jax.eval_shape(tx.init, params)
    return params, jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), opt)
  return lambda module: of_slot(module[0])


def all_units(spec: layout.RunSpec) -> list[tuple[int, int, int]]:
  """Every (slot index, expert, stage) of the run, in a fixed order: a
  module's stages next to each other."""
  stages = units_lib.num_stages(spec.config)
  return [(s, e, stage) for s, slot in enumerate(spec.topology().slots)
          for e in range(slot.num_experts)
          for stage in range(units_lib.slot_stages(slot, stages))]


def owned_modules(spec: layout.RunSpec, shard: int, num_shards: int):
  """Executor `shard`'s units: every `num_shards`-th of `all_units`, so a
  module's stages go to different executors and step in parallel."""
  return all_units(spec)[shard::num_shards]


def serve(run, shard: int = 0, num_shards: int = 1, poll_s: float = 0.1,
          timeout_s: float = 24 * 3600.0) -> None:
  """Applies outer steps (and rebuilds damaged versions) until every
  owned module reaches the last version and the run is done."""
  spec = layout.RunSpec.load(run)
  spec.use_store()
  role = f"executor-{shard}-of-{num_shards}"
  log = lambda msg: print(f"[{role}] {msg}", flush=True)
  executor = Executor(run, spec, owned_modules(spec, shard, num_shards),
                      role, log)
  likes_of = module_likes(spec)
  loop = timeline.LoopOps(run, role)
  deadline = time.monotonic() + timeout_s
  poll_s = layout.poll_interval(run, poll_s)
  next_repair = 0.0
  # Its units finished, it stays until the run is done: a task re-run on
  # a damaged key may still read (and need rebuilt) one of their versions.
  while not (executor.finished() and layout.is_done(run)):
    loop.start()
    if time.monotonic() >= next_repair:  # A listing, not every poll.
      repair.rebuild_versions(executor, likes_of, role)
      next_repair = time.monotonic() + REPAIR_POLL_S
    steps_before = dict(executor.stats.get("store_ops", {}))
    stepped = executor.poll(likes_of, role)
    loop.end(work={k: v - steps_before.get(k, 0) for k, v in
                   executor.stats.get("store_ops", {}).items()})
    if stepped:
      continue
    if time.monotonic() > deadline:
      raise TimeoutError(f"{role}: run not finished in {timeout_s:.0f} s")
    time.sleep(poll_s)
  loop.save()
  preemption.finished()
  log(f"done: {len(executor.modules)} units at version "
      f"{spec.num_rounds}")


def _define_flags(flag_values) -> None:
  define = dict(flag_values=flag_values)
  flags.DEFINE_string("store", None, "the run's directory", **define)
  flags.mark_flag_as_required("store", flag_values=flag_values)
  flags.DEFINE_integer("shard", 0, "this executor's share of the modules: "
                       "every num_shards-th, from this one", lower_bound=0,
                       **define)
  flags.DEFINE_integer("num_shards", 1, "executors sharing the modules",
                       lower_bound=1, **define)


def main(argv=None) -> None:
  args = role_cli.parse("executor", __doc__, _define_flags, argv)
  with layout.role_errors(f"executor {args.shard}"):
    serve(args.store, args.shard, args.num_shards)


if __name__ == "__main__":
  main()
