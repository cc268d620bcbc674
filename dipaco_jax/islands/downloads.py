"""Compressed downloads on islands (`diloco.download_compression`), for real.

The rule is `diloco/download.py`'s: what workers start a round from is not
module version n (the global modules g, the model of record) but their
copy p of it, which takes each version's change compressed,

  p_n = p_{n-1} + C(g_n - p_{n-1}),   p_0 = g_0,

so what C dropped stays in g - p and goes with the next change. On the
store (`islands/layout.py`), an executor writes, with version n >= 1 of
each module and before its parameters (so committed parameters mean these
are there too):

  RUN/download/{slot}/{e}/v{n}/    C(g_n - p_{n-1}), trimmed: the bytes a
                                   worker that holds p_{n-1} reads
  RUN/published/{slot}/{e}/v{n}/   p_n in float32: what a worker that does
                                   not hold p_{n-1} (new, restarted, given
                                   another group's task) reads instead

A worker keeps the copy of each module it last read, up to a budget of
host memory (`--download_cache_mb` of the worker; the least recently used
copy goes first, and the module is then read whole once). Both sides make p_n
with `apply`, decoding on the host's CPU, so a worker's copy has the bits
of the executor's: a worker that read the change and one that read p_n
whole train from the same numbers. Pipeline stages (`islands/units.py`)
are refused with compressed downloads (`launcher.check_config`).
"""

import collections
import threading

import jax
import jax.numpy as jnp
import numpy as np

from dipaco_jax.diloco import comm as comm_lib
from dipaco_jax.diloco import compress
from dipaco_jax.diloco import compress_apply
from dipaco_jax.islands import layout
from dipaco_jax.store import items


class Downloads:
  """The download codec of each slot that has one, and a role's copies:
  {(slot, expert): (version, module tree on the host)}, the least recently
  used first; their bytes stay within `max_bytes` (None: no limit), except
  for the copy remembered last."""

  def __init__(self, config, slots, max_bytes: int | None = None):
    comms = comm_lib.comm_by_slot(config, slots)
    self.codecs = {name: compress.make_codec(c.download_spec)
                   for name, c in comms.items() if c.download != "none"}
    self.max_bytes = max_bytes
    self._copies = collections.OrderedDict()
    self._lock = threading.Lock()  # Overlap's prefetch reads in a thread.

  def compressed(self, slot: str) -> bool:
    return slot in self.codecs

  def publish(self, slot: str, params, copy, round_index: int):
    """(the change g - p compressed, trimmed for the store; the new copy
    p + C(g - p)): a module's next version, made from round
    `round_index`, on the host. A stateful download codec (strided) takes
    that round's state; the SPMD runtime counts its publishes instead."""
    codec = self.codecs[slot]
    with jax.default_device(jax.devices("cpu")[0]):
      state = codec.state_at_round(round_index) if codec.stateful else None
      trimmed = jax.tree.map(
          lambda g, p: codec.trim(jax.device_get(compress_apply.compress_leaf(
              codec, jnp.asarray(np.asarray(g, np.float32) - p), None,
              state)[3])), params, copy)
    return trimmed, self.apply(slot, copy, trimmed)

  def apply(self, slot: str, copy, trimmed):
    """p + the decoded change, in float32 on the host."""
    codec = self.codecs[slot]
    changes = jax.tree.structure(copy).flatten_up_to(trimmed)
    with jax.default_device(jax.devices("cpu")[0]):
      return jax.tree.unflatten(jax.tree.structure(copy), [
          (p + codec.decode_trimmed(t, p.shape)).astype(p.dtype)
          for p, t in zip(jax.tree.leaves(copy), changes)])

  def remember(self, slot: str, expert: int, version: int, copy) -> None:
    with self._lock:
      self._copies[(slot, expert)] = (version, copy)
      self._copies.move_to_end((slot, expert))
      if self.max_bytes is None:
        return
      held = sum(_nbytes(c) for _, c in self._copies.values())
      while held > self.max_bytes and len(self._copies) > 1:
        _, (_, evicted) = self._copies.popitem(last=False)
        held -= _nbytes(evicted)

  def held(self, slot: str, expert: int, version: int):
    """This role's copy of the module at `version`, or None."""
    with self._lock:
      kept = self._copies.get((slot, expert))
      if kept is not None:
        self._copies.move_to_end((slot, expert))
    return kept[1] if kept is not None and kept[0] == version else None

  def held_bytes(self) -> int:
    with self._lock:
      return sum(_nbytes(c) for _, c in self._copies.values())

  def forget(self) -> None:
    with self._lock:
      self._copies.clear()

  def copy_at(self, run, slot: str, expert: int, version: int, like,
              meter, round_index: int):
    """The workers' copy of module (slot, expert) at `version`: the one
    held at version - 1 plus the change read from the store, else read
    whole (version 0 is the module itself); remembered for the next."""
    held = self.held(slot, expert, version - 1) if version else None
    if held is None:
      return self.whole(run, slot, expert, version, like, meter, round_index)
    key = layout.download_dir(run, slot, expert, version)
    stored, _ = items.load_saved(key)
    meter.add("read", round_index, key)
    copy = self.apply(slot, held, stored)
    self.remember(slot, expert, version, copy)
    return copy

  def whole(self, run, slot: str, expert: int, version: int, like, meter,
            round_index: int):
    """The copy at `version` read whole (version 0: the module itself);
    remembered."""
    key = (layout.published_dir(run, slot, expert, version) if version
           else layout.module_dir(run, slot, expert, 0))
    copy, _ = items.load_tree(key, like)
    meter.add("read", round_index, key)
    copy = jax.tree.map(np.asarray, copy)
    self.remember(slot, expert, version, copy)
    return copy


def _nbytes(tree) -> int:
  return sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree))
