"""Checkpoints of the SPMD runtime: a thin wrapper over orbax
`CheckpointManager`.

A checkpoint holds the whole training state as separate orbax items, the
same parts the island runtime saves per worker and per module
(`train.state`): `inner` (every worker's parameters and AdamW state),
`outer` (the module bank and its per-slot outer optimizer state), and a JSON
`meta` item with the step and the hashes of the config, tokenizer, router
and shards it belongs to (DESIGN invariant 4). Restoring under different
hashes is an error, never a silent mix. Paths may be local or `gs://`
(etils.epath); orbax commits each step atomically.
"""

from absl import logging
from etils import epath
import jax
import numpy as np
import orbax.checkpoint as ocp

STATE_ITEMS = ("inner", "outer")


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
        self.directory, options=options,
        item_names=STATE_ITEMS + ("meta",))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def should_save(self, step: int, last_step: int) -> bool:
    return step == last_step or (self.every > 0 and step % self.every == 0)

  def save(self, step: int, state, meta: dict) -> None:
    items = {name: ocp.args.StandardSave(state[name]) for name in STATE_ITEMS}
    self.manager.save(step, args=ocp.args.Composite(
        meta=ocp.args.JsonSave({**meta, "step": step}), **items))

  def restore(self, step: int, abstract_state, expected_hashes: dict):
    """Restores `step` into the shardings of `abstract_state`."""
    meta = self.manager.restore(step, args=ocp.args.Composite(
        meta=ocp.args.JsonRestore()))["meta"]
    if "step" not in meta:
      raise CheckpointMismatchError(
          f"The checkpoint {self.directory}/{step} has the state layout of "
          "an older dipaco_jax (one 'state' item); use a fresh --workdir.")
    check_hashes(meta.get("hashes", {}), expected_hashes,
                 f"{self.directory}/{step}")
    restored = self.manager.restore(step, args=ocp.args.Composite(**{
        name: ocp.args.StandardRestore(abstract_state[name])
        for name in STATE_ITEMS}))
    step_sharding = abstract_state["step"].sharding
    state = {name: restored[name] for name in STATE_ITEMS}
    state["step"] = jax.make_array_from_callback(
        (), step_sharding, lambda _: np.asarray(meta["step"], np.int32))
    logging.info("Restored step %d from %s", step, self.directory)
    return state, meta

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
