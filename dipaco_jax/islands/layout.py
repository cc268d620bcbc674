"""The store of one island run: its keys, its spec, and byte accounting.

({slot} below is a *unit* key, `islands/units.py`: the slot's name, or
with pipeline stages, config.pipeline.stages = S > 1, `{slot}/stage{s}`
for each stage s of a layer slot, holding that stage's share of the
stacked layer leaves, so every key of such a slot is S keys of 1/S of its
bytes. The embedding/head slot, and every slot when S = 1, is one unit
named as its slot.)

  RUN/spec.json                          what every role needs (RunSpec)
  RUN/modules/{slot}/{e:05d}/v{n:06d}/   module parameters after n outer steps
  RUN/outer_state/{slot}/{e:05d}/v{n:06d}/  its outer optimizer state
  RUN/download/{slot}/{e:05d}/v{n:06d}/  with diloco.download_compression:
  RUN/published/{slot}/{e:05d}/v{n:06d}/ version n's change for the workers'
                                         copy, compressed, and the copy
                                         whole (`islands/downloads.py`)
  RUN/inner/{w:05d}/s{step:08d}/         worker w's AdamW state at `step`
  RUN/contrib/r{r:06d}/{w:05d}/{slot}/   worker w's contribution of round r,
                                         one key per unit (its executors read
                                         only their own unit)
  RUN/control/assign/{worker_id}.json    coordinator -> worker: the lease
  RUN/control/heartbeat/{worker_id}.json worker -> coordinator: alive, task
  RUN/control/coordinator.json           the coordinator's own heartbeat
  RUN/control/bytes/{role_id}.json       bytes a role wrote and read, per round
  RUN/control/stats/{role_id}.json       a worker's task phases, an executor's
                                         outer steps (`islands/timeline.py`)
  RUN/control/ops/{role}.json            a role's store operations by kind
  RUN/control/repair/{key, / as __}.json a damaged key to rebuild: any reader
                                         may write it (all write the same
                                         request), its rebuilder deletes it
  RUN/TRAINED.json                       the launcher's, once it read back the
                                         final modules
  RUN/DONE.json                          written by the coordinator last

Array keys are `store.items` trees behind commit markers: a committed key is
immutable and an uncommitted one is never read, so a role killed anywhere
loses at most its unfinished write, and re-running a task writes the same
bytes (the first commit wins, by a create-once marker:
`store/object_store.py`). Each control file has exactly one writer (the
role named in its file name; `spec.json` and `TRAINED.json` the launcher),
which matters on object stores (no atomic rename, no locks): a file's one
writer replaces it whole, so a reader sees its old or its new bytes.

Version n of a module is the one round n starts from; round r's outer step
turns version r into r + 1 from the users' round-r contributions. Its
optimizer state (and the workers' compressed copy) is committed before its
parameters, so committed parameters mean the whole version is there.
"""

import contextlib
import dataclasses
import json
import os
import sys
import threading
import time

from etils import epath
import ml_collections
import numpy as np

from dipaco_jax import code_version as code_lib
from dipaco_jax import paths as paths_lib
from dipaco_jax.errors import UserError
from dipaco_jax.store import atomic
from dipaco_jax.store import items
from dipaco_jax.store import keys
from dipaco_jax.store import link
from dipaco_jax.store import object_store
from dipaco_jax.train import preemption


def _version_key(run, kind: str, slot: str, expert: int,
                 version: int) -> epath.Path:
  """RUN/{kind}/{slot}/{expert:05d}/v{version:06d}/: one module version's
  item of that kind."""
  return (epath.Path(run) / kind / slot / f"{expert:05d}"
          / f"v{version:06d}")


def module_dir(run, slot: str, expert: int, version: int) -> epath.Path:
  return _version_key(run, "modules", slot, expert, version)


def outer_state_dir(run, slot: str, expert: int, version: int) -> epath.Path:
  return _version_key(run, "outer_state", slot, expert, version)


def download_dir(run, slot: str, expert: int, version: int) -> epath.Path:
  return _version_key(run, "download", slot, expert, version)


def published_dir(run, slot: str, expert: int, version: int) -> epath.Path:
  return _version_key(run, "published", slot, expert, version)


def inner_dir(run, worker: int, step: int) -> epath.Path:
  return keys.inner_dir(run, worker, step)


def contrib_dir(run, round_index: int, worker: int, slot: str
                ) -> epath.Path:
  return contrib_round_dir(run, round_index) / f"{worker:05d}" / slot


def contrib_round_dir(run, round_index: int) -> epath.Path:
  return epath.Path(run) / "contrib" / f"r{round_index:06d}"


def latest_module_version(run, slot: str, expert: int) -> int | None:
  """The newest committed version of a module (older ones may have been
  collected)."""
  parent = epath.Path(run) / "modules" / slot / f"{expert:05d}"
  link.operation("list")
  if not parent.exists():
    return None
  versions = [int(d.name[1:]) for d in parent.iterdir()
              if d.name[:1] == "v" and d.name[1:].isdigit()
              and atomic.is_committed(d)]
  return max(versions) if versions else None


def control(run, *parts: str) -> epath.Path:
  return epath.Path(run).joinpath("control", *parts)


def done_path(run) -> epath.Path:
  return epath.Path(run) / "DONE.json"


def is_done(run) -> bool:
  """Whether the run has finished (one store operation: the roles poll it)."""
  link.operation("exists")
  return done_path(run).exists()


def control_files(directory) -> list[epath.Path]:
  """The control files in `directory` (none if it is absent), without the
  temporary files of writes in progress (`.NAME.json.tmp-PID-UNIQUE`)."""
  directory = epath.Path(directory)
  link.operation("list")
  if not directory.exists():
    return []
  return sorted(p for p in directory.iterdir()
                if p.suffix == ".json" and not p.name.startswith("."))


def read_json(path) -> dict | None:
  """A control file, or None when absent (or caught mid-replace on a store
  without atomic rename)."""
  link.operation("read")
  try:
    return json.loads(object_store.read_bytes(path).decode("utf-8"))
  except (FileNotFoundError, ValueError):  # Absent, or not JSON (yet).
    return None


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """Everything a role needs to take part in a run, written once."""
  name: str
  config: dict  # The run's config (ConfigDict.to_dict, JSON-safe).
  vocab_size: int
  shard_dir: str
  data_seed: int
  hashes: dict  # What the run's numbers depend on (`Experiment.hashes`).
  weights_W: list  # The outer step's worker weights.
  paths_per_task: int  # Workers (paths x replicas) trained by one task.
  heartbeat_s: float = 1.0
  lease_timeout_s: float = 20.0
  # Delete keys no task or outer step can read again (the coordinator).
  collect_garbage: bool = True
  # An emulated link between islands (store/link.py); 0 = the disk's speed.
  link_mbps: float = 0.0
  link_latency_ms: float = 0.0
  # Commit the workers' inner (AdamW, codec carry) states every K rounds;
  # a task whose start state is not kept replays the rounds since the last
  # commit (`islands/replay.py`). 1 = every round.
  inner_state_every: int = 1
  # Sync the store's local writes to disk before each commit marker
  # (store/atomic.py): committed keys then survive a crashed machine.
  store_fsync: bool = False
  # The code that wrote the store (`code_version.code_version()`): every
  # role that joins must run the same. None: a store of an older
  # dipaco_jax, joined unchecked.
  code: dict | None = None

  def commits_inner(self, round_index: int) -> bool:
    """Whether a task of `round_index` commits its workers' inner states
    (at step (round_index + 1) H): every K rounds, never at the last round
    (no task starts from it: a finished run is not continued, the store
    refuses other settings)."""
    k = max(int(self.inner_state_every), 1)
    return (round_index + 1) % k == 0 and round_index + 1 < self.num_rounds

  def last_commit_round(self, round_index: int) -> int:
    """The round c <= `round_index` whose start state is committed (or,
    at 0, the fresh init) that a replay of `round_index` starts from."""
    k = max(int(self.inner_state_every), 1)
    return (round_index // k) * k

  def use_store(self) -> None:
    """Puts this process's store operations on the run's emulated link and
    durability."""
    link.set_link(self.link_mbps, self.link_latency_ms)
    atomic.set_fsync(self.store_fsync)

  def config_dict(self) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict(self.config)
    # JSON made the rules' tuples lists; the mesh rules want tuples.
    c.sharding_rules = tuple(
        (k, tuple(v) if isinstance(v, list) else v)
        for k, v in c.sharding_rules)
    return c

  @property
  def inner_steps(self) -> int:
    return int(self.config["diloco"]["inner_steps"])

  @property
  def num_rounds(self) -> int:
    return int(self.config["train"]["num_steps"]) // self.inner_steps

  def topology(self) -> paths_lib.Topology:
    return paths_lib.topology_from_config(self.config_dict())

  def groups(self) -> list[tuple[int, ...]]:
    """The workers each task trains: consecutive runs of `paths_per_task`."""
    num_workers = len(self.weights_W)
    size = self.paths_per_task
    return [tuple(range(start, min(start + size, num_workers)))
            for start in range(0, num_workers, size)]

  def save(self, run) -> None:
    object_store.check_fresh(run)
    atomic.write_json(epath.Path(run) / "spec.json",
                      dataclasses.asdict(self))

  @classmethod
  def load(cls, run, timeout_s: float = 600.0) -> "RunSpec":
    """The run's spec, waiting (bounded) for the launcher to write it;
    raises UserError when the store was written by other code."""
    object_store.check_fresh(run)
    path = epath.Path(run) / "spec.json"
    deadline = time.monotonic() + timeout_s
    while (spec := read_json(path)) is None:
      if time.monotonic() > deadline:
        raise UserError(f"{path} did not appear in {timeout_s:.0f} s: is "
                        "--store the run's directory (RUN/islands/NAME), "
                        "and is its launcher running?")
      time.sleep(0.2)
    spec = cls(**spec)
    check_code(spec.code, run)
    return spec


def check_code(code: dict | None, run) -> None:
  """Refuses a store written by other code than this process runs."""
  mine = code_lib.code_version()
  if code is not None and code != mine:
    raise UserError(
        f"the island store {run} was written by dipaco_jax {code['version']}"
        f" (code {code['sha256']}); this is {mine['version']} (code "
        f"{mine['sha256']}): join it with the same code, or start a fresh "
        "run")


@contextlib.contextmanager
def role_errors(role: str):
  """A role's command line: what the user must fix (`UserError`: a store
  written by other code, ...) is one line and status 2, no traceback; a
  preemption signal (SIGTERM, SIGINT) stops the role at once, one line and
  status 75: every committed key stays, and what it was doing is done
  again by whoever takes it up (the same bytes)."""
  with preemption.handle_signals():
    try:
      yield
    except UserError as e:
      print(f"[{role}] error: {e}", file=sys.stderr, flush=True)
      sys.exit(2)
    except preemption.Preempted as e:
      print(f"[{role}] {e.signal_name}: stopped; committed keys stay, its "
            "unfinished work is done again by whoever takes it up",
            file=sys.stderr, flush=True)
      sys.stdout.flush()
      # At once, as a kill would: nothing is left to save (the worker's
      # last beat is written), and the interpreter's teardown with JAX
      # took ~1.8 s a role.
      os._exit(preemption.EXIT_PREEMPTED)  # pylint: disable=protected-access


def config_to_json_dict(config) -> dict:
  return json.loads(config.to_json_best_effort())


def users_of(assignment_WxS: np.ndarray, slot_index: int, expert: int
             ) -> np.ndarray:
  """The workers that use expert `expert` of slot `slot_index`."""
  return np.flatnonzero(assignment_WxS[:, slot_index] == expert)


def directory_bytes(directory) -> int:
  """Bytes of the files under `directory` (what a read or write moved)."""
  return items.directory_bytes(directory)


def key_bytes(directory) -> int:
  """Bytes of a committed key: its item as its writer counted them (in the
  commit marker, so a reader lists no files: one operation, not one per
  file, on gs://) and the marker itself; a key written without the count
  is walked."""
  link.operation("read")
  data = object_store.read_bytes(epath.Path(directory) / atomic.COMMIT_MARKER)
  stored = json.loads(data.decode("utf-8")).get("stored_bytes")
  if stored is None:
    return directory_bytes(directory)
  return stored + len(data)


class ByteMeter:
  """Bytes a role wrote and read per round, kept in its control file.

  Measured from the store (the sizes of the keys moved, as their writers
  counted the files), not computed from shapes. A restarted role continues
  its predecessor's counts.
  """

  def __init__(self, run, role_id: str):
    self.path = control(run, "bytes", f"{role_id}.json")
    self.counts = read_json(self.path) or {"written": {}, "read": {}}
    # A delayed worker uploads from background threads.
    self._lock = threading.Lock()

  def add(self, kind: str, round_index: int, directory) -> None:
    key, size = str(round_index), key_bytes(directory)
    with self._lock:
      self.counts[kind][key] = self.counts[kind].get(key, 0) + size

  def flush(self) -> None:
    with self._lock:
      atomic.write_json(self.path, self.counts, indent=None)


def read_byte_counts(run) -> dict:
  """{role_id: {"written": {round: bytes}, "read": {...}}} of every role."""
  return {p.stem: read_json(p) or {}
          for p in control_files(control(run, "bytes"))}


def committed(directory) -> bool:
  return atomic.is_committed(directory)


# The shortest poll of a role on an object store: each poll there is one
# billed request or more, answered in 10-50 ms, where a local disk answers
# in microseconds. 5 polls a second adds at most 0.2 s to a wait of a round
# (minutes at the papers' H), and keeps a role's idle requests to tens a
# second, not hundreds (the coordinator's tick alone is ~14).
OBJECT_STORE_POLL_S = 0.2


def poll_interval(run, local_s: float) -> float:
  """A role's polling interval on the store `run`: `local_s` on a local
  disk, at least `OBJECT_STORE_POLL_S` on an object store."""
  if object_store.is_object_store(run):
    return max(local_s, OBJECT_STORE_POLL_S)
  return local_s


def wait_committed(keys, what: str, timeout_s: float, cancel=None,
                   poll_s: float = 0.01) -> bool:
  """Polls until every key of `keys` is committed (True), `cancel` (a
  threading.Event) is set (False), or `timeout_s` passes (TimeoutError
  naming `what`). A short poll on a local disk: a worker waits on it
  between rounds, where every millisecond is the device's (`poll_interval`
  on an object store). A key seen committed is not asked again."""
  deadline = time.monotonic() + timeout_s
  waiting = list(keys)
  if waiting:
    poll_s = poll_interval(waiting[0], poll_s)
  while True:
    waiting = [k for k in waiting if not committed(k)]
    if not waiting:
      return True
    if cancel is not None and cancel.is_set():
      return False
    if time.monotonic() > deadline:
      raise TimeoutError(f"waited {timeout_s:.0f} s for {what}")
    time.sleep(poll_s)
