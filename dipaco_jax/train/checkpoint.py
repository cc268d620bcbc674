"""Checkpoints: a thin wrapper over orbax `CheckpointManager`.

A checkpoint holds the whole training state (outer bank and its optimizer
state, every worker's parameters and AdamW state, the step) plus a JSON item
with the hashes of the config, tokenizer, router and shards it belongs to
(DESIGN invariant 4). Restoring under different hashes is an error, never a
silent mix. Paths may be local or `gs://` (etils.epath).
"""

from absl import logging
from etils import epath
import orbax.checkpoint as ocp


class CheckpointMismatchError(RuntimeError):
  """The checkpoint belongs to another config, tokenizer or data."""


class Checkpointer:
  """Periodic and final saves, resume from the latest."""

  def __init__(self, directory: str, every: int, keep: int,
               async_save: bool = True):
    self.directory = epath.Path(directory)
    self.every = every
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=True,
        enable_async_checkpointing=async_save)
    self.manager = ocp.CheckpointManager(
        self.directory, options=options, item_names=("state", "meta"))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def should_save(self, step: int, last_step: int) -> bool:
    return step == last_step or (self.every > 0 and step % self.every == 0)

  def save(self, step: int, state, meta: dict) -> None:
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        meta=ocp.args.JsonSave(meta)))

  def restore(self, step: int, abstract_state, expected_hashes: dict):
    """Restores `step` into the shardings of `abstract_state`."""
    meta = self.manager.restore(step, args=ocp.args.Composite(
        meta=ocp.args.JsonRestore()))["meta"]
    check_hashes(meta.get("hashes", {}), expected_hashes,
                 f"{self.directory}/{step}")
    restored = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state)))
    logging.info("Restored step %d from %s", step, self.directory)
    return restored["state"], meta

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def check_hashes(found: dict, expected: dict, where: str) -> None:
  bad = {k: (found.get(k), v) for k, v in expected.items()
         if found.get(k) != v}
  if bad:
    lines = "\n".join(f"  {k}: checkpoint {f} != this run {e}"
                      for k, (f, e) in sorted(bad.items()))
    raise CheckpointMismatchError(
        f"The checkpoint {where} belongs to a different run:\n{lines}\n"
        "Use a fresh --workdir, or restore the config/data it was made with.")

