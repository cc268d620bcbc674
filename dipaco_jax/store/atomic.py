"""Files that are whole or absent: atomic writes and commit markers.

Two rules keep a killed process from leaving something a reader would take
for real:

* A small file (JSON, npz, a manifest) is written with `write_bytes` /
  `write_text` / `write_npz`: to a temporary name beside it, then renamed
  over the final name. A local rename is atomic. On `gs://` a rename is a copy
  and a delete, but a single object upload is already all-or-nothing, so the
  object is written under its final name directly.
* A directory of many files (an orbax item) is valid only once its commit
  marker exists, and the marker is written last (`commit`). Readers check
  `is_committed` and never read an uncommitted directory; renaming a
  directory is not atomic on GCS, so there is nothing to rename.

Those rules hold against a killed process: what it wrote sits in the
operating system's page cache, which outlives it. A crashed machine (power,
kernel) loses the page cache's unwritten part, and without a sync a commit
marker can reach the disk before the files it vouches for: a committed key
with missing data. `set_fsync(True)` adds the sync: a small file is synced
before its rename and its directory after; a directory of files
(`sync_tree`) is synced whole before its marker is written. The durability
policy (docs/reliability.md) says what each setting can lose. On `gs://` an
upload returns once the object is stored durably, so there is nothing to
sync and the setting changes nothing.

A commit marker is *created*, never replaced (`commit`): on `gs://` an
upload with the precondition `ifGenerationMatch=0`, locally a hard link of
a complete file, each refused once the marker exists
(`store/object_store.py`). Of writers racing on one key exactly one
commits, and no committed key ever stops being committed while they race.
Reads of small files (`read_commit`) are one request for the whole object,
never answered from a cached listing.
"""

import io
import json
import os
import uuid

from etils import epath
import numpy as np

from dipaco_jax.store import link
from dipaco_jax.store import object_store

COMMIT_MARKER = "COMMITTED.json"


def absolute(path) -> epath.Path:
  """`path` as an epath, a local one made absolute: orbax refuses a
  relative directory only once a save is under way ("Checkpoint path should
  be absolute"), so `--workdir=runs/x` failed at the first checkpoint. A
  remote path (gs://) is unchanged."""
  path = epath.Path(path)
  return path if "://" in str(path) else epath.Path(os.path.abspath(path))


_durability = {"fsync": False}


def set_fsync(on: bool) -> None:
  """Whether this process syncs local store writes to disk (above)."""
  _durability["fsync"] = bool(on)


def _syncs(path: epath.Path) -> bool:
  return _durability["fsync"] and not object_store.is_object_store(path)


def _sync(path) -> None:
  """fsync of a local file or directory."""
  fd = os.open(os.fspath(path), os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def sync_tree(directory, parents: int = 1) -> None:
  """With `set_fsync(True)`, syncs every file and directory under
  `directory`, then `directory` and its `parents` nearest parents (so the
  entries that lead to it are on disk too: a writer's directory inside its
  key takes 2); a no-op otherwise and on object stores."""
  directory = epath.Path(directory)
  if not _syncs(directory):
    return
  for root, dirs, files in os.walk(os.fspath(directory), topdown=False):
    for name in files:
      _sync(os.path.join(root, name))
    for name in dirs:
      _sync(os.path.join(root, name))
  _sync(directory)
  for parent in list(directory.parents)[:parents]:
    _sync(parent)


def _temporary(path: epath.Path) -> epath.Path:
  """A name of this write alone: two threads of one process writing the
  same file each rename their own (a name per process let one thread's
  rename take the other's file, and the other's rename then failed)."""
  return path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex}"


def write_bytes(path, data: bytes) -> None:
  """Writes `data` at `path` so that a reader sees all of it or none."""
  path = epath.Path(path)
  link.operation("write")
  path.parent.mkdir(parents=True, exist_ok=True)
  if object_store.is_object_store(path):
    path.write_bytes(data)
    return
  tmp = _temporary(path)
  with tmp.open("wb") as f:
    f.write(data)
    if _syncs(path):
      f.flush()
      os.fsync(f.fileno())
  tmp.replace(path)
  if _syncs(path):
    _sync(path.parent)


def write_text(path, text: str) -> None:
  write_bytes(path, text.encode("utf-8"))


def write_json(path, obj, indent: int | None = 1) -> None:
  write_text(path, json.dumps(obj, indent=indent, sort_keys=True))


def write_npz(path, **arrays: np.ndarray) -> None:
  """`np.savez` of `arrays`, written atomically.

  Locally it streams into the temporary file (token shards can be large);
  for an object store it is built in memory first, since a `savez` failing
  half-way into an open object would still upload what it had written.
  """
  path = epath.Path(path)
  if object_store.is_object_store(path):  # write_bytes counts the operation.
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    write_bytes(path, buffer.getvalue())
    return
  link.operation("write")
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = _temporary(path)
  with tmp.open("wb") as f:
    np.savez(f, **arrays)
    if _syncs(path):
      f.flush()
      os.fsync(f.fileno())
  tmp.replace(path)
  if _syncs(path):
    _sync(path.parent)


def commit(directory, meta: dict) -> bool:
  """Marks `directory` complete, unless it already is; call only after
  everything the marker vouches for is written (and, for orbax, finalized).
  True if this call committed it; False if another writer's marker was
  there first (left as it is: the first commit wins)."""
  marker = epath.Path(directory) / COMMIT_MARKER
  link.operation("write")
  data = json.dumps(meta, indent=1, sort_keys=True).encode("utf-8")
  sync = os.fsync if _syncs(marker) else None
  if object_store.create(marker, data, sync):
    if sync is not None:
      _sync(marker.parent)
    return True
  # A retried upload whose first try landed finds its own marker: a win.
  try:
    return read_commit(directory) == json.loads(data)
  except ValueError:  # Someone's damaged marker: not ours.
    return False


def uncommit(directory, only_if=None) -> bool:
  """Deletes `directory`'s commit marker, before anything else in it: from
  here on no reader takes the key for whole. With `only_if` (a predicate on
  the marker's metadata), only a marker it accepts is deleted: a reader
  setting aside the damaged copy it read leaves alone a marker that another
  writer has committed since. True if a marker was deleted."""
  marker = epath.Path(directory) / COMMIT_MARKER
  if only_if is not None:
    try:
      current = read_commit(directory)
    except ValueError:  # Unreadable: damaged whoever wrote it, so deleted.
      current = None
    else:
      if current is None or not only_if(current):
        return False
  link.operation("delete")
  try:
    marker.unlink()
  except FileNotFoundError:
    return False
  return True


def remove(directory) -> None:
  """Deletes a key: its commit marker first, so that no reader ever sees
  a committed key with missing files."""
  uncommit(directory)
  link.operation("delete")
  directory = epath.Path(directory)
  if directory.exists():
    directory.rmtree()


def is_committed(directory) -> bool:
  link.operation("exists")
  return (epath.Path(directory) / COMMIT_MARKER).exists()


def read_commit(directory) -> dict | None:
  """The commit marker's metadata, or None when not committed (one read:
  on an object store a check before the read would be a second request)."""
  link.operation("read")
  try:
    data = object_store.read_bytes(epath.Path(directory) / COMMIT_MARKER)
  except FileNotFoundError:
    return None
  return json.loads(data.decode("utf-8"))
