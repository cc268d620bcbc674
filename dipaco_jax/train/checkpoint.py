"""Checkpoints of the SPMD runtime: orbax `CheckpointManager`, verified on
read, with fallback to an older checkpoint.

A checkpoint holds the whole training state as separate orbax items, the
same parts the island runtime saves per worker and per module
(`train.state`): `inner` (every worker's parameters and AdamW state),
`outer` (the module bank and its per-slot outer optimizer state), and a JSON
`meta` item with the step and the hashes of the config, tokenizer, router
and shards it belongs to (DESIGN invariant 4). Restoring under different
hashes is an error, never a silent mix. Paths may be local or `gs://`
(etils.epath); orbax commits each step atomically.

Integrity. Orbax does not notice a flipped bit in an array file, and a
truncated or half-overwritten file fails deep inside tensorstore. So every
save also writes the sha256 of each saved array (keyed by its tree path,
`jax.tree_util.keystr`) and of the meta item, in a sidecar
`checkpoints/checksums/{step}.json`:

* The digests are keyed by array and region (`store/shard_digests.py`).
  A single process hashes the host copy of the state being saved, whole,
  on a background thread, so the async save stays async. With several
  processes each hashes only the shards it holds, one at a time, before
  the save returns, and only the digests are gathered: no process holds
  more of the state than its own shards, at a save or a restore (a
  restore checks each process's own regions, and all fall back alike). The sidecar is written
  by orbax's post-finalization callback: after every item of the step is
  on disk but BEFORE orbax commits the step (renames it to its final name /
  writes its commit marker). So a committed step always has its sidecar; a
  sidecar of a step that never committed is ignored and overwritten. This
  is why the sidecar lives beside the step directory (which does not exist
  under its final name yet when the callback runs) and not in `meta` (which
  would have to wait for the hashes before the save could start). Without
  async saves, it is written before the (blocking) orbax save.
* `restore_latest` tries the kept steps newest first. A step is damaged
  when orbax/tensorstore fails to read it (truncated or overwritten file,
  deleted metadata), when a recomputed digest differs, or when its sidecar
  is missing or unreadable (incomplete: it cannot be verified). Each damaged
  step is reported in one line, moved to `checkpoints/damaged/`, and the
  next older one is tried; a damaged state is never returned. A checkpoint
  of a different run (`CheckpointMismatchError`) is never a reason to fall
  back: it is raised at once.
"""

import concurrent.futures
import json

from absl import logging
from etils import epath
import jax
from jax.experimental import multihost_utils
import numpy as np
import orbax.checkpoint as ocp

from dipaco_jax.parallel import multihost
from dipaco_jax.store import atomic
from dipaco_jax.store import integrity
from dipaco_jax.train import checkpoint_digests as digests_lib

STATE_ITEMS = ("inner", "outer")
# Orbax's name for a step being written: `{step}.orbax-checkpoint-tmp...`.
_UNFINISHED_SUFFIX = ".orbax-checkpoint-tmp"
CHECKSUMS_DIR = "checksums"
# Unbounded, orbax reads every shard of an item before it places them on
# the devices: a process's share of the item on the host twice (measured
# with 2 processes on CPU: docs/reliability.md, "Checkpoints"). Bounded,
# the host holds this much more at most, whatever the state's size.
RESTORE_IN_FLIGHT_BYTES = 128 << 20
DAMAGED_DIR = "damaged"


class CheckpointMismatchError(RuntimeError):
  """The checkpoint belongs to another config, tokenizer or data."""


class CheckpointDamagedError(RuntimeError):
  """No kept checkpoint could be read back intact."""


class _Damaged(CheckpointDamagedError):
  """One step failed verification; `reason` says where and how. `kind` is
  "damaged", or "incomplete" when it has no checksums to verify it by."""

  def __init__(self, reason: str, kind: str = "damaged"):
    super().__init__(reason)
    self.reason, self.kind = reason, kind


class Checkpointer:
  """Periodic and final saves, resume from the newest intact one."""

  def __init__(self, directory: str, every: int, keep: int,
               async_save: bool = True):
    self.directory = atomic.absolute(directory)
    self.every = every
    self._async = async_save
    # (step, future of its digests) of the save orbax is finishing; read by
    # the post-finalization callback on orbax's thread.
    self._pending = None
    self._hasher = concurrent.futures.ThreadPoolExecutor(
        1, thread_name_prefix="ckpt-digests")
    # Orbax only accepts a post-finalization callback with async saves.
    # Its directories are created before the save returns: created in the
    # background (orbax's default), the step's temporary directory and its
    # items' are made by two unordered threads (the items' with their
    # parents), and the step's thread deletes a directory it finds already
    # there: a two-process CI run failed on that race (FileExistsError on
    # an item's directory, orbax 0.12.8).
    async_options = (ocp.AsyncOptions(
        post_finalization_callback=self._on_finalized,
        create_directories_asynchronously=False)
                     if async_save else None)
    # A save cut short (a kill past the preemption grace, a full disk)
    # leaves its step's temporary directory, as large as a checkpoint:
    # orbax removes them when asked, else each restart keeps one more.
    self._report_unfinished()
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=True, cleanup_tmp_directories=True,
        enable_async_checkpointing=async_save, async_options=async_options)
    self.manager = ocp.CheckpointManager(
        self.directory, options=options,
        item_names=STATE_ITEMS + ("meta",))

  def _report_unfinished(self) -> None:
    """One line for the saves cut short that orbax is about to remove."""
    if not multihost.is_writer() or not self.directory.exists():
      return
    unfinished = sorted((p.name.split(".")[0] for p in self.directory.iterdir()
                         if _UNFINISHED_SUFFIX in p.name), key=_step_order)
    if unfinished:
      _say(f"[ckpt] removing unfinished checkpoint(s) of step "
           f"{', '.join(unfinished)} (saves cut short) in {self.directory}")

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def should_save(self, step: int, last_step: int) -> bool:
    return step == last_step or (self.every > 0 and step % self.every == 0)

  # Saving.

  def save(self, step: int, state, meta: dict) -> None:
    # The previous save's callback reads `_pending`: let it finish first
    # (orbax's own save would wait for it anyway).
    self.manager.wait_until_finished()
    if not self.manager.should_save(step):
      return  # Orbax would skip it too; never rewrite a kept step's sums.
    meta = {**meta, "step": step}
    if jax.process_count() == 1:
      # Hashed on a thread (the save stays async) from the host copy that
      # orbax then saves: the state goes to the host once per save, not
      # twice (each copy held the training loop: docs/performance.md).
      source = jax.device_get({name: state[name] for name in STATE_ITEMS})
      digests = self._hasher.submit(digests_lib.of_host_items, source, meta)
    else:
      # Each process hashes the shards it holds, now (the training loop
      # may donate the buffers once this returns), and only the digests
      # are gathered; orbax saves each process's shards of the arrays.
      source = state
      digests = concurrent.futures.Future()
      digests.set_result(digests_lib.gathered(state, STATE_ITEMS, meta))
      if not multihost.is_writer():
        digests = None
    if self._async:
      self._pending = (step, digests)
    else:
      self._write_checksums(step, digests)
    items = {name: ocp.args.StandardSave(source[name])
             for name in STATE_ITEMS}
    self.manager.save(step, args=ocp.args.Composite(
        meta=ocp.args.JsonSave(meta), **items))
    if not self._async:
      self._prune_checksums()  # Orbax has deleted the oldest steps.

  def check_for_errors(self) -> None:
    """Raises a finished background save's error now (a full disk), not
    at the next save, which may be the run's last."""
    self.manager.check_for_errors()

  def _on_finalized(self) -> None:
    """Orbax's thread, once the pending step's items are written and before
    it is committed: its sidecar must exist before the step does."""
    if self._pending is None:
      return
    step, digests = self._pending
    self._pending = None
    self._write_checksums(step, digests)
    self._prune_checksums(keep={step})

  def _write_checksums(self, step: int, digests) -> None:
    if digests is not None:  # The writer's future.
      atomic.write_json(self._checksums_path(step), digests.result())

  def _prune_checksums(self, keep=frozenset()) -> None:
    """Drops the sidecars of steps orbax has deleted (max_to_keep)."""
    sums = self.directory / CHECKSUMS_DIR
    if not multihost.is_writer() or not sums.exists():
      return
    steps = {int(p.name) for p in self.directory.iterdir()
             if p.name.isdigit()}
    for path in sums.glob("*.json"):
      if path.stem.isdigit() and int(path.stem) not in steps | set(keep):
        path.unlink()

  def _checksums_path(self, step: int) -> epath.Path:
    return self.directory / CHECKSUMS_DIR / f"{step}.json"

  # Restoring.

  def restore_latest(self, abstract_state, expected_hashes: dict):
    """The newest intact checkpoint, as `(state, meta, step)`; None when
    there is none at all.

    Damaged steps are reported, moved to `checkpoints/damaged/` and skipped.
    Raises CheckpointMismatchError for a checkpoint of another run, and
    CheckpointDamagedError when every kept step is damaged.
    """
    damaged, skipped = [], []
    try:
      for step in sorted(self.manager.all_steps(), reverse=True):
        try:
          state, meta = self.restore(step, abstract_state, expected_hashes)
        except _Damaged as e:
          _say(f"[ckpt] checkpoint step {step} is {e.kind} ({e.reason}): "
               "falling back")
          damaged.append(step)
          skipped.append(f"step {step} {e.kind}")
          continue
        if damaged:
          _say(f"[ckpt] restored step {step} (newest intact; "
               f"{', '.join(skipped)})")
        return state, meta, step
    finally:
      self._set_aside(damaged)
    if not damaged:
      return None
    raise CheckpointDamagedError(
        f"No intact checkpoint in {self.directory} (damaged: step "
        f"{', '.join(map(str, damaged))}; moved to "
        f"{self.directory / DAMAGED_DIR}); delete {self.directory} or use a "
        "fresh --workdir to train from scratch.")

  def restore(self, step: int, abstract_state, expected_hashes: dict):
    """Restores `step` into the shardings of `abstract_state`, verified
    against its digests; raises CheckpointDamagedError when it is not
    intact."""
    where = self.directory / str(step)
    meta = self._read(step, "meta", ocp.args.JsonRestore(), where)
    sums = self._read_checksums(step)
    if sums is None:
      _say(f"[ckpt] step {step} in {self.directory} predates checksums "
           "(an older dipaco_jax): restored without verification")
    else:
      _check_digest(digests_lib.meta_digest(meta), sums.get("meta"),
                    f"meta: digest mismatch; file {where / 'meta'}")
    if "step" not in meta:
      raise CheckpointMismatchError(
          f"The checkpoint {where} has the state layout of an older "
          "dipaco_jax (one 'state' item); use a fresh --workdir.")
    check_hashes(meta.get("hashes", {}), expected_hashes, str(where))
    state = {}
    for name in STATE_ITEMS:
      state[name] = self._read(
          step, name, ocp.args.StandardRestore(abstract_state[name]), where,
          in_flight_gb=_in_flight_gb(abstract_state[name]))
      if sums is not None:
        _verify_item(name, state[name], sums.get(name, {}), where / name)
    state["step"] = jax.make_array_from_callback(
        (), abstract_state["step"].sharding,
        lambda _: np.asarray(meta["step"], np.int32))
    logging.info("Restored step %d from %s", step, self.directory)
    return state, meta

  def _read(self, step: int, name: str, args, where: epath.Path,
            in_flight_gb: float | None = None):
    """One item of `step`; any failure to read it means damage. Arrays are
    read with at most `in_flight_gb` of shards on the host at once."""
    try:
      if in_flight_gb is None:
        restored = self.manager.restore(
            step, args=ocp.args.Composite(**{name: args}))[name]
      else:
        # The item directly, by a handler with the bound (the manager's
        # handlers take theirs once, before any shape is known).
        with ocp.Checkpointer(ocp.StandardCheckpointHandler(
            restore_concurrent_gb=in_flight_gb)) as reader:
          restored = reader.restore(where / name, args=args)
      error = None
    except Exception as e:  # pylint: disable=broad-exception-caught
      # Orbax and tensorstore raise many types (ValueError, OSError,
      # KeyError, json errors...) for a truncated, overwritten or missing
      # file: all mean this step cannot be trusted.
      restored, error = None, (f"{name}: {integrity.first_line(e)}; in "
                               f"{where / name}")
    if not _all_agree(error is None):
      raise _Damaged(error or f"{name}: unreadable on another process")
    return restored

  def _read_checksums(self, step: int) -> dict | None:
    """The step's digests; None for a directory that never had any (made
    by a dipaco_jax before checksums), whose steps load unverified."""
    path = self._checksums_path(step)
    if not _all_agree(path.parent.exists()):
      return None
    try:
      sums, error = json.loads(path.read_text()), None
    except FileNotFoundError:
      # Orbax commits a step only after its sidecar is written: a missing
      # one was deleted, or predates checksums. It cannot be verified.
      sums, error = {}, f"no checksums file {path}"
    except Exception as e:  # pylint: disable=broad-exception-caught
      sums, error = {}, f"checksums: {integrity.first_line(e)}; file {path}"
    if error is None and not isinstance(sums, dict):
      error = f"checksums: not a JSON object; file {path}"
    if not _all_agree(error is None):
      raise _Damaged(error or "checksums unreadable on another process",
                     "incomplete" if error and error.startswith("no ")
                     else "damaged")
    return sums

  def _set_aside(self, steps) -> None:
    """Moves damaged steps (and their sidecars) to `damaged/`, so that the
    step list is sane and the same step can be saved again."""
    if not steps:
      return
    if multihost.is_writer():
      for step in steps:
        integrity.move_aside(self.directory / str(step),
                             self.directory / DAMAGED_DIR / str(step))
        sums = self._checksums_path(step)
        if sums.exists():
          integrity.move_aside(
              sums, self.directory / DAMAGED_DIR / f"{step}.json")
    multihost.barrier(f"ckpt set aside {steps}")
    self.manager.reload()  # Orbax caches its list of steps.

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()
    self._hasher.shutdown()
    self._prune_checksums()


# Digests.


def _in_flight_gb(abstract_tree) -> float:
  """Orbax's bound on the shard bytes one restore reads and places at once:
  `RESTORE_IN_FLIGHT_BYTES`, or the largest shard and 1 MiB (orbax refuses
  a shard as large as the bound; twice the largest, as before, let a
  process hold two at once: at a shard an eighth of the state, its share
  plus a quarter of the state). In GB, orbax's unit; a fraction is taken as
  it is (`restore_concurrent_gb * 10**9` bytes)."""
  largest = max((np.prod(x.sharding.shard_shape(x.shape), dtype=np.int64)
                 * np.dtype(x.dtype).itemsize
                 for x in jax.tree.leaves(abstract_tree)), default=0)
  return max(RESTORE_IN_FLIGHT_BYTES, int(largest) + (1 << 20)) / 1e9


def _check_digest(got, want, reason: str) -> None:
  if got != want:
    raise _Damaged(reason)


def _verify_item(name: str, tree, want: dict, where: epath.Path):
  """Checks the regions of `tree` this process holds; every process falls
  back alike."""
  bad = digests_lib.mismatch(tree, want, where)
  if not _all_agree(bad is None):
    raise _Damaged(f"{name}: {bad or 'digest mismatch on another process'}"
                   f"; file {where}")


# Helpers.


def _all_agree(ok: bool) -> bool:
  """Whether `ok` holds on every process: they must all fall back alike."""
  if jax.process_count() == 1:
    return ok
  return bool(np.all(multihost_utils.process_allgather(np.int32(ok))))


def _step_order(name: str):
  return (0, int(name), "") if name.isdigit() else (1, 0, name)


def _say(line: str) -> None:
  if multihost.is_writer():
    print(line, flush=True)


def check_hashes(found: dict, expected: dict, where: str) -> None:
  bad = {k: (found.get(k), v) for k, v in expected.items()
         if found.get(k) != v}
  if bad:
    lines = "\n".join(f"  {k}: checkpoint {f} != this run {e}"
                      for k, (f, e) in sorted(bad.items()))
    raise CheckpointMismatchError(
        f"The checkpoint {where} belongs to a different run:\n{lines}\n"
        "Use a fresh --workdir, or restore the config/data it was made with.")
