"""One of two processes (4 fake CPU devices each, one 8-device mesh) that
save or restore a sharded state with `train.checkpoint.Checkpointer`, for
tests/test_sharded_checkpoint.py.

  python tests/sharded_checkpoint_probe.py '{"address": ..., "process_id": i,
      "directory": ..., "action": "save" | "restore", "out": FILE}'

The state: two items of one float32 array each, its rows sharded over the 8
devices, so each process holds half of it. `save` saves steps 1 and 2 (other
values); `restore` restores the newest intact step. Each writes to `out`
(JSON) the process's memory (VmRSS before, VmHWM during the checkpoint
call, reset just before it), the step restored and whether every shard this
process holds equals what was saved.
"""

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=4")

import jax  # pylint: disable=g-import-not-at-top
from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

from dipaco_jax.parallel import multihost  # pylint: disable=g-import-not-at-top
from dipaco_jax.train import checkpoint as ckpt_lib  # pylint: disable=g-import-not-at-top

ROWS, COLUMNS = 8 * 4096, 4096  # 512 MiB of float32 an item.


def _memory_kib(field: str) -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1])
  raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
  """Starts VmHWM afresh at VmRSS (Linux: clear_refs 5)."""
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")


def values(item: int, step: int, rows: slice) -> np.ndarray:
  """The saved array of `item` at `step`, rows `rows`: a pure function of
  them, so any process can tell what any shard must hold."""
  start = rows.start or 0
  row_ids = np.arange(start, rows.stop, dtype=np.float32)[:, None]
  column_ids = np.arange(COLUMNS, dtype=np.float32)[None, :]
  return np.sin(row_ids * 0.37 + column_ids * 0.011 + item + 10.0 * step)


def _state(sharding, replicated, step: int):
  def item(index):
    return jax.make_array_from_callback(
        (ROWS, COLUMNS), sharding,
        lambda region: values(index, step, region[0]))
  return {"inner": {"w": item(0)}, "outer": {"bank": item(1)},
          "step": jax.device_put(np.int32(step), replicated)}


def main(args: dict) -> None:
  multihost.initialize(args["address"], 2, args["process_id"])
  mesh = jax.make_mesh((8,), ("d",))
  sharding = NamedSharding(mesh, P("d", None))
  replicated = NamedSharding(mesh, P())
  checkpointer = ckpt_lib.Checkpointer(args["directory"], every=1, keep=3)
  report = {"share_kib": ROWS * COLUMNS * 4 * 2 // 2 // 1024,
            "whole_kib": ROWS * COLUMNS * 4 * 2 // 1024}
  if args["action"] == "save":
    for step in (1, 2):
      state = _state(sharding, replicated, step)
      jax.block_until_ready(state)
      report[f"rss_before_kib_{step}"] = _memory_kib("VmRSS")
      _reset_peak()
      checkpointer.save(step, state, {"hashes": {}})
      checkpointer.manager.wait_until_finished()
      report[f"peak_kib_{step}"] = _memory_kib("VmHWM")
      del state
  else:
    abstract = {"inner": {"w": jax.ShapeDtypeStruct(
        (ROWS, COLUMNS), np.float32, sharding=sharding)},
                "outer": {"bank": jax.ShapeDtypeStruct(
                    (ROWS, COLUMNS), np.float32, sharding=sharding)},
                "step": jax.ShapeDtypeStruct((), np.int32,
                                             sharding=replicated)}
    report["rss_before_kib"] = _memory_kib("VmRSS")
    _reset_peak()
    state, _, step = checkpointer.restore_latest(abstract, {})
    jax.block_until_ready(state)
    report["peak_kib"] = _memory_kib("VmHWM")
    report["step"] = step
    report["exact"] = all(
        np.array_equal(np.asarray(shard.data),
                       values(index, step, shard.index[0]))
        for index, leaf in enumerate((state["inner"]["w"],
                                      state["outer"]["bank"]))
        for shard in leaf.addressable_shards)
  checkpointer.close()
  with open(args["out"], "w") as f:
    json.dump(report, f)


if __name__ == "__main__":
  main(json.loads(sys.argv[1]))
