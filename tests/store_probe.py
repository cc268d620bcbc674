"""A long-lived process that answers store questions, for the cross-process
tests of `tests/test_gcs_processes.py`.

It reads one JSON command a line on stdin and writes one JSON answer a line
on stdout ({"ok": value} or {"error": "Type: message"}), so a test can ask
it what it sees of the store after another process wrote there. It uses the
store's own functions, in one process for its whole life, as a coordinator
or worker does: whatever a gcsfs listing or client cache remembers from an
earlier answer is what a later answer would be built from.

Its environment comes from the test (`testing.gcs.client_env`, the emulator's
address), with no gcsfs setting of its own: what keeps its reads fresh is
the package's own configuration at import.

Commands ({"op": ..., arguments}):
  env                          what this process's gcsfs is set up with
  control_files {dir}          names of the control files listed there
  read_json {path}             the file's JSON, or None
  latest_module_version {run, slot, expert}
  is_committed {key}
  repair_requests {run}        the pending requests' keys, relative
  load_tree {key}              {"w": [...]} of a key holding {"w": f32[n]}
                               (or {"error": "NotCommittedError: ..."})
  save_tree {key, value, n, barrier?}
                               saves {"w": full(n, value)}; with
                               `barrier` (a directory), waits there twice
                               for the other racer: once its commit check
                               has said "not committed", once its files are
                               written and its marker is next
  quit
"""

import json
import os
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)

# pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np

from dipaco_jax.islands import layout
from dipaco_jax.islands import repair
from dipaco_jax.store import atomic
from dipaco_jax.store import items
# pylint: enable=g-import-not-at-top,wrong-import-position

_BARRIER_TIMEOUT_S = 60.0  # Bounded: the test kills a probe that overstays.


def _meet(barrier: str, name: str, stage: str, racers: int = 2) -> None:
  """Marks `name` arrived at `stage` and waits for every racer."""
  os.makedirs(barrier, exist_ok=True)
  with open(os.path.join(barrier, f"{stage}-{name}"), "w"):
    pass
  deadline = time.monotonic() + _BARRIER_TIMEOUT_S
  while sum(f.startswith(stage + "-") for f in os.listdir(barrier)) < racers:
    if time.monotonic() > deadline:
      raise TimeoutError(f"barrier {stage}: the other racer never came")
    time.sleep(0.01)


def _save_tree(key: str, value: float, n: int, barrier: str | None) -> bool:
  tree = {"w": np.full((n,), value, np.float32)}
  if barrier is None:
    return items.save_tree(key, tree)
  name = str(os.getpid())
  is_committed, commit = atomic.is_committed, atomic.commit

  def checked_then_wait(directory):
    committed = is_committed(directory)
    _meet(barrier, name, "checked")
    return committed

  def wait_then_commit(directory, meta):
    _meet(barrier, name, "written")
    return commit(directory, meta)

  atomic.is_committed, atomic.commit = checked_then_wait, wait_then_commit
  try:
    return items.save_tree(key, tree)
  finally:
    atomic.is_committed, atomic.commit = is_committed, commit


def _env(_):
  import fsspec  # pylint: disable=g-import-not-at-top
  fs = fsspec.filesystem("gs")
  return {"listings_cache": bool(fs.dircache.use_listings_cache),
          "env_setting": os.environ.get("FSSPEC_GCS_USE_LISTINGS_CACHE"),
          "epath_use_tf": os.environ.get("EPATH_USE_TF")}


def _load_tree(command):
  n = command.get("n", 4)
  tree, _ = items.load_tree(command["key"], {
      "w": np.zeros((n,), np.float32)})
  return {"w": np.asarray(tree["w"]).tolist()}


_OPS = {
    "env": _env,
    "control_files": lambda c: [p.name for p in
                                layout.control_files(c["dir"])],
    "read_json": lambda c: layout.read_json(c["path"]),
    "latest_module_version": lambda c: layout.latest_module_version(
        c["run"], c["slot"], c["expert"]),
    "is_committed": lambda c: atomic.is_committed(c["key"]),
    "repair_requests": lambda c: sorted(
        key.relative for _, key in repair.requests(c["run"])),
    "load_tree": _load_tree,
    "save_tree": lambda c: _save_tree(c["key"], c["value"], c.get("n", 4),
                                      c.get("barrier")),
}


def main() -> None:
  for line in sys.stdin:
    command = json.loads(line)
    if command["op"] == "quit":
      break
    try:
      answer = {"ok": _OPS[command["op"]](command)}
    except Exception as e:  # pylint: disable=broad-except
      answer = {"error": f"{type(e).__name__}: {e}"}
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
  main()
