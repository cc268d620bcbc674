"""Per-module and per-worker checkpoints: orbax items behind commit markers.

Jobs exchange one module (slot s, expert e) at a time through a store, a
directory that is local or on `gs://`:

  ROOT/modules/{slot}/{expert:05d}/v{version:06d}/   one module at a version
  ROOT/inner/{worker:05d}/s{step:08d}/               one worker's inner state

(`store/keys.py` names them and finds their committed versions.) Each
such key directory holds

  {writer}/item/   an orbax PyTree checkpoint of the tree, under a directory
                   of its writer's own (`writer-{pid}-{random}`)
  COMMITTED.json   the commit marker (`atomic.commit`), created last and
                   once: {"writer": the directory readers read, "meta":
                   what the caller passed, "leaves": {keypath: shape},
                   "dtypes": {keypath: dtype}, "digests": {keypath: sha256
                   of the array's bytes}, "bytes": the arrays' size,
                   "stored_bytes": the size of the writer's files}

Readers read only committed keys: loading an uncommitted one raises
`NotCommittedError` and `committed_*` / `latest_*` skip it. Every read is
verified: a leaf whose bytes differ from its digest, or an item orbax
cannot read (a file missing, truncated or overwritten), raises
`integrity.DamagedKeyError` naming the key; what to do about it is the
caller's (the island roles rebuild it, `islands/repair.py`). Keys written
before digests existed load unverified; keys written before writer
directories (their item at `KEY/item`, no "writer" in the marker) load as
ever.

A committed key is immutable, and of writers racing on one key exactly one
commits (the marker's creation is atomic, `store/object_store.py`): each
writes under its own directory, so none ever deletes or overwrites what
another may be writing or has committed; a writer that finds the key
committed before it starts returns False at once, one that loses the race
at the marker removes its own directory and returns False. A writer killed
before its marker leaves its directory behind, never read; it goes with
the key (the island runtime's collector deletes whole keys once no one
reads them). A rebuilt key (`islands/repair.py`) is a new writer's
directory too, so no array path is ever written twice, and no cache keyed
by path (tensorstore's, a file system's) can answer for it.

`save_tree` / `load_tree` are the generic pair the others are built on (the
early-stopping snapshots use them directly). `module_of` / `put_module` and
`worker_of` / `put_worker` cut one module or one worker out of the full
training state and put it back, for the island and the SPMD runtimes alike.
"""

import inspect
import os
import uuid

from absl import logging
from etils import epath
import jax
import numpy as np
import orbax.checkpoint as ocp

from dipaco_jax.parallel import multihost
from dipaco_jax.store import atomic
from dipaco_jax.store import integrity
from dipaco_jax.store import link
from dipaco_jax.store import slicing

ITEM = "item"


class NotCommittedError(FileNotFoundError):
  """A key directory without a commit marker (missing or half-written);
  `key` is the directory."""

  def __init__(self, message: str, key=None):
    super().__init__(message)
    self.key = key


def _checkpointer(collective: bool) -> ocp.Checkpointer:
  """A synchronous orbax checkpointer: `save` returns once the item is
  finalized, so the commit marker can follow at once. Unless `collective`,
  only this process takes part (no barriers), which lets one process write
  host arrays while the others do something else."""
  if collective:
    options = ocp.options.MultiprocessingOptions()
  else:
    me = jax.process_index()
    options = ocp.options.MultiprocessingOptions(
        primary_host=me, active_processes={me},
        barrier_sync_key_prefix=f"store_p{me}")
  # Without OCDBT: one small key is written more than twice as fast as
  # through OCDBT's database (measured: docs/islands.md, the store);
  # OCDBT pays off for checkpoints of many arrays, not for one module.
  # Without zstd: float32 parameters and contributions shrink by ~7% under
  # it, for several times the CPU time of the write and the read (measured,
  # same section); a module's bytes are cut by diloco/compress.py instead.
  # Restoring reads every format.
  return ocp.Checkpointer(
      ocp.PyTreeCheckpointHandler(multiprocessing_options=options,
                                  use_ocdbt=False, **_NO_ZSTD),
      multiprocessing_options=options)


# `use_compression` is in orbax-checkpoint 0.11+; older ones always zstd.
_NO_ZSTD = ({"use_compression": False} if "use_compression" in
            inspect.signature(ocp.PyTreeCheckpointHandler).parameters else {})


# Arrays are written in chunks of at most this many bytes, one file (or
# object) each: tensorstore reads and writes the chunks of an array in
# parallel, where one file per array is copied by one thread (reads went
# from 0.55 to 1.48 of dd's page-cache read on an H100 host;
# docs/islands.md, the store). Small arrays stay one chunk.
CHUNK_BYTES = 8 << 20


def _chunked(_) -> ocp.SaveArgs:
  return ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES)


def _shapes(tree) -> dict[str, list[int]]:
  return {jax.tree_util.keystr(k): [int(d) for d in np.shape(x)]
          for k, x in jax.tree_util.tree_leaves_with_path(tree)}


def _check_like(directory, like, saved: dict) -> None:
  """Names every leaf that differs from the saved tree, before orbax runs."""
  want = _shapes(like)
  problems = [f"{k}: missing from the checkpoint" for k in want
              if k not in saved]
  problems += [f"{k}: in the checkpoint but not in the target" for k in saved
               if k not in want]
  problems += [f"{k}: saved shape {saved[k]}, target {want[k]}"
               for k in want if k in saved and saved[k] != want[k]]
  if problems:
    raise ValueError(f"{directory} does not match the restore target:\n  "
                     + "\n  ".join(problems[:10]))


def _dtypes(tree) -> dict[str, str]:
  return {jax.tree_util.keystr(k): np.dtype(x.dtype).name
          for k, x in jax.tree_util.tree_leaves_with_path(tree)}


def _restore_arg(leaf, saved_dtype: str | None = None):
  """Placed like the target: a leaf with a sharding (a jax.Array, or a
  ShapeDtypeStruct given one) comes back as a jax.Array with that sharding;
  anything else as a host numpy array. Never the writer's own sharding: the
  writer may be another job on other devices. In `saved_dtype` when given
  (to verify the saved bytes; the caller casts after), else the target's."""
  dtype = leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype
  dtype = saved_dtype or dtype
  sharding = getattr(leaf, "sharding", None)
  if sharding is not None:
    return ocp.ArrayRestoreArgs(sharding=sharding, global_shape=leaf.shape,
                                dtype=dtype)
  return ocp.RestoreArgs(restore_type=np.ndarray, dtype=dtype)


def _writer_name(collective: bool) -> str:
  """A directory name of this write alone (every process of a collective
  save takes process 0's)."""
  token_4 = np.frombuffer(uuid.uuid4().bytes, np.uint32)
  if collective and jax.process_count() > 1:
    token_4 = multihost.from_writer(token_4)
  return f"writer-{os.getpid()}-{token_4.astype(np.uint32).tobytes().hex()[:16]}"


def item_dir(directory, marker: dict | None = None) -> epath.Path:
  """Where the committed item of key `directory` is: under the writer its
  marker names (`marker`, or read here), or, for a key written before
  writer directories, `KEY/item`."""
  directory = epath.Path(directory)
  if marker is None:
    marker = _marker(directory)
  writer = marker.get("writer")
  return (directory / writer / ITEM) if writer else directory / ITEM


def save_tree(directory, tree, meta: dict | None = None, *,
              collective: bool = False) -> bool:
  """Saves `tree` as the orbax item of `directory`, then commits it.

  Args:
    directory: the key directory (local or gs://).
    tree: a pytree of arrays. Unless `collective`, every array must be
      addressable by this process (host arrays, or jax arrays on its devices).
    meta: JSON-serializable metadata kept in the commit marker.
    collective: every process calls this (orbax's usual multi-process save of
      globally sharded arrays); process 0 writes the marker.

  Returns:
    True if this call committed it; False if `directory` was committed
    already, or by another writer first (the key is then unchanged, and
    this call's own files are gone).
  """
  directory = atomic.absolute(directory)
  if atomic.is_committed(directory):
    logging.info("%s is already committed; not saving it again.", directory)
    return False
  if not collective:
    bad = [jax.tree_util.keystr(k) for k, x in
           jax.tree_util.tree_leaves_with_path(tree)
           if isinstance(x, jax.Array) and not x.is_fully_addressable]
    if bad:
      raise ValueError(f"Leaves {bad[:5]} span other processes: gather them "
                       "to the host first or pass collective=True.")
  writes = not collective or multihost.is_writer()
  writer = _writer_name(collective)
  # Hashed from the host copy before the write: what the writer meant,
  # whatever the disk then does with it.
  digests = (integrity.tree_digests(jax.device_get(tree), True) if writes
             else None)
  with link.transfer(_nbytes(tree), "put"), _checkpointer(collective) as (
      checkpointer):
    checkpointer.save(directory / writer / ITEM, args=ocp.args.PyTreeSave(
        tree, save_args=jax.tree.map(_chunked, tree)))
  won = writes  # Every other process of a collective save learns it below.
  if writes:
    # With set_fsync: the data, and the key's own entry, before the marker.
    atomic.sync_tree(directory / writer, parents=2)
    won = atomic.commit(directory, {
        "writer": writer, "meta": meta or {}, "leaves": _shapes(tree),
        "dtypes": _dtypes(tree), "digests": digests,
        "bytes": _nbytes(tree),
        "stored_bytes": directory_bytes(directory / writer)})
    if not won:
      logging.info("%s was committed by another writer first; removing "
                   "this writer's copy (%s).", directory, writer)
      link.operation("delete")
      (directory / writer).rmtree()
  if collective:
    # No process returns before the marker exists.
    multihost.barrier(f"store_commit:{directory}")
    won = multihost.any_process(won)
  return won


def _marker(directory) -> dict:
  try:
    marker = atomic.read_commit(directory)
  except (ValueError, UnicodeDecodeError) as e:  # Not JSON any more.
    raise integrity.DamagedKeyError(
        directory, f"{atomic.COMMIT_MARKER} unreadable "
        f"({integrity.first_line(e)})") from None
  if marker is None:
    raise NotCommittedError(
        f"{directory} is not committed (no {atomic.COMMIT_MARKER}): its "
        "writer has not finished or was killed; it is never read.",
        epath.Path(directory))
  return marker


def read_meta(directory) -> dict:
  """The caller's metadata of a committed key directory."""
  return _marker(directory)["meta"]


def load_tree(directory, like):
  """Restores the committed item of `directory` as `(tree, meta)`.

  Args:
    directory: a key directory written by `save_tree`.
    like: the target tree (same structure and shapes as saved); leaves are
      arrays or `jax.ShapeDtypeStruct`s. Leaves with a sharding come back as
      jax arrays placed on it, the others as numpy arrays; dtypes are cast to
      the target's.

  Returns:
    The tree, shaped like `like`, and the metadata passed to `save_tree`.

  Raises:
    NotCommittedError: `directory` is not committed.
    integrity.DamagedKeyError: its bytes are not what was committed.
  """
  directory = atomic.absolute(directory)
  marker = _marker(directory)
  _check_like(directory, like, marker["leaves"])
  saved = marker.get("dtypes", {}) if marker.get("digests") else {}
  args = jax.tree_util.tree_map_with_path(
      lambda k, leaf: _restore_arg(leaf, saved.get(jax.tree_util.keystr(k))),
      like)
  with link.transfer(_nbytes(like), "get"):
    tree = _restore(directory, marker, ocp.args.PyTreeRestore(
        item=like, restore_args=args))
  _verify(directory, tree, marker)
  if saved:  # Read as saved to verify the bytes; now as the target asks.
    tree = jax.tree.map(lambda x, want: x if x.dtype == want.dtype
                        else x.astype(want.dtype), tree, like)
  return tree, marker["meta"]


def load_saved(directory):
  """Restores the committed item of `directory` as it was saved: numpy
  arrays of the writer's shapes and dtypes, as `(tree, meta)`. For trees a
  reader cannot shape in advance (compressed payloads, whose low rank
  varies by round). Verified as `load_tree`."""
  directory = atomic.absolute(directory)
  marker = _marker(directory)
  with link.transfer(marker.get("bytes", 0), "get"):
    tree = _restore(directory, marker, None)
  _verify(directory, tree, marker)
  return tree, marker["meta"]


def _restore(directory: epath.Path, marker: dict, args):
  """Orbax's restore of the key's item; any failure of a committed item
  to read is damage (orbax and tensorstore raise many types, ValueError,
  OSError, KeyError..., for a missing, truncated or overwritten file)."""
  item = item_dir(directory, marker)
  try:
    with _checkpointer(collective=False) as checkpointer:
      if args is None:
        return checkpointer.restore(item)
      return checkpointer.restore(item, args=args)
  except Exception as e:  # pylint: disable=broad-exception-caught
    raise integrity.DamagedKeyError(
        directory, f"unreadable ({integrity.first_line(e)})",
        marker.get("writer")) from e


def _verify(directory: epath.Path, tree, marker: dict) -> None:
  want = marker.get("digests")
  if not want:
    return  # Written before digests: nothing to check against.
  bad = integrity.mismatches(
      integrity.tree_digests(jax.device_get(tree), True), want)
  if bad:
    raise integrity.DamagedKeyError(directory, bad, marker.get("writer"))


def directory_bytes(directory) -> int:
  """Bytes of the files under `directory`."""
  total = 0
  for path in epath.Path(directory).iterdir():
    total += directory_bytes(path) if path.is_dir() else path.stat().length
  return total


def _nbytes(tree) -> int:
  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(tree))


# Cutting one module or one worker out of the training state
# (`store/slicing.py`), here for the callers that know them as `items.*`.
module_of = slicing.module_of
put_module = slicing.put_module
worker_of = slicing.worker_of
put_worker = slicing.put_worker
