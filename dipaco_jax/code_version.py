"""Which code wrote a run: the package version and a hash of the sources
that shape its numbers.

An island store is worked on by processes started apart, on other machines
and at other times (`islands/`): one running other code would mix its
numbers into the run's without a word. So the launcher writes this into
the store's spec and every role that joins compares it with its own
(`layout.RunSpec.load`), refusing a mismatch in one line.

What is hashed: every Python source of the subpackages whose code decides
a number of the run (the model, the optimizers and codecs, the data, the
training step, the island roles and the store), by relative path and
bytes. The reports, plots, inference and command-line parts are left out:
a fix to a message must not orphan a running store.
"""

import functools
import hashlib
import importlib.metadata
import pathlib

_SHAPING = ("model", "diloco", "data", "train", "islands", "store",
            "parallel", "routing", "stages", "paths.py", "config_base.py",
            "config_fields.py")


def package_version() -> str:
  try:
    return importlib.metadata.version("dipaco_jax")
  except importlib.metadata.PackageNotFoundError:  # Run from a checkout.
    return "unknown"


@functools.lru_cache(maxsize=None)
def code_version() -> dict:
  """{"version": the package's, "sha256": of the number-shaping sources}."""
  root = pathlib.Path(__file__).parent
  files = []
  for name in _SHAPING:
    path = root / name
    files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
  h = hashlib.sha256()
  for path in files:
    h.update(str(path.relative_to(root)).encode() + b"\0")
    h.update(path.read_bytes() + b"\0")
  return {"version": package_version(), "sha256": h.hexdigest()[:16]}
