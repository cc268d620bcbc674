"""Contributions on the wire: what island workers write for the executors
when `config.diloco.compression` is set (DiLoCoX, for real).

The SPMD runtime simulates compression inside its outer step
(`diloco/comm_step.py`). On islands a worker encodes each slot's
contribution with the slot's codec (`diloco/compress.py`, settings from
`diloco/comm.py`, per_slot included) and writes the trimmed payload (4-bit
and 2-bit codes packed, unused rank cut: the bytes that really cross the
link) where a float32 contribution would go. What a codec carries from
round to round (the error-feedback residual, the low rank's warm start)
stays with the worker's AdamW state, so a task moved to another worker
goes on exactly. The executor decodes each user's payload with
`Codec.decode_trimmed`, which is what the worker's encoder counted as sent
(and its residual assumed), and mixes those: a run equals the SPMD
simulation up to float rounding.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dipaco_jax.diloco import comm as comm_lib
from dipaco_jax.diloco import compress
from dipaco_jax.diloco import compress_apply
from dipaco_jax.islands import units as units_lib


@functools.partial(jax.jit, static_argnums=0)
def _encode_slot(codec, contribs_G, residuals, states):
  """Every leaf of one slot [G, ...], vmapped over the group: (payloads,
  residuals, states, bytes_G); residuals/states None where not carried."""
  leaves, treedef = jax.tree.flatten(contribs_G)
  none = [None] * len(leaves)
  res_in = none if residuals is None else treedef.flatten_up_to(residuals)
  st_in = none if states is None else treedef.flatten_up_to(states)
  outs = [jax.vmap(lambda x, r, s: compress_apply.compress_leaf(codec, x, r, s))(
      *args) for args in zip(leaves, res_in, st_in)]
  _, res_out, st_out, payloads, bytes_L = (list(c) for c in zip(*outs))
  return (treedef.unflatten(payloads),
          treedef.unflatten(res_out) if residuals is not None else None,
          treedef.unflatten(st_out) if states is not None else None,
          sum(bytes_L))


class Wire:
  """How a run's contributions go on the store, slot by slot."""

  def __init__(self, config, slots):
    comms = comm_lib.comm_by_slot(config, slots)
    # Uncompressed slots (float32, no feedback; delayed or not) are written
    # as before.
    self.codecs = {name: compress.make_codec(c.spec)
                   for name, c in comms.items()
                   if c.spec.name != "none" or c.spec.error_feedback}
    self._treedefs = {}  # Each compressed slot's module structure.

  @property
  def plain(self) -> bool:
    return not self.codecs

  def init_carry(self, contribs_G) -> dict:
    """What the codecs carry between rounds, for a group's contributions
    [G, ...] (arrays or shape structs): {slot: {"residual", "codec_state"}}
    for the slots that carry anything."""
    carry = {}
    for name, codec in self.codecs.items():
      slot = {}
      if codec.spec.error_feedback:
        slot["residual"] = compress_apply.init_residuals(contribs_G[name])
      if codec.stateful:
        slot["codec_state"] = compress_apply.init_states(codec, contribs_G[name])
      if slot:
        carry[name] = slot
    return carry

  def carry_like(self, module_like) -> dict:
    """One worker's carry as host restore targets (no group axis)."""
    like_G = {name: jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((1,) + tuple(x.shape), jnp.float32),
        module_like[name]) for name in self.codecs}
    carry = jax.eval_shape(self.init_carry, like_G)
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), carry)

  def encode(self, contribs_G: dict, carry: dict):
    """(payloads, carry, bytes_G): each compressed slot's payloads [G, ...]
    per leaf, the plain slots' contributions as they are, and each worker's
    bytes on the wire over all slots."""
    payloads, new_carry = {}, {}
    num = jax.tree.leaves(contribs_G)[0].shape[0]
    bytes_G = jnp.zeros((num,), jnp.float32)
    for name, contribs in contribs_G.items():
      if name not in self.codecs:
        payloads[name] = contribs
        bytes_G += 4 * sum(x.size // num for x in jax.tree.leaves(contribs))
        continue
      self._treedefs[name] = jax.tree.structure(contribs)
      slot = carry.get(name, {})
      payloads[name], residual, state, slot_bytes_G = _encode_slot(
          self.codecs[name], contribs, slot.get("residual"),
          slot.get("codec_state"))
      bytes_G += slot_bytes_G
      kept = {k: v for k, v in (("residual", residual),
                                ("codec_state", state)) if v is not None}
      if kept:
        new_carry[name] = kept
    return payloads, new_carry, bytes_G

  def encode_units(self, contribs_G: dict, carry: dict,
                   num_units: dict) -> tuple[dict, dict]:
    """`encode`, each compressed slot of `num_units[slot]` > 1 units
    (pipeline stages, `islands/units.py`) encoded stage by stage: its
    payloads keyed by unit key, so each unit's decodes alone (the stages'
    residuals carried as one). Plain slots pass as they are, keyed by
    slot. Only codecs that act on blocks of the flattened leaf that no
    stage boundary cuts give the numbers of encoding the whole slot
    (`launcher.check_config` refuses the others)."""
    split = [name for name in contribs_G
             if num_units.get(name, 1) > 1 and name in self.codecs]
    if not split:
      return self.encode(contribs_G, carry)[:2]
    whole = {n: c for n, c in contribs_G.items() if n not in split}
    payloads, new_carry, _ = self.encode(
        whole, {n: c for n, c in carry.items() if n in whole})
    for name in split:
      n, slot = num_units[name], carry.get(name, {})
      if "codec_state" in slot:
        raise ValueError(f"slot {name}: a stateful codec cannot be split "
                         "by pipeline stage")
      residuals = []
      for stage in range(n):
        # Leaves [G, layers, ...]: the stage's layers of every worker.
        share = lambda t, s=stage: jax.vmap(
            lambda x: units_lib.share(x, s, n))(t)
        slot_carry = ({name: {"residual": share(slot["residual"])}}
                      if "residual" in slot else {})
        unit_payloads, unit_carry, _ = self.encode(
            {name: share(contribs_G[name])}, slot_carry)
        payloads[units_lib.unit_key(name, stage, n)] = unit_payloads[name]
        if unit_carry:
          residuals.append(unit_carry[name]["residual"])
      if residuals:
        new_carry[name] = {"residual": jax.tree.map(
            lambda *x: jnp.concatenate(x, axis=1), *residuals)}
    return payloads, new_carry

  def to_wire(self, name: str, payloads_G, i: int):
    """Worker i's tree for slot `name` as written to the store (host):
    per leaf of the module, its trimmed payload."""
    if name not in self.codecs:
      return jax.tree.map(lambda x: np.asarray(x[i]), payloads_G)
    codec, treedef = self.codecs[name], self._treedefs[name]
    return treedef.unflatten([
        codec.trim({k: np.asarray(v[i]) for k, v in payload.items()})
        for payload in treedef.flatten_up_to(payloads_G)])

  def from_wire(self, name: str, stored, slot_like):
    """A stored payload tree of slot `name` back to float32 contributions
    shaped like `slot_like` (one worker's module)."""
    codec = self.codecs[name]
    treedef = jax.tree.structure(slot_like)
    trimmed = treedef.flatten_up_to(stored)
    return treedef.unflatten([
        codec.decode_trimmed({k: np.asarray(v) for k, v in t.items()},
                             like.shape)
        for t, like in zip(trimmed, jax.tree.leaves(slot_like))])
