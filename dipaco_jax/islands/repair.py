"""Damaged island keys: set aside, rebuilt from what made them, or the run
stopped in one line.

Every read of a key is verified (`store/items.py`). A role that reads a
damaged key (`integrity.DamagedKeyError`) calls `report`: the key is set
aside under RUN/damaged/ (its marker first, so no reader takes it for
committed), a request RUN/control/repair/{key}.json names it, and the role
carries on with other work. Each kind of key is rebuilt by what made it,
run again, which writes the same bytes (every other key it writes is
already committed, and the first commit wins):

  modules, outer_state, download, published at version v >= 1
      the outer step of round v - 1 of that unit, by the executor that
      owns it (`Executor.rebuild`), from version v - 1 and round v - 1's
      contributions; after the run, by the launcher
  contrib of round r, worker w
      task (round r, w's group), re-queued by the coordinator
  inner (a worker's AdamW state) at step s
      task (round s / H - 1, the worker's group), re-queued likewise

To make that possible the coordinator keeps one round more than any task
needs (`Coordinator.collect_garbage`): the version before the newest, its
round's contributions and the AdamW states a re-run starts from. A key
whose inputs are gone anyway (version 0, which only the launcher writes;
or inputs damaged beyond that round) stops the run with one line naming
the key (`fail`), before anything reads it.
"""

import dataclasses
import time

from etils import epath

from dipaco_jax.islands import layout
from dipaco_jax.store import atomic
from dipaco_jax.store import integrity
from dipaco_jax.store import link

VERSION_KINDS = ("modules", "outer_state", "download", "published")


@dataclasses.dataclass(frozen=True)
class Key:
  """A key of the run's store, by what it holds (`islands/layout.py`)."""
  kind: str  # A VERSION_KINDS entry, "contrib" or "inner".
  relative: str  # Its path under RUN.
  unit: str = ""  # Version kinds and contrib: the unit's key.
  expert: int = -1
  version: int = -1
  round_index: int = -1  # contrib
  worker: int = -1  # contrib, inner
  step: int = -1  # inner


def parse(run, directory) -> Key:
  """What the key `directory` of the store `run` holds."""
  relative = str(epath.Path(directory).relative_to(epath.Path(run)))
  parts = relative.split("/")
  kind = parts[0]
  if kind in VERSION_KINDS:
    return Key(kind, relative, unit="/".join(parts[1:-2]),
               expert=int(parts[-2]), version=int(parts[-1][1:]))
  if kind == "contrib":
    return Key(kind, relative, unit="/".join(parts[3:]),
               round_index=int(parts[1][1:]), worker=int(parts[2]))
  if kind == "inner":
    return Key(kind, relative, worker=int(parts[1]), step=int(parts[2][1:]))
  raise ValueError(f"{relative}: not a key of an island store")


def _request_path(run, key: Key) -> epath.Path:
  return layout.control(run, "repair",
                        key.relative.replace("/", "__") + ".json")


def report(run, error: integrity.DamagedKeyError, role: str, log) -> Key:
  """Sets the damaged key aside and asks for it to be rebuilt; one line.

  Only the copy that was read is set aside (its writer's directory; the
  whole key when its marker was unreadable), and only while the marker
  still names it: a key another role has rebuilt since keeps its new
  marker, and no writer's files but the damaged copy's are touched."""
  key = parse(run, error.key)
  writer = error.writer
  # A damaged copy read without a writer (its marker unreadable, or a key
  # from before writer directories) is the key itself: uncommitted as is.
  atomic.uncommit(error.key, only_if=None if writer is None else
                  (lambda marker: marker.get("writer") == writer))
  if atomic.is_committed(error.key):
    log(f"damaged key {key.relative} ({error.reason}): already rebuilt")
    return key
  damaged = error.key / writer if writer else error.key
  link.operation("write")
  where = "set aside under damaged/"
  if damaged.exists() and integrity.move_aside(
      damaged, epath.Path(run) / "damaged" / key.relative
      / (writer or "")) is None:
    where = "deleted (not renamable here)"
  atomic.write_json(_request_path(run, key), {
      "key": key.relative, "reason": error.reason, "by": role,
      "time": time.time()})
  log(f"damaged key {key.relative} ({error.reason}): {where}, rebuilding "
      "it")
  return key


def is_requested(run, directory) -> bool:
  """Whether the key `directory` was set aside and awaits its rebuild."""
  try:
    key = parse(run, directory)
  except (ValueError, IndexError):
    return False
  link.operation("exists")
  return _request_path(run, key).exists()


def requests(run) -> list[tuple[epath.Path, Key]]:
  """The pending requests: (their file, the key)."""
  out = []
  for path in layout.control_files(layout.control(run, "repair")):
    request = layout.read_json(path)
    if request is not None:
      out.append((path, parse(run, epath.Path(run) / request["key"])))
  return out


def done(path) -> None:
  """The request at `path` is handled (rebuilt, or re-queued)."""
  link.operation("delete")
  epath.Path(path).unlink(missing_ok=True)


def fail(run, key: Key, why: str, role: str, log) -> None:
  """Stops the run: `key` cannot be rebuilt (`why`). The launcher reads
  control/failed/ and exits with this line; the request stays, for a
  relaunch (`on_relaunch`)."""
  path = layout.control(run, "failed", f"repair-{role}.json")
  if path.exists():  # Said once; the request stays for a relaunch.
    return
  line = (f"the island store's key {key.relative} is damaged and cannot be "
          f"rebuilt: {why}")
  atomic.write_json(path, {"worker": role, "error": line})
  log(f"error: {line}")


def rebuild_version(executor, key: Key, likes_of) -> str | None:
  """Remakes a damaged version of one of `executor`'s units (any of its
  kinds: the step commits every one, the intact ones unchanged) by its
  outer step run again (`executor.Executor.step`); returns why it cannot,
  or None once done."""
  module = next((m for m in executor.modules if executor.key(m) == key.unit
                 and m[1] == key.expert), None)
  if module is None:
    return NOT_MINE
  v, run = key.version, executor.run
  if v == 0:
    return ("version 0 is written by the launcher alone; run the same "
            "command again and it rewrites it from the seed")
  inputs = [layout.module_dir(run, key.unit, key.expert, v - 1),
            layout.outer_state_dir(run, key.unit, key.expert, v - 1)]
  inputs += [layout.contrib_dir(run, v - 1, int(w), key.unit)
             for w in layout.users_of(executor.stepper.assignment_WxS,
                                      module[0], key.expert)]
  gone = [p for p in inputs if not layout.committed(p)]
  if gone:
    return (f"version {v - 1} and round {v - 1}'s contributions make it, "
            f"and {epath.Path(gone[0]).relative_to(epath.Path(run))} is "
            "gone too; restart the run in a fresh --workdir")
  executor.step(module, v - 1, likes_of(module), hold=False)
  executor.log(f"rebuilt {key.relative}")
  return None


NOT_MINE = "another executor's unit"


def rebuild_versions(executor, likes_of, role: str) -> None:
  """Rebuilds the damaged versions of `executor`'s units that any role
  reported; an input found damaged on the way is reported in turn, and
  the version waits for it."""
  for path, key in requests(executor.run):
    if key.kind not in VERSION_KINDS:
      continue
    try:
      why = rebuild_version(executor, key, likes_of)
    except integrity.DamagedKeyError as e:
      report(executor.run, e, role, executor.log)
      continue
    if why == NOT_MINE:
      continue
    if why is not None:
      fail(executor.run, key, why, role, executor.log)
    else:
      done(path)


def on_relaunch(run) -> bool:
  """Clears what a refused repair left (its failure line, so a relaunch is
  not stopped by it again) and the requests for version 0; True when
  version 0 must be written again (the launcher does, from the seed)."""
  for path in layout.control_files(layout.control(run, "failed")):
    if path.name.startswith("repair-"):
      done(path)
  zero = [path for path, key in requests(run)
          if key.kind in VERSION_KINDS and key.version == 0]
  for path in zero:
    done(path)
  return bool(zero)
