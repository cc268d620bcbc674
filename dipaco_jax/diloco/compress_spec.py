"""What a worker's codec is: `config.diloco.compression*` as one frozen
value (a static argument of the jitted codecs in compress.py)."""

import dataclasses

NAMES = ("none", "int8", "int4", "e3m0", "lowrank", "lowrank_shared", "topk",
         "leader_topk", "strided")


@dataclasses.dataclass(frozen=True)
class CompressionSpec:
  """What a worker's codec is (config.diloco.compression*)."""
  name: str = "none"            # compress.NAMES
  error_feedback: bool = False
  block_size: int = 256         # int8/int4/e3m0, lowrank's int factors:
                                # values per float32 scale
  rank_min: int = 1             # lowrank
  rank_max: int = 32            # lowrank (clipped to min(m, n)); the
                                # fixed rank of lowrank_shared
  energy: float = 0.9           # lowrank: share of |x|^2 kept; 1 = rank_max
  factor_bits: int = 0          # lowrank: 0 = float32 factors; 8 or 4 = int
  topk_fraction: float = 0.01   # topk: share of entries kept (at least 1)
  topk_chunk: int = 0           # topk: entries per chunk; 0 = whole leaf
                                # (leader_topk: per chunk only)
  stride: int = 8               # strided: a round sends 1 / stride
  index_code: str = "fixed"     # chunked topk, leader_topk: fixed |
                                # elias_fano (compress_topk.py)
  feedback_decay: float = 1.0   # error feedback: residual scale, (0, 1]
  aggregate: str = "mean"       # mean | senders (outer.mix); config's
                                # default: senders, top-k only (comm.py)
  layer_axis: bool = False      # lowrank, lowrank_shared: each leaf's axis
                                # 0 stacks layers, and each layer's matrix
                                # is coded alone. Not a config field:
                                # comm.py sets it per slot, from
                                # diloco.compression_matrix and whether
                                # the slot's leaves stack layers


def spec_from_config(diloco_config) -> CompressionSpec:
  """The spec of `config.diloco`; a missing field takes the default."""
  d = CompressionSpec()
  get = lambda field, default: getattr(diloco_config, field, default)
  return CompressionSpec(
      name=get("compression", d.name) or "none",
      error_feedback=bool(get("error_feedback", d.error_feedback)),
      block_size=int(get("compression_block_size", d.block_size)),
      rank_min=int(get("compression_rank_min", d.rank_min)),
      rank_max=int(get("compression_rank_max", d.rank_max)),
      energy=float(get("compression_energy", d.energy)),
      factor_bits=int(get("compression_factor_bits", d.factor_bits)),
      topk_fraction=float(get("compression_topk_fraction", d.topk_fraction)),
      topk_chunk=int(get("compression_topk_chunk", d.topk_chunk)),
      stride=int(get("compression_stride", d.stride)),
      index_code=str(get("compression_index_code", d.index_code)),
      feedback_decay=float(get("error_feedback_decay", d.feedback_decay)),
      aggregate=str(get("sparse_aggregate", d.aggregate)))


def check(spec: CompressionSpec) -> None:
  """Raises ValueError naming the knob of `spec` that is out of range."""
  if spec.block_size < 1:
    raise ValueError(f"block_size must be >= 1 (got {spec.block_size})")
  if not 1 <= spec.rank_min <= spec.rank_max:
    raise ValueError(f"rank_min ({spec.rank_min}) must be in [1, rank_max "
                     f"({spec.rank_max})]")
  if not (0 < spec.energy <= 1 and 0 < spec.topk_fraction <= 1):
    raise ValueError(f"energy ({spec.energy}) and topk_fraction "
                     f"({spec.topk_fraction}) must be in (0, 1]")
  if spec.factor_bits not in (0, 4, 8):
    raise ValueError(f"factor_bits must be 0 (float32), 8 or 4 (got "
                     f"{spec.factor_bits})")
  if spec.topk_chunk < 0 or spec.stride < 1:
    raise ValueError(f"topk_chunk ({spec.topk_chunk}) must be >= 0 and "
                     f"stride ({spec.stride}) >= 1")
  if spec.name == "leader_topk" and spec.topk_chunk < 1:
    # Its indices are the leader's inside each chunk (12 bits at 4096).
    raise ValueError(f"leader_topk needs topk_chunk > 0 (got "
                     f"{spec.topk_chunk})")
  if spec.index_code not in ("fixed", "elias_fano"):
    raise ValueError(f"index_code must be fixed or elias_fano (got "
                     f"{spec.index_code!r})")
  if spec.index_code == "elias_fano" and spec.topk_chunk < 1 and (
      spec.name in ("topk", "leader_topk")):
    raise ValueError("index_code elias_fano needs topk_chunk > 0 (it codes "
                     "each chunk's indices)")
  if not 0 < spec.feedback_decay <= 1:
    raise ValueError(f"error_feedback_decay must be in (0, 1] (got "
                     f"{spec.feedback_decay})")
