"""What a stored array's bytes were when written, and how to tell damage.

Orbax does not notice a flipped bit in an array file, and a truncated or
deleted file fails deep inside tensorstore with a message that names a
chunk, not the key. So every writer here records the sha256 of each
array's bytes (keyed by its tree path, `jax.tree_util.keystr`), and every
reader recomputes them: the SPMD checkpoints in a sidecar file
(`train/checkpoint.py`), the store's keys in their commit marker
(`store/items.py`). A mismatch, or any failure to read a committed item,
is damage (`DamagedKeyError`), reported in one line naming the key.
"""

import hashlib
import re

from absl import logging
from etils import epath
import jax
import numpy as np

# How tensorstore's errors start ("DATA_LOSS: ...", "OUT_OF_RANGE: ...").
_STATUS_CODE = re.compile(r"[A-Z][A-Z_]+: ")


class DamagedKeyError(RuntimeError):
  """A committed key whose bytes are not what its writer committed (a
  digest differs, a file is missing or unreadable). `key` is its
  directory, `reason` one line saying what is wrong, `writer` the writer
  directory whose copy was read (`store/items.py`; None when the marker
  itself is unreadable, or the key predates writer directories)."""

  def __init__(self, key, reason: str, writer: str | None = None):
    super().__init__(f"{key} is damaged: {reason}")
    self.key, self.reason, self.writer = epath.Path(key), reason, writer


def digest(x) -> str:
  """sha256 of an array's raw bytes, viewed as uint8 so any dtype
  (bfloat16 too) hashes without a copy beyond making it contiguous."""
  return hashlib.sha256(
      np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint8)
  ).hexdigest()


def _scalar_digest(x) -> str:
  """sha256 of a scalar's value: orbax may give back a numpy scalar or
  a 0-d array of another width (an int32 as a Python int), the same
  number in other bytes."""
  return hashlib.sha256(repr(np.asarray(x).item()).encode()).hexdigest()


def tree_digests(tree, scalars_by_value: bool = False) -> dict[str, str]:
  """sha256 of each leaf's bytes (of a scalar's value, with
  `scalars_by_value`), keyed by its tree path."""
  return {jax.tree_util.keystr(path):
          _scalar_digest(leaf) if scalars_by_value and np.ndim(leaf) == 0
          else digest(leaf)
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def mismatches(got: dict, want: dict) -> str | None:
  """One line naming the leaves whose digests differ, or None."""
  bad = sorted(k for k in got.keys() | want.keys()
               if got.get(k) != want.get(k))
  if not bad:
    return None
  more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
  return f"digest mismatch in {', '.join(bad[:3])}{more}"


def first_line(e: Exception, limit: int = 300) -> str:
  """The first line of the most telling error of a chain: orbax wraps
  tensorstore's, which has a status code and names the file and what is
  wrong with it; otherwise the outermost."""
  chain = [e]
  while len(chain) < 10 and (chain[-1].__cause__ or chain[-1].__context__):
    chain.append(chain[-1].__cause__ or chain[-1].__context__)
  lines = [(type(c).__name__, (str(c).strip().splitlines() or [""])[0])
           for c in chain]
  coded = [l for l in lines if _STATUS_CODE.match(l[1])]
  name, line = (coded or lines)[0]
  line = f"{name}: {line}"
  return line if len(line) <= limit else line[:limit] + "..."


def move_aside(src, dst) -> epath.Path | None:
  """Renames `src` to `dst` (or `dst.1`, ... when taken) and returns where
  it went; deletes it (returning None) where a directory cannot be renamed
  (some object stores)."""
  src, dst = epath.Path(src), epath.Path(dst)
  dst.parent.mkdir(parents=True, exist_ok=True)
  target, n = dst, 0
  while target.exists():
    n += 1
    target = dst.parent / f"{dst.name}.{n}"
  try:
    src.rename(target)
    return target
  except OSError as e:
    logging.warning("Could not move %s aside (%s); deleting it.", src, e)
    if src.is_dir():
      src.rmtree()
    else:
      src.unlink()
    return None
