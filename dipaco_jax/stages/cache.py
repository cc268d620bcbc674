"""The workdir cache of stages: computed once on the writer, named by a hash
of everything they depend on, reused on the next run."""

import hashlib
import json

from etils import epath
import numpy as np

from dipaco_jax.data import shards as shards_lib
from dipaco_jax.parallel import multihost
from dipaco_jax.routing import router as router_lib
from dipaco_jax.store import atomic


def key(*parts) -> str:
  """A short hash of JSON-able parts and numpy arrays, for cache names."""
  h = hashlib.sha256()
  for part in parts:
    if isinstance(part, np.ndarray):
      h.update(np.ascontiguousarray(part).tobytes())
    else:
      h.update(json.dumps(part, sort_keys=True, default=str).encode())
    h.update(b"|")
  return h.hexdigest()[:16]


def cached_arrays(path, compute) -> dict:
  """`compute()` (a dict of arrays), saved at `path` and loaded from it when
  present; written atomically so a crash leaves no half."""
  path = epath.Path(path)

  def compute_or_load():
    if path.exists():
      with path.open("rb") as f:
        z = np.load(f)
        return {k: z[k] for k in z.files}
    arrays = compute()
    atomic.write_npz(path, **arrays)
    return arrays
  return multihost.first_on_writer(compute_or_load, f"arrays {path.name}")


def cached_router(path, fit):
  """The router (and its info dict) saved at `path`, or `fit()`'s, saved."""
  info_path = epath.Path(str(path).replace(".npz", ".json"))

  def fit_or_load():
    if path.exists() and info_path.exists():
      print(f"[router] reusing {path}", flush=True)
      return router_lib.Router.load(path), json.loads(info_path.read_text())
    router, info = fit()
    router.save(path)
    # Written last, so its presence says the router file is whole. Not
    # `write_json`: sorted keys would reorder the info in results.json.
    atomic.write_text(info_path, json.dumps(info))
    return router, info
  return multihost.first_on_writer(fit_or_load, f"router {path.name}")


def make_shards(workdir, name, docs, doc_indices_per_shard, hashes):
  """Writes (or reuses) a shard set; returns its directory and manifest.

  Reused only when the same documents go to the same shards: the hashes
  include the document indices, not just where they came from.
  """
  ids = hashlib.sha256()
  for shard in doc_indices_per_shard:
    ids.update(np.asarray(shard, np.int64).tobytes() + b"|")
  hashes = {**hashes, "documents": ids.hexdigest()[:16]}
  directory = epath.Path(workdir) / "shards" / name

  def write_or_reuse():
    manifest = shards_lib.read_manifest(str(directory))
    # Shards without "store" are copies of an older format: rewritten.
    if manifest is not None and manifest["hashes"] == hashes and (
        manifest["num_shards"] == len(doc_indices_per_shard)) and (
            "store" in manifest):
      return manifest
    return shards_lib.write_shards(str(directory), docs,
                                   doc_indices_per_shard, hashes)
  return directory, multihost.first_on_writer(write_or_reuse,
                                              f"shards {name}")
