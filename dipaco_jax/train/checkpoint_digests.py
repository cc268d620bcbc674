"""What a checkpoint's checksums sidecar holds (`train/checkpoint.py`): the
sha256 of every saved array, keyed by its region (`store/shard_digests.py`),
and of the `meta` item.

One process hashes its host copy of the state whole; several each hash the
shards they hold and gather only the digests, so no host holds more of the
state than its own shards.
"""

import hashlib
import json

from absl import logging
import jax

from dipaco_jax.parallel import multihost
from dipaco_jax.store import shard_digests


def meta_digest(meta: dict) -> str:
  return hashlib.sha256(
      json.dumps(meta, sort_keys=True).encode("utf-8")).hexdigest()


def of_host_items(host_items: dict, meta: dict) -> dict:
  """The sidecar of one process's save: `host_items` (name: host tree)."""
  sums = {name: shard_digests.held_digests(tree)
          for name, tree in host_items.items()}
  sums["meta"] = meta_digest(meta)
  return sums


def gathered(state, item_names, meta: dict) -> dict:
  """The sidecar of a save by several processes, on every process: each
  hashes the shards of `state`'s items it holds (a collective)."""
  parts = multihost.all_gather_json(
      {name: shard_digests.held_digests(state[name]) for name in item_names})
  sums = {name: {k: v for part in parts for k, v in part[name].items()}
          for name in item_names}
  sums["meta"] = meta_digest(meta)
  return sums


def mismatch(tree, want: dict, where) -> str | None:
  """One line naming the leaves of `tree` whose regions held here differ
  from `want` (or None); logs the saved regions this process could not
  check (the state laid out otherwise than when saved)."""
  bad, unchecked = shard_digests.check(tree, want)
  if unchecked:
    logging.warning("%s: %d saved regions not checked on process %d (the "
                    "state is laid out otherwise than when saved)", where,
                    unchecked, jax.process_index())
  return bad
