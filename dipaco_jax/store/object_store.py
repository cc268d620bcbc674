"""Object stores (`gs://`) as the store needs them: every read fresh, one
request a small file, and a create that exactly one writer wins.

Freshness. gcsfs caches each directory listing for the life of the
process, with no expiry, and answers `exists`, `info` and the size of a
read from whatever listing it holds: a process that listed
`control/heartbeat` never saw a heartbeat another process wrote after, read
a heartbeat that grew cut to its old size, and did not find a module
version committed since (`exists` answered from a listing two levels up).
`configure` turns that cache off for every gcsfs filesystem this process
makes: fsspec's configuration (`use_listings_cache=False` for `gs`/`gcs`),
set by the package at import (`dipaco_jax/__init__.py`), so no user has to
know an environment variable. Each `exists`, listing and read is then one
request answered by GCS itself, which is strongly consistent for reads after
writes, listings included.

It also sends etils' `gs://` paths through fsspec (gcsfs) where gcsfs is
installed, rather than `tf.io.gfile`, which etils picks whenever TensorFlow
is importable: training never imports TensorFlow (DESIGN.md, invariant 2),
and gfile has a stat cache of its own. A user who sets `EPATH_USE_TF`
keeps their choice.

Tensorstore (orbax's arrays) caches nothing across reads here: orbax opens
each array with a `cache_pool` of 0 bytes unless it uses OCDBT, which the
store does not (`store/items.py`); and no array path is ever rewritten, since
each writer writes under a directory of its own (`items.save_tree`).
`tests/test_gcs_processes.py` checks all of it across processes.

Atomic creation. `create` uploads with the precondition
`ifGenerationMatch=0` (GCS refuses it once the object exists), locally a
hard link of a complete temporary file (refused when the name exists).
"""

import importlib.util
import os
import sys
import uuid

from etils import epath

from dipaco_jax.errors import UserError

OBJECT_STORE_SCHEMES = ("gs://", "s3://")
_GCS_PROTOCOLS = ("gs", "gcs")


def is_object_store(path) -> bool:
  return str(path).startswith(OBJECT_STORE_SCHEMES)


def configure() -> None:
  """No listing cache for gcsfs, and gs:// through gcsfs (module doc).
  Idempotent; cheap when fsspec is not imported yet (it reads the
  configuration when it makes a filesystem)."""
  try:
    import fsspec.config  # pylint: disable=g-import-not-at-top
  except ImportError:  # No fsspec, no gs:// through etils.
    return
  for protocol in _GCS_PROTOCOLS:
    fsspec.config.conf.setdefault(protocol, {})["use_listings_cache"] = False
  if importlib.util.find_spec("gcsfs") is not None:
    os.environ.setdefault("EPATH_USE_TF", "0")
  forget_made_filesystems()


def forget_made_filesystems() -> None:
  """Drops the gcsfs filesystems made so far, and etils' cached handles and
  backend choices: the next `gs://` call makes them again from the current
  configuration and environment."""
  if "gcsfs" in sys.modules:
    import gcsfs  # pylint: disable=g-import-not-at-top
    import gcsfs.core  # pylint: disable=g-import-not-at-top
    for cls in {gcsfs.GCSFileSystem, gcsfs.core.GCSFileSystem}:
      cls.clear_instance_cache()
  if "etils.epath" in sys.modules:
    from etils.epath import backend  # pylint: disable=g-import-not-at-top
    from etils.epath import gpath  # pylint: disable=g-import-not-at-top
    for cached in (getattr(gpath, "_is_tf_installed", None),
                   getattr(gpath, "_is_zonal_gcs_bucket", None),
                   getattr(backend._FileSystemSpecBackend,  # pylint: disable=protected-access
                           "_get_filesystem", None)):
      if hasattr(cached, "cache_clear"):
        cached.cache_clear()


def _filesystem(path):
  """The fsspec filesystem of an object-store path, and the path in it."""
  import fsspec  # pylint: disable=g-import-not-at-top
  return fsspec.core.url_to_fs(str(path))


def check_fresh(path) -> None:
  """Raises UserError unless reads of `path` are answered by the store
  itself: on gs://, gcsfs installed and made without its listing cache
  (module doc). The island roles call it on their store at start."""
  if not str(path).startswith("gs://"):
    return
  if importlib.util.find_spec("gcsfs") is None:
    raise UserError(f"{path}: gs:// stores are read through gcsfs, which is "
                    "not installed: pip install -e '.[gcs]'")
  fs, _ = _filesystem(path)
  if getattr(fs.dircache, "use_listings_cache", False):
    raise UserError(
        f"{path}: gcsfs was set up with its listing cache on "
        "(use_listings_cache), so other processes' writes would go unseen: "
        "remove the setting from the fsspec configuration.")


def read_bytes(path) -> bytes:
  """The whole file: on an object store one request for the object's
  current bytes (never cut to a size learned earlier); raises
  FileNotFoundError when absent."""
  if is_object_store(path):
    fs, inner = _filesystem(path)
    return fs.cat_file(inner)
  return epath.Path(path).read_bytes()


def create(path, data: bytes, sync=None) -> bool:
  """Writes `data` at `path` if no file is there; True if this call made it,
  False if one existed (left as it was). Whole or absent for readers.
  `sync(fd)`, if given, runs on the local temporary file before it is
  linked (a durability policy's fsync)."""
  path = epath.Path(path)
  if is_object_store(path):
    fs, inner = _filesystem(path)
    try:
      fs.pipe_file(inner, data, mode="create")
    except FileExistsError:
      return False
    return True
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.parent / f".{path.name}.create-{os.getpid()}-{uuid.uuid4().hex}"
  with open(tmp, "wb") as f:
    f.write(data)
    if sync is not None:
      f.flush()
      sync(f.fileno())
  try:
    os.link(tmp, path)  # Atomic, and refused when `path` exists.
    return True
  except FileExistsError:
    return False
  finally:
    os.unlink(tmp)
