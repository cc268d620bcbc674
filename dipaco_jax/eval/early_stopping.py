"""Per-path early stopping (DiPaCo section 2.7).

A small slice of each path's shard is held out; after every outer step each
path is scored on its own slice, and the path's parameters are kept when the
loss is the best so far. Evaluation then uses each path's best snapshot.
This helps small shards, i.e. many paths. Snapshots live on disk in the run
directory so that a resumed run keeps them:

  DIRECTORY/best.json                                  {path: {"loss", "step"}}
  DIRECTORY/modules/{slot}/{expert:05d}/s{step:08d}/   a module at a step, an
                                                       orbax item (store.items)

Paths share modules, so a snapshot is kept per module, not per path: an
outer step after which every path of DiPaCo 4x4 improves writes the bank
once (its 9 modules), not 16 paths' worth of them. A path's best at step s
is its modules at step s; a module's snapshot is deleted once no path's
best names it. Run directories from before keep
`DIRECTORY/path_{p:05d}/s{step:08d}/` (a whole path), still read.

New bests are saved under their step and committed, then best.json is
pointed at them, then the snapshots no best names any more are deleted: a
crash at any point leaves best.json naming committed snapshots. Snapshots
best.json does not name (leftovers of such a crash) are deleted when the
run resumes. A reader (`read_only`, e.g. `inference/workdir.py` opened on a
run that is still training) deletes nothing: to it a snapshot best.json
does not name yet may be one the writer has just committed.

The decisions are taken at once (every process takes the same ones), but
the writing runs on a background thread: saving every improving path
synchronously held the training loop for seconds each round (the cost of
early stopping: docs/performance.md). Training never waits for it; when
outer steps come faster than the disk takes their snapshots, a best
replaced before it was written is skipped, so what waits in device memory
is at most the modules the current bests name. `flush` waits for all of
it and is called before every checkpoint (train/loop.py), so a
checkpoint never gets ahead of best.json, and before snapshots are read.
"""

from concurrent import futures
import json
import re
import threading

from absl import logging
from etils import epath
import jax

from dipaco_jax.eval import routed
from dipaco_jax.eval import sharded
from dipaco_jax.parallel import multihost
from dipaco_jax.store import atomic
from dipaco_jax.store import items


class EarlyStopping:
  """Tracks each path's best snapshot by loss on its held-out slice."""

  def __init__(self, runtime, holdout_docs: list, directory, seq_len: int,
               prefix_len: int, batch_size: int, topology=None,
               every_rounds: int = 1, inner_steps: int = 1,
               last_step: int | None = None, read_only: bool = False):
    """`topology` defaults to the runtime's; a reader without a runtime
    (runtime None, no holdout documents) passes it, with `read_only`: it
    neither writes nor deletes anything in `directory`. With `every_rounds`
    N > 1 only the outer steps of rounds N, 2N, ... (steps // inner_steps)
    and the one at `last_step` are scored: a function of the step, so a
    resumed run scores the same ones."""
    self.runtime, self.batch_size = runtime, batch_size
    self.read_only = read_only
    self.every_rounds, self.inner_steps = every_rounds, max(inner_steps, 1)
    self.last_step = last_step
    self.topology = topology if topology is not None else runtime.topology
    self.slots = [s.name for s in self.topology.slots]
    self.expert_PxS = self.topology.path_assignment_PxS()
    self.layouts = [routed.make_layout(d, seq_len, prefix_len)
                    for d in holdout_docs]
    self.directory = epath.Path(directory)
    if not read_only:
      self.directory.mkdir(parents=True, exist_ok=True)
    self.best_path = self.directory / "best.json"
    self.best = self._read_best()
    if multihost.is_writer() and not read_only:
      self._remove_unnamed()
    # What waits for the writer thread (all under `_lock`): module
    # snapshots not on disk yet (directory -> (device arrays, meta)), the
    # newest best.json, and snapshots no best names any more.
    self._lock = threading.Lock()
    self._pending, self._best_pending, self._stale = {}, None, set()
    self._writing = False
    self._writer = futures.ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="early_stopping")
    self._in_flight = None  # The writer's current task (a Future).

  def _read_best(self) -> dict:
    """best.json's entries whose snapshots are committed. An entry without
    (e.g. a run directory from before snapshots were orbax items) is
    forgotten: that path has no best."""
    best = (json.loads(self.best_path.read_text())
            if self.best_path.exists() else {})
    kept = {k: v for k, v in best.items()
            if self._committed(int(k), v["step"])}
    if len(kept) < len(best):
      logging.warning("Early stopping: no committed snapshot for paths %s "
                      "in %s; they start afresh.",
                      sorted(set(best) - set(kept)), self.directory)
    return kept

  def _modules(self, path: int, step: int) -> list[epath.Path]:
    """The snapshot directories of `path`'s modules at `step`."""
    return [self._module(slot, int(e), step)
            for slot, e in zip(self.slots, self.expert_PxS[path])]

  def _module(self, slot: str, expert: int, step: int) -> epath.Path:
    return (self.directory / "modules" / slot / f"{expert:05d}" /
            f"s{step:08d}")

  def _legacy(self, path: int, step: int) -> epath.Path:
    """A whole path's snapshot, as run directories from before kept it."""
    return self.directory / f"path_{path:05d}" / f"s{step:08d}"

  def _committed(self, path: int, step: int) -> bool:
    return (all(atomic.is_committed(d) for d in self._modules(path, step))
            or atomic.is_committed(self._legacy(path, step)))

  def _named(self, best: dict) -> set:
    """Every snapshot directory the entries of `best` may read."""
    named = set()
    for key, entry in best.items():
      named.update(self._modules(int(key), entry["step"]))
      named.add(self._legacy(int(key), entry["step"]))
    return named

  def _remove_unnamed(self) -> None:
    """Deletes the snapshots best.json does not name."""
    named = self._named(self.best)
    snapshots = [s for d in self.directory.glob("path_*")
                 if re.fullmatch(r"path_\d+", d.name) for s in d.iterdir()]
    snapshots += list(self.directory.glob("modules/*/*/s*"))
    for snapshot in snapshots:
      if snapshot not in named:
        logging.info("Early stopping: removing stale %s.", snapshot)
        snapshot.rmtree()

  def scores_at(self, step: int) -> bool:
    """Whether the outer step that ended at `step` is scored."""
    return (step == self.last_step
            or (step // self.inner_steps) % self.every_rounds == 0)

  def __call__(self, step: int, state) -> None:
    if self.read_only:
      raise RuntimeError(f"Early stopping over {self.directory} is read-only.")
    if not self.scores_at(step):
      return
    bank = state["outer"]["params"]
    improved, before = [], dict(self.best)
    for p, loss in enumerate(self._losses(bank)):
      old = self.best.get(str(p))
      if old is None or loss < old["loss"]:
        improved.append(p)
        self.best[str(p)] = {"loss": loss, "step": step}
    if not improved:  # Nothing to save, best.json stays as it is.
      return
    # Each module of an improving path once, gathered on every process (a
    # computation over a bank that spans processes needs them all). They
    # are gathered from the bank, not the train state's own buffers, so
    # the next steps' donation cannot free them while they wait.
    modules = {(s, int(self.expert_PxS[p][i])) for p in improved
               for i, s in enumerate(self.slots)}
    arrays = {(slot, expert): jax.tree.map(lambda x, e=expert: x[e],
                                           bank[slot])
              for slot, expert in sorted(modules)}
    if not multihost.is_writer():  # Every process takes the same decisions.
      return
    stale = self._named(before) - self._named(self.best)
    with self._lock:
      for (slot, expert), module in arrays.items():
        self._pending[self._module(slot, expert, step)] = (
            module, {"slot": slot, "expert": expert, "step": step})
      for snapshot in stale:  # A best replaced before it was written is
        self._pending.pop(snapshot, None)  # never written.
      self._stale |= stale
      self._best_pending = dict(self.best)
      start = not self._writing
      self._writing = True
    if start:
      if self._in_flight is not None:
        try:  # The last task has ended or is ending: re-raise its error.
          self._in_flight.result()
        except BaseException:
          with self._lock:
            self._writing = False
          raise
      self._in_flight = self._writer.submit(self._write_pending)

  def _losses(self, bank) -> list[float]:
    """Each path's mean NLL on its held-out windows, scored a group of
    paths at a time (one per device of this process, as evaluation groups
    them), each group one program per batch and one read at the end."""
    num_paths = len(self.layouts)
    group = sharded.auto_group_size(num_paths, jax.local_device_count(), 0)
    devices = sharded.bank_devices(bank)
    losses = []
    for first in range(0, num_paths, group):
      paths = range(first, min(first + group, num_paths))
      layouts = [self.layouts[p] for p in paths]
      if devices is None:  # A host bank, or one spanning processes.
        sums = sharded.own_windows_nll_sums(
            self.runtime.model, [self.runtime.path_params(bank, p)
                                 for p in paths], layouts, self.batch_size)
      else:
        mesh, params = sharded.gather_paths(
            bank, self.slots, self.expert_PxS[list(paths)], devices)
        sums = sharded.placed_own_windows_nll_sums(
            self.runtime.model, mesh, params, layouts, self.batch_size)
        del params  # Read: freed before the next group is gathered.
      losses += [float(total / max(self.layouts[p].windows["weights"].sum(),
                                   1.0)) for p, total in zip(paths, sums)]
    return losses

  def _write_pending(self) -> None:
    """The writer thread: writes what waits (new module snapshots, then the
    best.json naming them, then the snapshots no best names), again while
    outer steps add more, so bests replaced meanwhile are skipped."""
    try:
      while True:
        with self._lock:
          if self._best_pending is None:
            self._writing = False
            return
          pending, best, stale = (dict(self._pending), self._best_pending,
                                  set(self._stale))
          self._best_pending = None
          self._stale -= stale
        for directory, (module, meta) in pending.items():
          items.save_tree(directory, jax.device_get(module), meta)
        atomic.write_json(self.best_path, best)
        for snapshot in stale:
          if snapshot.exists():
            snapshot.rmtree()
        with self._lock:
          for directory, module in pending.items():
            if self._pending.get(directory) is module:
              del self._pending[directory]
    except BaseException:
      with self._lock:
        self._writing = False
      raise

  def flush(self) -> None:
    """Waits until everything decided so far is on disk; re-raises a
    failed write."""
    if self._in_flight is not None:
      self._in_flight.result()  # Raises again if called again.
      self._in_flight = None

  def best_params(self, path: int, like):
    """The path's best snapshot, shaped and placed like `like` (a path param
    tree of arrays or `jax.ShapeDtypeStruct`s; see `items.load_tree`)."""
    self.flush()
    if self.read_only and str(path) in self.best and not self._committed(
        path, self.best[str(path)]["step"]):
      # The run being read has replaced this best (and deleted its
      # snapshot) since best.json was read: read it again.
      self.best = self._read_best()
    entry = self.best.get(str(path))
    if entry is None:
      raise KeyError(f"Path {path} has no early-stopping snapshot in "
                     f"{self.directory}.")
    legacy = self._legacy(path, entry["step"])
    if atomic.is_committed(legacy):
      return items.load_tree(legacy, like)[0]
    return {slot: items.load_tree(directory, like[slot])[0] for slot, directory
            in zip(self.slots, self._modules(path, entry["step"]))}
