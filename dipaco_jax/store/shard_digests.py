"""Digests of the parts of a state that one process holds, and their check.

With several processes no process holds a sharded array whole, and
gathering it to hash it would put the whole state on every host at every
save (about 0.5 TB at the paper's 16x16). So each process hashes only the
shards it holds the first replica of (`replica_id == 0`: every region is
hashed once across processes), one shard on the host at a time, and only
the digests are gathered. A digest is keyed by its region:

  "['inner']['w']"            the whole array (one process's copy, a
                              replicated array, or a single process's save)
  "['inner']['w']@0:64,0:512" rows 0-63, columns 0-511 of it

A reader checks each region it holds against the digest of that region: a
process restoring into the layout it was saved with checks every region it
holds, a single process (which holds every array whole) checks every
recorded region by slicing, and a region recorded in another layout that
this process does not hold as one shard is left unchecked and counted.
Memory a process adds: its digests (a few hundred bytes a shard) and, while
hashing, up to `_HASH_THREADS` shards on the host.
"""

import concurrent.futures
import re

import jax
import numpy as np

from dipaco_jax.store import integrity

_REGION = re.compile(r"^(?P<leaf>.*)@(?P<bounds>\d+:\d+(?:,\d+:\d+)*)$")
# Shards hashed at once: hashlib releases the GIL, and each shard's host
# copy is alive only while it is hashed.
_HASH_THREADS = 4


def region_key(leaf: str, index: tuple, shape: tuple) -> str:
  """The digest key of region `index` (a tuple of slices, as
  `Shard.index`) of the array at tree path `leaf` of `shape`."""
  bounds = [(s.start or 0, n if s.stop is None else s.stop)
            for s, n in zip(index, shape)]
  if all(lo == 0 and hi == n for (lo, hi), n in zip(bounds, shape)):
    return leaf
  return leaf + "@" + ",".join(f"{lo}:{hi}" for lo, hi in bounds)


def parse_key(key: str) -> tuple[str, tuple | None]:
  """(tree path, region as slices) of a digest key; None for the whole."""
  match = _REGION.match(key)
  if match is None:
    return key, None
  return match["leaf"], tuple(
      slice(int(lo), int(hi)) for lo, hi in
      (bound.split(":") for bound in match["bounds"].split(",")))


def _held_regions(name: str, leaf):
  """(key, a callable giving its host bytes) of every region of `leaf` (at
  tree path `name`) this process holds the first replica of."""
  if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
    for shard in leaf.addressable_shards:
      if shard.replica_id == 0:
        yield (region_key(name, shard.index, leaf.shape),
               lambda data=shard.data: np.asarray(data))
  elif jax.process_index() == 0:  # Whole on every process: hashed once.
    yield name, lambda: np.asarray(leaf)


def _leaves(tree):
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    yield jax.tree_util.keystr(path), leaf


def _hash_all(regions) -> dict[str, str]:
  with concurrent.futures.ThreadPoolExecutor(_HASH_THREADS) as pool:
    keys, futures = [], []
    for key, host_bytes in regions:
      keys.append(key)
      futures.append(pool.submit(lambda f=host_bytes: integrity.digest(f())))
    return {key: future.result() for key, future in zip(keys, futures)}


def held_digests(tree) -> dict[str, str]:
  """sha256 of every region of `tree` this process holds the first replica
  of (module doc); with one process, of every leaf whole."""
  return _hash_all(region for name, leaf in _leaves(tree)
                   for region in _held_regions(name, leaf))


def check(tree, want: dict[str, str]) -> tuple[str | None, int]:
  """Checks the regions of `tree` this process can against `want` (keys as
  `held_digests` makes them, from any layout). Returns (one line naming the
  leaves whose digests differ or that have none, or None; how many
  recorded regions this process could not check)."""
  recorded: dict[str, dict] = {}
  for key in want:
    leaf, region = parse_key(key)
    recorded.setdefault(leaf, {})[key] = region
  unchecked, bad, to_hash = 0, set(), []
  for name, leaf in _leaves(tree):
    regions = recorded.pop(name, None)
    if not regions:
      bad.add(name)  # A leaf its writer did not save.
    elif isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
      held = dict(_held_regions(name, leaf))
      to_hash += [(key, held[key]) for key in regions if key in held]
      unchecked += sum(key not in held for key in regions)
    else:  # Whole here: every recorded region is a slice of it.
      to_hash += [(key, lambda leaf=leaf, region=region: (
          np.asarray(leaf) if region is None else np.asarray(leaf)[region]))
                  for key, region in regions.items()]
  got = _hash_all(to_hash)
  bad |= {parse_key(key)[0] for key, value in got.items()
          if value != want[key]}
  bad |= set(recorded)  # Leaves saved that the reader's tree lacks.
  if not bad:
    return None, unchecked
  bad = sorted(bad)
  more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
  return f"digest mismatch in {', '.join(bad[:3])}{more}", unchecked
