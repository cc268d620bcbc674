"""Per-path early stopping (DiPaCo section 2.7).

A small slice of each path's shard is held out; after every outer step each
path is scored on its own slice, and the path's parameters are kept when the
loss is the best so far. Evaluation then uses each path's best snapshot.
This helps small shards, i.e. many paths. Snapshots live on disk in the run
directory so that a resumed run keeps them:

  DIRECTORY/best.json                      {path: {"loss", "step"}}
  DIRECTORY/path_{p:05d}/s{step:08d}/      an orbax item (store.items)

A new best is saved under its own step and committed, then best.json is
pointed at it, then the previous one is deleted: a crash at any point leaves
best.json naming a committed snapshot. Snapshots best.json does not name
(leftovers of such a crash) are deleted when the run resumes.

The decisions are taken at once (every process takes the same ones), but
the writing runs on a background thread, one round at a time: saving every
improving path's snapshot synchronously held the training loop for seconds
each round (BUILD_NOTES.md, "Early stopping"). At most one round's writes
are in flight; the next outer step waits for them. `flush` waits for all of
them and is called before every checkpoint (train/loop.py), so a checkpoint
never gets ahead of best.json, and before snapshots are read.
"""

from concurrent import futures
import json
import re

from absl import logging
from etils import epath
import jax

from dipaco_jax.eval import routed
from dipaco_jax.parallel import multihost
from dipaco_jax.store import atomic
from dipaco_jax.store import items


class EarlyStopping:
  """Tracks each path's best snapshot by loss on its held-out slice."""

  def __init__(self, runtime, holdout_docs: list, directory, seq_len: int,
               prefix_len: int, batch_size: int):
    self.runtime, self.batch_size = runtime, batch_size
    self.layouts = [routed.make_layout(d, seq_len, prefix_len)
                    for d in holdout_docs]
    self.directory = epath.Path(directory)
    self.directory.mkdir(parents=True, exist_ok=True)
    self.best_path = self.directory / "best.json"
    best = (json.loads(self.best_path.read_text())
            if self.best_path.exists() else {})
    # An entry without its committed snapshot (e.g. a run directory from
    # before snapshots were orbax items) is forgotten: that path has no best.
    self.best = {k: v for k, v in best.items()
                 if atomic.is_committed(self._snapshot(int(k), v["step"]))}
    if len(self.best) < len(best):
      logging.warning("Early stopping: no committed snapshot for paths %s "
                      "in %s; they start afresh.",
                      sorted(set(best) - set(self.best)), self.directory)
    if multihost.is_writer():
      self._remove_unnamed()
    self._writer = futures.ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="early_stopping")
    self._in_flight = None  # The last round's writes (a Future).

  def _snapshot(self, path: int, step: int) -> epath.Path:
    return self.directory / f"path_{path:05d}" / f"s{step:08d}"

  def _remove_unnamed(self) -> None:
    """Deletes the snapshots best.json does not name."""
    named = {self._snapshot(int(k), v["step"]).relative_to(self.directory)
             for k, v in self.best.items()}
    for path_dir in self.directory.iterdir():
      if not re.fullmatch(r"path_\d+", path_dir.name):
        continue
      for snapshot in path_dir.iterdir():
        if snapshot.relative_to(self.directory) not in named:
          logging.info("Early stopping: removing stale %s.", snapshot)
          snapshot.rmtree()

  def __call__(self, step: int, state) -> None:
    bank = state["outer"]["params"]
    # Bounds what waits to be written (device memory) to one round's paths.
    self.flush()
    improved = {}
    for p, layout in enumerate(self.layouts):
      params = self.runtime.path_params(bank, p)
      nll = routed.token_nll(self.runtime.model, params, layout,
                             self.batch_size)
      loss = float(nll.sum() / max(layout.windows["weights"].sum(), 1.0))
      old = self.best.get(str(p))
      if old is None or loss < old["loss"]:
        replaced = old["step"] if old and old["step"] != step else None
        improved[p] = (params, loss, replaced)
        self.best[str(p)] = {"loss": loss, "step": step}
    if multihost.is_writer():  # Every process takes the same decisions.
      # `params` are gathered from the bank, not the train state's own
      # buffers, so the next steps' donation cannot free them meanwhile.
      self._in_flight = self._writer.submit(self._write, step, improved,
                                            dict(self.best))

  def _write(self, step: int, improved: dict, best: dict) -> None:
    """One round's new snapshots, then best.json, then the replaced ones."""
    for p, (params, loss, _) in improved.items():
      items.save_tree(self._snapshot(p, step), jax.device_get(params),
                      {"path": p, "step": step, "loss": loss})
    atomic.write_json(self.best_path, best)
    for p, (_, _, replaced) in improved.items():
      if replaced is not None:
        self._snapshot(p, replaced).rmtree()

  def flush(self) -> None:
    """Waits until everything decided so far is on disk; re-raises a
    failed write."""
    in_flight, self._in_flight = self._in_flight, None
    if in_flight is not None:
      in_flight.result()

  def best_params(self, path: int, like):
    """The path's best snapshot, shaped and placed like `like` (a path param
    tree of arrays or `jax.ShapeDtypeStruct`s; see `items.load_tree`)."""
    self.flush()
    entry = self.best.get(str(path))
    if entry is None:
      raise KeyError(f"Path {path} has no early-stopping snapshot in "
                     f"{self.directory}.")
    return items.load_tree(self._snapshot(path, entry["step"]), like)[0]
