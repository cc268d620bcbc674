"""Damage to a checkpoint item that a restore really reads (tests, chaos bench).

An OCDBT data file (`{item}/ocdbt.process_0/d/*`) is append-only: besides
the array chunks it holds the b-tree nodes of every intermediate commit of
the save, most of them superseded by the final manifest. In the tiny test
checkpoints about 40% of the data-file bytes are such garbage, and which
bytes they are depends on the timing of the async save. A bit flipped
there changes no stored value, so the restore is exact and the checkpoint
is intact: no verifier can (or should) report it. Damage meant to exercise
the verifier is therefore checked here against what the item's kvstore
actually returns, and moved elsewhere until it changes a value.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Callable

import tensorstore as ts

# A damage: edits one file and says what it did (or None when it cannot).
Damage = Callable[[Path, int], "str | None"]


def stored_values(item_dir: Path) -> dict[bytes, bytes | str]:
  """Every key of an item's OCDBT kvstore, with its value or read error."""
  try:
    kvstore = ts.KvStore.open(
        {"driver": "ocdbt", "base": f"file://{item_dir}/"}).result()
    keys = kvstore.list().result()
  except Exception as e:  # pylint: disable=broad-exception-caught
    return {b"": f"unopenable: {e}"}
  values = {}
  for key in keys:
    try:
      values[key] = kvstore.read(key).result().value
    except Exception as e:  # pylint: disable=broad-exception-caught
      values[key] = f"unreadable: {e}"
  return values


def data_files(item_dir: Path) -> list[Path]:
  """An item's OCDBT data files, largest first."""
  files = [p for p in item_dir.rglob("*") if p.is_file()
           and p.parent.name == "d"]
  return sorted(files, key=lambda p: (-p.stat().st_size, p.name))


def damage_that_matters(item_dir: Path, damage: Damage,
                        max_tries: int = 64) -> str:
  """Applies `damage` to the item's data files until a stored value changes
  (or can no longer be read); returns the description of the damage that
  did. Damage that changed nothing is undone before the next try."""
  before = stored_values(item_dir)
  tries = 0
  for path in data_files(item_dir):
    for attempt in range(8):
      original = path.read_bytes()
      what = damage(path, attempt)
      if what is None:
        break
      if stored_values(item_dir) != before:
        return what
      path.write_bytes(original)
      tries += 1
      if tries >= max_tries:
        break
  raise AssertionError(f"no damage changed a stored value of {item_dir}")


def _offset(size: int, attempt: int) -> int:
  """The middle, then spread over the file: 1/2, 1/4, 3/4, 1/8, ..."""
  fractions = [1 / 2, 1 / 4, 3 / 4, 1 / 8, 3 / 8, 5 / 8, 7 / 8, 1 / 16]
  return min(size - 1, int(size * fractions[attempt % len(fractions)]))


def flip_bit(path: Path, attempt: int = 0) -> str | None:
  data = bytearray(path.read_bytes())
  if not data:
    return None
  at = _offset(len(data), attempt)
  data[at] ^= 0x10
  path.write_bytes(bytes(data))
  return f"bit 4 of byte {at:,} flipped in {path.name}"


def truncate(path: Path, attempt: int = 0) -> str | None:
  """Cuts the file at its middle (then at 1/4, ...)."""
  size = path.stat().st_size
  if size < 2:
    return None
  at = _offset(size, attempt)
  os.truncate(path, at)
  return f"{path.name} truncated {size:,} -> {at:,} bytes"


def overwrite_64k(path: Path, attempt: int = 0, seed: int = 0
                  ) -> str | None:
  """64 KiB of random bytes around the middle (then around 1/4, ...)."""
  size = path.stat().st_size
  if not size:
    return None
  at = max(0, _offset(size, attempt) - 32768)
  junk = random.Random(seed + attempt).randbytes(min(65536, size - at))
  with open(path, "r+b") as f:
    f.seek(at)
    f.write(junk)
  return f"{len(junk):,} bytes at {at:,} overwritten in {path.name}"
