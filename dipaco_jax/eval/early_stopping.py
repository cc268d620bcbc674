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
"""

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
    replaced = []
    for p, layout in enumerate(self.layouts):
      params = self.runtime.path_params(bank, p)
      nll = routed.token_nll(self.runtime.model, params, layout,
                             self.batch_size)
      loss = float(nll.sum() / max(layout.windows["weights"].sum(), 1.0))
      key = str(p)
      if key not in self.best or loss < self.best[key]["loss"]:
        # Every process takes the same decisions; process 0 writes.
        if multihost.is_writer():
          items.save_tree(self._snapshot(p, step), jax.device_get(params),
                          {"path": p, "step": step, "loss": loss})
          if key in self.best and self.best[key]["step"] != step:
            replaced.append(self._snapshot(p, self.best[key]["step"]))
        self.best[key] = {"loss": loss, "step": step}
    if multihost.is_writer():
      atomic.write_json(self.best_path, self.best)
      for snapshot in replaced:
        snapshot.rmtree()

  def best_params(self, path: int, like):
    """The path's best snapshot, shaped and placed like `like` (a path param
    tree of arrays or `jax.ShapeDtypeStruct`s; see `items.load_tree`)."""
    entry = self.best.get(str(path))
    if entry is None:
      raise KeyError(f"Path {path} has no early-stopping snapshot in "
                     f"{self.directory}.")
    return items.load_tree(self._snapshot(path, entry["step"]), like)[0]
