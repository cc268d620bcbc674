"""A local Google Cloud Storage emulator for tests, and the client settings
that point this process's `gs://` code paths at it.

The emulator is `gcp-storage-emulator` (pure Python, from PyPI, in the `test`
extra), run in a subprocess on a free loopback port with in-memory storage.
It speaks the GCS JSON API, which is what the store's layers use:

* etils.epath -> fsspec -> gcsfs (honours `STORAGE_EMULATOR_HOST`),
* orbax -> tensorstore's `gcs` kvstore driver (honours
  `TENSORSTORE_GCS_HTTP_URL`; `GOOGLE_AUTH_TOKEN_FOR_TESTING` keeps it from
  looking for, and sending, real credentials).

Two client defaults cannot reach an emulator and are switched off inside
`clients_pointed_at`:

* with TensorFlow installed, etils.epath sends `gs://` through
  `tf.io.gfile`, whose GCS endpoints are compiled in
  (https://www.googleapis.com/storage/v1/); `EPATH_USE_TF=0` selects the
  fsspec backend instead;
* gcsfs's default filesystem class (`ExtendedGcsFileSystem`) first asks the
  gRPC Storage Control API for the bucket's layout, which a JSON-API emulator
  does not serve (each call then waits out a 60 s retry); the plain HTTP
  `gcsfs.core.GCSFileSystem`, what the extended class falls back to for an
  ordinary bucket, is registered for `gs`/`gcs` instead.

The emulator lacks two pieces of GCS that tensorstore's OCDBT manifest
updates depend on, so it is started through `testing/gcs_server.py`
(`python -m dipaco_jax.testing.gcs_server PORT`), which adds them before
serving:

* the `x-goog-generation` / `x-goog-metageneration` headers of a media read
  (tensorstore takes an object's generation from them; without them a
  re-read manifest gets generation 0 and the next conditional write fails
  with "Malformed StorageGeneration");
* the `ifGenerationMatch` / `ifGenerationNotMatch` preconditions of reads,
  uploads and deletes (412, or 304 for a read whose generation did not
  change), which OCDBT uses for its compare-and-swap of the manifest.

It also keeps a request log (`Emulator.requests`): one JSON line per request
the server answered, its time, method, path and query, so a test can count
a run's store operations as GCS would bill them, not as the client says.

These patches touch the emulator's internals, so its version is pinned in
setup.py; if its handlers change, the launcher fails at start, loudly.

Still missing, and unused by the store: listing by `startOffset` /
`endOffset` (the emulator ignores them and lists the whole bucket, so
tensorstore's `KvStore.list` and `delete_range`, which send only
those, would overreach here), and every gRPC API.

Usage:

  with gcs.running() as emulator:
    emulator.create_bucket("b")
    with gcs.clients_pointed_at(emulator):
      ...                    # gs://b/... lives in the emulator here
"""

import atexit
import contextlib
import dataclasses
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

from dipaco_jax.store import object_store

EMULATOR_MODULE = "gcp_storage_emulator"
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TESTING_TOKEN = "dipaco-gcs-emulator"  # Never a real credential.
_running: list["Emulator"] = []


def available() -> bool:
  """Whether the emulator package is installed."""
  return importlib.util.find_spec(EMULATOR_MODULE) is not None


@dataclasses.dataclass
class Emulator:
  """A running emulator: `url` is http://127.0.0.1:PORT."""
  url: str
  process: subprocess.Popen
  workdir: str

  def _request(self, method: str, path: str, body: dict | None = None,
               timeout: float = 10.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        self.url + path, data=data, method=method,
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
      text = response.read().decode()
    return json.loads(text) if text.strip() else {}

  def create_bucket(self, name: str) -> None:
    self._request("POST", "/storage/v1/b?project=test", {"name": name})

  def object_names(self, bucket: str, prefix: str = "") -> list[str]:
    """The names of the objects in `bucket` under `prefix`, asked of the
    emulator directly (not through any client under test)."""
    query = urllib.parse.urlencode({"prefix": prefix})
    listing = self._request("GET", f"/storage/v1/b/{bucket}/o?{query}")
    names = [item["name"] for item in listing.get("items", [])]
    # The emulator filters by prefix; check anyway, it is cheap.
    return sorted(n for n in names if n.startswith(prefix))

  @property
  def request_log(self) -> str:
    return os.path.join(self.workdir, REQUEST_LOG)

  def requests(self) -> list[dict]:
    """Every request answered so far: {"time", "method", "path", "query",
    "kind"} (`request_kind`), in order."""
    try:
      with open(self.request_log) as f:
        lines = f.read().splitlines()
    except FileNotFoundError:
      return []
    rows = []
    for line in lines:
      try:
        row = json.loads(line)
      except ValueError:  # A line being written.
        continue
      rows.append({**row, "kind": request_kind(row)})
    return rows

  def stop(self) -> None:
    """Ends the emulator process (and only it) and removes its workdir."""
    if self.process.poll() is None:
      self.process.terminate()
      try:
        self.process.wait(timeout=5)
      except subprocess.TimeoutExpired:
        self.process.kill()
        self.process.wait(timeout=5)
    shutil.rmtree(self.workdir, ignore_errors=True)
    if self in _running:
      _running.remove(self)


REQUEST_LOG = "requests.jsonl"


def request_kind(row: dict) -> str:
  """What a logged request did, in GCS's own terms: `read` (an object's
  bytes), `stat` (an object's or bucket's metadata), `list`, `write` (an
  upload), `delete`, or `other`."""
  method, path, query = row["method"], row["path"], row.get("query", {})
  if method == "DELETE":
    return "delete"
  if method in ("POST", "PUT") and (path.startswith("/upload/")
                                    or "uploadType" in query):
    return "write"
  if method == "GET":
    if path.startswith("/download/") or query.get("alt") == ["media"]:
      return "read"
    if path.rstrip("/").endswith("/o"):
      return "list"
    return "stat"
  return "other"


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _ready(url: str) -> bool:
  try:
    with urllib.request.urlopen(url + "/", timeout=1) as response:
      return response.read().strip() == b"OK"
  except (urllib.error.URLError, OSError):
    return False


def start(timeout: float = 30.0, attempts: int = 3) -> Emulator:
  """Starts an emulator; returns once it answers its health check.

  Raises RuntimeError if it does not within `timeout` seconds (it is then
  killed), or exits first (a port taken between choosing and binding it is
  retried on another port, `attempts` times in all).
  """
  if not available():
    raise RuntimeError(f"{EMULATOR_MODULE} is not installed (pip install "
                       "gcp-storage-emulator, or the package's test extra)")
  error = ""
  for _ in range(attempts):
    port = _free_port()
    workdir = tempfile.mkdtemp(prefix="gcs_emulator_")
    log_path = os.path.join(workdir, "emulator.log")
    with open(log_path, "wb") as log:
      process = subprocess.Popen(
          [sys.executable, "-m", "dipaco_jax.testing.gcs_server", str(port)],
          cwd=workdir, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
          env={**os.environ, "STORAGE_BASE": workdir,
               "PYTHONPATH": os.pathsep.join(
                   p for p in (_REPO_ROOT, os.environ.get("PYTHONPATH"))
                   if p)})
    emulator = Emulator(f"http://127.0.0.1:{port}", process, workdir)
    _running.append(emulator)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
      if _ready(emulator.url):
        return emulator
      time.sleep(0.1)
    exited = process.poll() is not None
    emulator.stop()  # Kills it if it is still starting.
    with contextlib.suppress(OSError):
      with open(log_path, "rb") as log:
        error = log.read()[-2000:].decode(errors="replace")
    if not exited:
      raise RuntimeError(f"GCS emulator not ready after {timeout} s:\n{error}")
  raise RuntimeError(f"GCS emulator exited at start ({attempts} tries):\n"
                     f"{error}")


@contextlib.contextmanager
def running(timeout: float = 30.0):
  """An emulator for the duration of the `with` block, always stopped."""
  emulator = start(timeout)
  try:
    yield emulator
  finally:
    emulator.stop()


@atexit.register
def _stop_leftovers() -> None:
  for emulator in list(_running):
    emulator.stop()


def client_env(emulator: Emulator) -> dict[str, str]:
  """Environment variables that send gcsfs and tensorstore to `emulator`."""
  return {
      "STORAGE_EMULATOR_HOST": emulator.url,        # gcsfs (and google-cloud-*)
      "TENSORSTORE_GCS_HTTP_URL": emulator.url,     # tensorstore's gcs driver
      "GOOGLE_AUTH_TOKEN_FOR_TESTING": _TESTING_TOKEN,  # tensorstore auth
      "TENSORSTORE_GCS_REQUEST_CONCURRENCY": "4",   # a one-thread server
      "EPATH_USE_TF": "0",                          # epath: fsspec, not gfile
      # For processes started with this environment (in this one
      # `clients_pointed_at` sets the same): anonymous gcsfs, and its plain
      # HTTP filesystem class (the module docstring).
      "FSSPEC_GCS_TOKEN": "anon",
      "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
  }


def reset_client_caches() -> None:
  """Forgets the cached clients and backend choices of etils and gcsfs, so
  the next `gs://` call reads the current environment."""
  object_store.forget_made_filesystems()


@contextlib.contextmanager
def clients_pointed_at(emulator: Emulator):
  """Sends this process's `gs://` traffic to `emulator` inside the `with`
  block only: the environment variables of `client_env`, anonymous gcsfs,
  the plain gcsfs filesystem class for gs:// (see the module docstring).
  On exit every one of them is put back as it was (a variable that was
  unset is unset again) and the client caches are dropped again."""
  import fsspec  # pylint: disable=g-import-not-at-top
  import fsspec.config  # pylint: disable=g-import-not-at-top
  import gcsfs.core  # pylint: disable=g-import-not-at-top
  with contextlib.ExitStack() as restore:
    restore.callback(reset_client_caches)  # Runs last.
    for name, value in client_env(emulator).items():
      restore.callback(_restore_env, name, os.environ.get(name))
      os.environ[name] = value
    conf = fsspec.config.conf
    restore.callback(_restore_item, conf, "gcs", conf.get("gcs"))
    conf["gcs"] = {**conf.get("gcs", {}), "token": "anon"}
    for protocol in ("gs", "gcs"):
      previous = fsspec.get_filesystem_class(protocol)
      restore.callback(fsspec.register_implementation, protocol, previous,
                       clobber=True)
      fsspec.register_implementation(protocol, gcsfs.core.GCSFileSystem,
                                     clobber=True)
    reset_client_caches()
    yield


def _restore_env(name: str, value: str | None) -> None:
  if value is None:
    os.environ.pop(name, None)
  else:
    os.environ[name] = value


def _restore_item(mapping: dict, key, value) -> None:
  if value is None:
    mapping.pop(key, None)
  else:
    mapping[key] = value
