"""Per-path early stopping (DiPaCo section 2.7).

A small slice of each path's shard is held out; after every outer step each
path is scored on its own slice, and the path's parameters are kept when the
loss is the best so far. Evaluation then uses each path's best snapshot.
This helps small shards, i.e. many paths. Snapshots live on disk in the run
directory so that a resumed run keeps them.
"""

import json

from etils import epath
import jax
import numpy as np

from dipaco_jax.eval import routed
from dipaco_jax.parallel import multihost


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
    self.best = (json.loads(self.best_path.read_text())
                 if self.best_path.exists() else {})

  def __call__(self, step: int, state) -> None:
    bank = state["outer_params"]
    for p, layout in enumerate(self.layouts):
      params = self.runtime.path_params(bank, p)
      nll = routed.token_nll(self.runtime.model, params, layout,
                             self.batch_size)
      loss = float(nll.sum() / max(layout.windows["weights"].sum(), 1.0))
      key = str(p)
      if key not in self.best or loss < self.best[key]["loss"]:
        # Every process takes the same decisions; process 0 writes.
        if multihost.is_writer():
          self._save_snapshot(p, jax.device_get(params))
        self.best[key] = {"loss": loss, "step": step}
    if multihost.is_writer():
      self.best_path.write_text(json.dumps(self.best, indent=1))

  def _save_snapshot(self, path: int, host_params) -> None:
    leaves = {f"leaf_{i}": np.asarray(x)
              for i, x in enumerate(jax.tree.leaves(host_params))}
    final = self.directory / f"path_{path:05d}.npz"
    tmp = self.directory / f"path_{path:05d}.tmp.npz"
    with tmp.open("wb") as f:
      np.savez(f, **leaves)
    tmp.replace(final)  # Atomic: a crash never leaves half a snapshot.

  def best_params(self, path: int, like):
    """The path's best snapshot, shaped like `like` (a path param tree)."""
    with (self.directory / f"path_{path:05d}.npz").open("rb") as f:
      z = np.load(f)
      leaves = [z[f"leaf_{i}"] for i in range(len(z.files))]
    return jax.tree.unflatten(jax.tree.structure(like), leaves)
