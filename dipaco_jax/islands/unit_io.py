"""Reads and writes of units (`islands/units.py`) and of contributions.

A module is read as its units' keys (in parallel threads) and joined on
the host; a round's
contributions are written one key per unit, the S stages of a pipelined
worker in S threads, each copying to the host only its own stage's rows
(from the devices that hold them) and uploading 1/S of the bytes. A
round's contributions are read back, decoded, by the executors and by
`eager` workers (`read_contributions`).
"""

from concurrent import futures

import jax
import numpy as np

from dipaco_jax.islands import background
from dipaco_jax.islands import layout
from dipaco_jax.islands import units as units_lib
from dipaco_jax.store import items


def read_module(runner, slot_name: str, num_units: int, expert: int,
                version: int, like, round_index: int):
  """Module (slot, expert) at `version`, from its units' keys (host); with
  compressed downloads, the workers' copy of it (`islands/downloads.py`)."""
  if runner.downloads.compressed(slot_name):  # One unit: stages refused.
    return runner.downloads.copy_at(runner.run, slot_name, expert, version,
                                    like, runner.meter, round_index)
  share_like = units_lib.share_like(like, num_units)

  def read(stage):
    key = layout.module_dir(
        runner.run, units_lib.unit_key(slot_name, stage, num_units), expert,
        version)
    tree, _ = items.load_tree(key, share_like)
    runner.meter.add("read", round_index, key)
    return tree
  if num_units == 1:
    return read(0)
  with futures.ThreadPoolExecutor(num_units) as pool:
    return units_lib.join(list(pool.map(read, range(num_units))))


def contribution_keys(runner, round_index: int, worker: int) -> list:
  return [layout.contrib_dir(runner.run, round_index, worker, key)
          for slot in runner.topology.slots
          for key in units_lib.keys_of_slot(slot, runner.stages)]


def _write_stage(runner, task, payloads, loss_G, stage: int) -> None:
  """Stage `stage`'s contribution keys of every worker of the task (stage 0
  also writes the slots that are one unit)."""
  r = task.round_index
  for slot in runner.topology.slots:
    n = units_lib.slot_stages(slot, runner.stages)
    if stage >= n:
      continue
    key = units_lib.unit_key(slot.name, stage, n)
    if key in payloads:  # A whole slot, or a unit's compressed payload.
      payload_G = jax.device_get(payloads[key])
    else:  # A plain layer slot, split here: only this stage's rows move.
      payload_G = units_lib.host_share_tree(payloads[slot.name], stage, n,
                                            axis=1)
    for i, w in enumerate(task.group):
      directory = layout.contrib_dir(runner.run, r, w, key)
      items.save_tree(directory,
                      runner.wire.to_wire(slot.name, payload_G, i),
                      {"round": r, "worker": w, "loss": float(loss_G[i])})
      runner.meter.add("written", r, directory)


def write_contributions(runner, task, payloads, loss_G) -> None:
  """Each worker's contribution of the round, one key per unit: float32,
  or a compressed unit's trimmed payload. `payloads` (device or host) is
  keyed by slot, and by unit key for compressed layer slots split by
  stage (`Wire.encode_units`)."""
  if runner.stages == 1:
    _write_stage(runner, task, payloads, loss_G, 0)
    return
  uploads = [background.Background(_write_stage, runner, task, payloads,
                                   loss_G, stage)
             for stage in range(runner.stages)]
  for upload in uploads:
    upload.start()
  for upload in uploads:
    upload.join()


def read_contributions(run, wire, meter, round_index: int, users, name: str,
                       unit: str, params_like):
  """Round r's contributions of a unit's `users`, decoded (compressed
  payloads through `wire`, islands/wire.py): leaves [U, ...]."""
  rows = []
  for w in users:
    key = layout.contrib_dir(run, round_index, int(w), unit)
    if name in wire.codecs:  # A compressed payload.
      stored, _ = items.load_saved(key)
      tree = wire.from_wire(name, stored, params_like)
    else:
      tree, _ = items.load_tree(key, params_like)
    meter.add("read", round_index, key)
    rows.append(tree)
  if not rows:
    return jax.tree.map(lambda x: np.zeros((0,) + x.shape, x.dtype),
                        params_like)
  return jax.tree.map(lambda *x: np.stack(x), *rows)
