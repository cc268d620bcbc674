"""How each module's outer step communicates: its delay and its compressor.

`config.diloco.delay` and `config.diloco.compression` (with its knobs) set
every slot; `config.diloco.per_slot` overrides them for some slots, so a
module shared by many paths and a path-private one can differ:

  per_slot = "shared=compression:int8;layers_02_03=delay:none+compression:none"

A selector is a slot's name or its kind (shared | level | private); a slot
takes the settings of its name, else of its kind, else the defaults. Keys:
delay, compression, error_feedback, error_feedback_decay, sparse_aggregate,
and the compression_* knobs without their prefix (block_size, rank_min,
rank_max, energy, factor_bits, topk_fraction, topk_chunk, stride,
index_code).
"""

import dataclasses

from dipaco_jax import config_fields
from dipaco_jax import paths as paths_lib
from dipaco_jax.diloco import compress
from dipaco_jax.errors import UserError

DELAYS = ("none", "one_round", "naive", "lookahead", "eager", "overlap")
AGGREGATES = ("mean", "senders")  # outer.mix


@dataclasses.dataclass(frozen=True)
class SlotComm:
  """One slot's communication: how late its outer step is applied and how
  its workers' contributions are compressed."""
  delay: str = "none"
  spec: compress.CompressionSpec = compress.CompressionSpec()
  # What the workers read back (`diloco.download_compression`): the codec
  # of each module's change since the workers' copy; "none" = the new
  # version itself.
  download: str = "none"
  # The top-k download's share of entries (`diloco.download_topk_fraction`);
  # 0 = the upload's.
  download_topk_fraction: float = 0.0

  @property
  def plain(self) -> bool:
    """Today's DiLoCo step: nothing delayed, nothing compressed."""
    return (self.delay == "none" and self.spec.name == "none"
            and not self.spec.error_feedback and self.download == "none")

  @property
  def download_spec(self) -> compress.CompressionSpec:
    """The download codec's spec, with the slot's block size, top-k chunk
    and stride (a per_slot `block_size`, `topk_chunk` or `stride` sets
    both directions'), and its own top-k share, else the upload's. No
    error feedback: what it drops stays in g - p."""
    return compress.CompressionSpec(
        name=self.download, block_size=self.spec.block_size,
        topk_fraction=self.download_topk_fraction or self.spec.topk_fraction,
        topk_chunk=self.spec.topk_chunk, stride=self.spec.stride,
        index_code=self.spec.index_code)

  @property
  def delayed(self) -> bool:
    return self.delay != "none"


_SPEC_KEYS = {"compression": "name", "error_feedback": "error_feedback",
              "block_size": "block_size", "rank_min": "rank_min",
              "rank_max": "rank_max", "energy": "energy",
              "factor_bits": "factor_bits",
              "topk_fraction": "topk_fraction", "topk_chunk": "topk_chunk",
              "stride": "stride", "index_code": "index_code",
              "error_feedback_decay": "feedback_decay",
              "sparse_aggregate": "aggregate"}


def _parse_value(field: str, raw: str):
  kind = type(getattr(compress.CompressionSpec(), field))
  if kind is bool:
    if raw.lower() not in ("true", "false", "1", "0"):
      raise ValueError(f"{raw!r} is not a bool")
    return raw.lower() in ("true", "1")
  return kind(raw)


def _default(config) -> SlotComm:
  d = config.diloco
  return SlotComm(d.delay, compress.spec_from_config(d),
                  getattr(d, "download_compression", "none"),
                  float(getattr(d, "download_topk_fraction", 0.0)))


def _override(base: SlotComm, text: str, selector: str) -> SlotComm:
  delay, spec = base.delay, {}
  for item in filter(None, text.split("+")):
    key, _, raw = item.partition(":")
    if key == "delay":
      if raw not in DELAYS:
        raise UserError(f"config.diloco.per_slot: {selector}: delay {raw!r} "
                        f"is not one of {', '.join(DELAYS)}.")
      delay = raw
    elif key in _SPEC_KEYS:
      try:
        spec[_SPEC_KEYS[key]] = (raw if key == "compression" else
                                 _parse_value(_SPEC_KEYS[key], raw))
      except ValueError as e:
        raise UserError(f"config.diloco.per_slot: {selector}: {key}: "
                        f"{e}.") from None
    else:
      raise UserError(
          f"config.diloco.per_slot: {selector}: unknown key {key!r}; use "
          f"delay, {', '.join(_SPEC_KEYS)}.")
  if spec.get("aggregate", base.spec.aggregate) not in AGGREGATES:
    raise UserError(f"config.diloco.per_slot: {selector}: sparse_aggregate "
                    f"{spec['aggregate']!r} is not one of "
                    f"{', '.join(AGGREGATES)}.")
  if spec.get("name", base.spec.name) not in compress.NAMES:
    raise UserError(f"config.diloco.per_slot: {selector}: compression "
                    f"{spec['name']!r} is not one of "
                    f"{', '.join(compress.NAMES)}.")
  return SlotComm(delay, dataclasses.replace(base.spec, **spec),
                  base.download, base.download_topk_fraction)


def comm_by_slot(config, slots) -> dict[str, SlotComm]:
  """Each slot's SlotComm; `slots` are `paths.Slot`s (name and kind)."""
  default = _default(config)
  rules = {}
  for part in filter(None, config.diloco.per_slot.replace(" ", "").split(
      ";")):
    selector, sep, text = part.partition("=")
    if not sep:
      raise UserError(f"config.diloco.per_slot: {part!r} is not "
                      "SELECTOR=key:value+key:value.")
    rules[selector] = text
  known = {s.name for s in slots} | {s.kind for s in slots}
  for selector in rules:
    if selector not in known:
      raise UserError(f"config.diloco.per_slot: no slot or kind "
                      f"{selector!r}; slots: "
                      f"{', '.join(sorted(known))}.")
  out = {}
  for slot in slots:
    text = rules.get(slot.name, rules.get(slot.kind))
    comm = (default if text is None
            else _override(default, text, slot.name))
    if comm.spec.name != "topk" and comm.spec.aggregate != "mean":
      # The aggregate is top-k's: a zero of a dense or quantized payload is
      # a value, not a coordinate left out, so those take the plain mean;
      # so does leader_topk, whose users all send on one support.
      comm = dataclasses.replace(
          comm, spec=dataclasses.replace(comm.spec, aggregate="mean"))
    if comm.spec.name in _LOW_RANK and _codes_each_layer(config, slot):
      comm = dataclasses.replace(
          comm, spec=dataclasses.replace(comm.spec, layer_axis=True))
    out[slot.name] = comm
  return out


_LOW_RANK = ("lowrank", "lowrank_shared")


def _codes_each_layer(config, slot) -> bool:
  """Whether the low rank codes each layer of `slot`'s leaves alone
  (`diloco.compression_matrix=per_layer`): a slot of layers whose
  parameters are stacked on axis 0 (`model.scan_layers`)."""
  return (getattr(config.diloco, "compression_matrix", "stacked")
          == "per_layer" and bool(slot.layers)
          and bool(config.model.scan_layers))


def all_plain(comms: dict[str, SlotComm]) -> bool:
  return all(c.plain for c in comms.values())


def overlap_steps(config) -> int:
  """tau of `delay=overlap` (diloco/overlap_step.py), 0 without it: check
  the config first, which allows overlap only on every slot at once."""
  d = config.diloco
  return d.overlap_steps if d.delay == "overlap" else 0


def max_delay(comms: dict[str, SlotComm]) -> int:
  """Rounds between handing a round over and applying it (0 or 1)."""
  return int(any(c.delayed for c in comms.values()))


def check_config(config) -> None:
  """Each slot's delay and compressor (per_slot included) are valid;
  raises ConfigError naming the field (`config_base.validate`)."""
  d = config.diloco
  if d.compression_rank_min > d.compression_rank_max:
    config_fields.fail(
        "diloco.compression_rank_min", f"{d.compression_rank_min} must be "
        f"<= diloco.compression_rank_max ({d.compression_rank_max}).")
  if d.compression_factor_bits not in (0, 4, 8):
    config_fields.fail(
        "diloco.compression_factor_bits", f"{d.compression_factor_bits} must "
        "be 0 (float32 factors), 8 or 4 (int8/int4 blocks).")
  if (d.compression_index_code == "elias_fano"
      and d.compression_topk_chunk < 1
      and "topk" in (d.compression, d.download_compression)):
    config_fields.fail(
        "diloco.compression_index_code", "elias_fano codes each top-k "
        "chunk's indices: set diloco.compression_topk_chunk > 0 (4096).")
  if d.compression == "leader_topk" and d.compression_topk_chunk < 1:
    config_fields.fail(
        "diloco.compression_topk_chunk", "must be > 0 with compression="
        "leader_topk (its indices are per chunk; SparseLoCo's is 4096).")
  slots = paths_lib.topology_from_config(config).slots
  comms = comm_by_slot(config, slots)
  _check_overlap(config, {c.delay for c in comms.values()})
  if d.download_topk_fraction and d.download_compression != "topk":
    config_fields.fail(
        "diloco.download_topk_fraction", f"{d.download_topk_fraction:g} is "
        "used only with diloco.download_compression=topk; leave it 0.")
  if d.download_compression != "none" and any(
      c.delay not in ("none", "overlap") for c in comms.values()):
    config_fields.fail(
        "diloco.download_compression", f"{d.download_compression!r} runs "
        "with delay none or overlap only (every slot); set it to none or "
        "the delay to none or overlap.")
  for name, slot_comm in comms.items():
    try:
      compress.make_codec(slot_comm.spec)
    except ValueError as e:  # Only per_slot values can get here.
      config_fields.fail("diloco.per_slot", f"slot {name}: {e}.")
    if slot_comm.spec.aggregate == "senders" and slot_comm.delay in (
        "eager", "lookahead"):
      # Their workers' own views assume the plain mean's weights.
      config_fields.fail(
          "diloco.sparse_aggregate", f"senders (top-k's default) is not "
          f"built for delay {slot_comm.delay} (slot {name}); set it to "
          "mean, or the delay to none, one_round or overlap.")


def _check_overlap(config, delays: set) -> None:
  """overlap runs on every slot or none (its apply steps are the loop's,
  one tau for all), with 1 <= tau <= H."""
  d = config.diloco
  if "overlap" in delays and len(delays) > 1:
    config_fields.fail("diloco.per_slot", "delay overlap must be every "
                       "slot's (diloco.delay=overlap, no per-slot delay).")
  tau, h = d.overlap_steps, d.inner_steps
  if "overlap" in delays and not 1 <= tau <= max(h, 1):
    config_fields.fail("diloco.overlap_steps", f"{tau} must be in [1, "
                       f"diloco.inner_steps={h}] with delay overlap.")
  if tau and "overlap" not in delays:
    config_fields.fail("diloco.overlap_steps", f"{tau} is used only with "
                       "diloco.delay=overlap; leave it 0.")
