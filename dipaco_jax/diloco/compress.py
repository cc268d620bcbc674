"""DiLoCoX-style compression of what a worker sends: its contribution.

A worker's contribution to a module is its pseudo-gradient, outer - inner in
float32 (outer.py, Eq. (1)). Before it goes on the wire, a *codec* turns each
leaf into a payload of a few arrays:

  none     the float32 values as they are.
  int8     per block of the flattened leaf, one float32 scale absmax / 127
           and symmetric round-to-nearest codes in [-127, 127].
  int4     the same with codes in [-7, 7]; two nibbles per byte.
  e3m0     4-bit floats of Streaming DiLoCo, sign + 3 exponent bits: per
           block, absmax * sign * 2^(e - 7) for e in 1..7, or 0 for e = 0.
           (int8, int4, e3m0: compress_block.py.)
  lowrank  PowerSGD, warm-started, adaptive rank, a subspace per worker
           (compress_lowrank.py); factor_bits 8 or 4: int8/int4 factors
           (DiLoCoX's "low rank + int4"). lowrank_shared: one subspace
           per module, its users together (compress_shared.py).
  topk     SparseLoCo: the k largest |x|, each as 2 bits (sign, and which of
           two per-leaf magnitudes); with topk_chunk > 0, per chunk of that
           many entries, indices inside the chunk (compress_topk.py).
  leader_topk  chunked topk on one support per module a round: its
           leader's (users take turns), every user's values there, 2 bits
           each; only the leader sends indices (compress_leader.py).
  strided  the round's 1 / stride of the entries, the same on every worker,
           2 bits each, no indices (compress_strided.py).

With error feedback a worker keeps what its codec lost (the residual) and
adds it to its next contribution, so nothing is lost for good: after R
rounds, sum of what was sent + residual = sum of the contributions. With a
feedback decay beta < 1 (SparseLoCo's accumulator, e <- beta e + delta)
the residual is scaled by beta before it is added: old losses fade.
`compress_apply.py` applies a codec so, leaf by leaf or over workers.

A payload has static shapes (it is made inside the jitted outer step,
vmapped over workers); `payload_bytes` counts, traced, the bytes of what
really goes on the wire, and `trim` makes that, eagerly: padding and unused
rank cut, 4-bit and 2-bit codes packed.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

from dipaco_jax.diloco import compress_base
from dipaco_jax.diloco import compress_block
from dipaco_jax.diloco import compress_lowrank as lowrank
from dipaco_jax.diloco import compress_spec
from dipaco_jax.diloco import compress_strided
from dipaco_jax.diloco import compress_topk

NAMES = compress_spec.NAMES

CompressionSpec = compress_spec.CompressionSpec
spec_from_config = compress_spec.spec_from_config
Codec = compress_base.Codec
_size, _flat = compress_base.size, compress_base.flat


class _TopKCodec(Codec):
  """The k largest |x| of the leaf, each sent as 2 bits: bit 1 = negative,
  bit 0 = large. Magnitudes: s2 = mean |x| of the larger half of the kept
  entries (ceil(k / 2) of them), s1 = mean of the smaller half (= s2 when
  k = 1); each kept entry takes the nearer one (s2 from the midpoint up).
  Payload: indices [k] int32, codes [k] uint8, scales [2] = (s1, s2)."""

  def num_kept(self, shape) -> int:
    n = _size(shape)
    return min(n, max(1, math.floor(self.spec.topk_fraction * n + 0.5)))

  def encode(self, x, state):
    x_N = _flat(x)
    k = self.num_kept(x.shape)
    abs_K, idx_K = jax.lax.top_k(jnp.abs(x_N), k)  # descending
    s2 = abs_K[:k - k // 2].mean()
    s1 = abs_K[k - k // 2:].mean() if k > 1 else s2
    large_K = abs_K >= (s1 + s2) / 2
    code_K = (large_K.astype(jnp.uint8) |
              ((x_N[idx_K] < 0).astype(jnp.uint8) << 1))
    return ({"idx": idx_K.astype(jnp.int32), "code": code_K,
             "scales": jnp.stack([s1, s2])}, state)

  def decode(self, payload, shape):
    code_K, scales = payload["code"], payload["scales"]
    magnitude_K = jnp.where((code_K & 1) == 1, scales[1], scales[0])
    value_K = jnp.where((code_K & 2) == 2, -magnitude_K, magnitude_K)
    x_N = jnp.zeros(_size(shape), jnp.float32).at[payload["idx"]].set(value_K)
    return x_N.reshape(shape)

  def payload_bytes(self, payload, shape):
    del payload
    k = self.num_kept(shape)
    return jnp.float32(4 * k + -(-k // 4) + 8)

  def trim(self, payload):
    trimmed = super().trim(payload)
    trimmed["code"] = compress_topk.pack_bits(trimmed["code"], 2)
    return trimmed

  def untrim(self, trimmed, shape):
    payload = dict(trimmed)
    payload["code"] = compress_topk.unpack_bits(
        trimmed["code"], 2, self.num_kept(shape)).astype(np.uint8)
    return payload


class _ChunkedTopKCodec(Codec):
  """topk with topk_chunk > 0: the k largest |x| of every chunk
  (compress_topk.py). Payload: idx [M, k] int32 (inside the chunk), code
  [M, k] uint8, scales [M, 2] float32; on the wire the indices take
  ceil(log2(chunk)) bits and the codes 2."""

  def encode(self, x, state):
    return compress_topk.encode(_flat(x), self.spec.topk_chunk,
                                self.spec.topk_fraction), state

  def decode(self, payload, shape):
    return compress_topk.decode(payload, _size(shape),
                                self.spec.topk_chunk).reshape(shape)

  def payload_bytes(self, payload, shape):
    del payload
    return jnp.float32(compress_topk.payload_bytes(
        _size(shape), self.spec.topk_chunk, self.spec.topk_fraction,
        self.spec.index_code))

  def trim(self, payload):
    trimmed = super().trim(payload)
    if self.spec.index_code == "elias_fano":
      trimmed["idx"], trimmed["code"] = compress_topk.elias_fano_pack(
          trimmed["idx"], trimmed["code"], self.spec.topk_chunk)
    else:
      bits = compress_topk.index_bits(self.spec.topk_chunk)
      trimmed["idx"] = compress_topk.pack_bits(trimmed["idx"], bits)
    trimmed["code"] = compress_topk.pack_bits(trimmed["code"], 2)
    return trimmed

  def untrim(self, trimmed, shape):
    _, m, k = compress_topk.layout(_size(shape), self.spec.topk_chunk,
                                   self.spec.topk_fraction)
    if self.spec.index_code == "elias_fano":
      idx = compress_topk.elias_fano_unpack(trimmed["idx"], m, k,
                                            self.spec.topk_chunk)
    else:
      bits = compress_topk.index_bits(self.spec.topk_chunk)
      idx = compress_topk.unpack_bits(trimmed["idx"], bits, m * k)
    code = compress_topk.unpack_bits(trimmed["code"], 2, m * k)
    return {"scales": trimmed["scales"],
            "idx": idx.astype(np.int32).reshape(m, k),
            "code": code.astype(np.uint8).reshape(m, k)}


class _RoundCodec(Codec):
  """A codec whose state is the round, alike on every worker."""
  stateful = True

  def init_state(self, x):
    del x
    return self.state_at_round(0)

  def state_at_round(self, round_index):  # An island executor's round.
    return {"round": jnp.asarray(round_index, jnp.int32)}


class _StridedCodec(_RoundCodec):
  """compress_strided.py: the round sets the phase."""

  def encode(self, x, state):
    phase = state["round"] % self.spec.stride
    return (compress_strided.encode(_flat(x), self.spec.stride,
                                    self.spec.block_size, phase),
            self.state_at_round(state["round"] + 1))

  def decode(self, payload, shape):
    return compress_strided.decode(payload, _size(shape), self.spec.stride,
                                   self.spec.block_size).reshape(shape)

  def payload_bytes(self, payload, shape):
    return jnp.float32(compress_strided.payload_bytes(
        _size(shape), self.spec.stride, self.spec.block_size))

  def trim(self, payload):
    return {**super().trim(payload),
            "code": compress_topk.pack_bits(payload["code"], 2)}

  def untrim(self, trimmed, shape):
    m, _ = compress_strided.layout(_size(shape), self.spec.stride,
                                   self.spec.block_size)
    return {**trimmed, "code": compress_topk.unpack_bits(
        trimmed["code"], 2, m).astype(np.uint8)}


# The suffix of layer i's keys, + str(i), in a per-layer low-rank payload
# on the wire (`_LowRankCodec.trim`).
_LAYER_KEY_SUFFIX = "_layer"


class _LowRankCodec(Codec):
  """PowerSGD with an adaptive rank; its functions are in compress_lowrank.py.
  State: the warm start, per leaf of ndim >= 2. With factor_bits, each
  factor column goes through compress_block.py's int8/int4 codec (the
  error feedback then also keeps what the factors' rounding lost).

  With `spec.layer_axis` a leaf [L, ...] stacks L layers' weights, and each
  layer's weight is one matrix of its own (PowerSGD codes each weight
  alone), vmapped over L: a payload, a state and a rank per layer, and a
  layer's vector (a norm's scale) goes whole. Without it the leaf is one
  matrix, all its layers in one basis."""
  stateful = True

  @property
  def _factor_codec(self) -> Codec | None:
    bits = self.spec.factor_bits
    if not bits:
      return None
    return {8: compress_block.IntCodec,
            4: compress_block.Int4Codec}[bits](self.spec)

  def _per_layer(self, shape) -> bool:
    return self.spec.layer_axis and len(shape) >= 2

  def init_state(self, x):
    if not self._per_layer(x.shape):
      return lowrank.init_state(x.shape, self.spec.rank_max)
    layer = lowrank.init_state(x.shape[1:], self.spec.rank_max)
    return {k: jnp.broadcast_to(v, (x.shape[0],) + v.shape)
            for k, v in layer.items()}

  def encode(self, x, state):
    if self._per_layer(x.shape):
      return jax.vmap(self._encode_matrix)(x, state)
    return self._encode_matrix(x, state)

  def decode(self, payload, shape):
    if self._per_layer(shape):
      return jax.vmap(lambda p: self._decode_matrix(p, shape[1:]))(payload)
    return self._decode_matrix(payload, shape)

  def payload_bytes(self, payload, shape):
    if self._per_layer(shape):
      return jax.vmap(lambda p: self._matrix_bytes(p, shape[1:]))(
          payload).sum()
    return self._matrix_bytes(payload, shape)

  def trim(self, payload):
    """Per layer, each layer's payload trimmed, its keys suffixed
    `_layer{i}` (ranks differ between layers, so the cut factors do not
    stack); a layer's vectors stay stacked under "x"."""
    rank = payload.get("rank")
    if rank is None or np.ndim(rank) == 0:
      return self._trim_matrix(payload)
    return {f"{k}{_LAYER_KEY_SUFFIX}{i}": v
            for i in range(np.shape(rank)[0])
            for k, v in self._trim_matrix(
                {k: np.asarray(v)[i] for k, v in payload.items()}).items()}

  def untrim(self, trimmed, shape):
    if not (self._per_layer(shape) and f"rank{_LAYER_KEY_SUFFIX}0" in trimmed):
      return self._untrim_matrix(trimmed, shape)
    layers = []
    for i in range(shape[0]):
      suffix = f"{_LAYER_KEY_SUFFIX}{i}"
      layers.append(self._untrim_matrix(
          {k[:-len(suffix)]: v for k, v in trimmed.items()
           if k.endswith(suffix)}, shape[1:]))
    return {k: np.stack([layer[k] for layer in layers]) for k in layers[0]}

  # One matrix (a whole leaf, or one layer of it).

  def _encode_matrix(self, x, state):
    payload, state = lowrank.encode(x, state, self.spec.rank_min,
                                    self.spec.energy)
    if self._factor_codec:
      payload = lowrank.quantize_factors(payload, self._factor_codec)
    return payload, state

  def _decode_matrix(self, payload, shape):
    if self._factor_codec:
      payload = lowrank.dequantize_factors(payload, self._factor_codec)
    return lowrank.decode(payload, shape)

  def _matrix_bytes(self, payload, shape):
    if self._factor_codec:
      return lowrank.quantized_payload_bytes(payload, shape,
                                             self._factor_codec)
    return lowrank.payload_bytes(payload, shape)

  def _trim_matrix(self, payload):
    if self._factor_codec:
      return lowrank.trim_quantized(payload, self._factor_codec)
    return lowrank.trim(payload)

  def _untrim_matrix(self, trimmed, shape):
    if self._factor_codec:
      return lowrank.untrim_quantized(trimmed, shape, self.spec.rank_max,
                                      self._factor_codec)
    return lowrank.untrim(trimmed, shape, self.spec.rank_max)


class _SharedLowRankCodec(_LowRankCodec):
  """`lowrank_shared`'s state, a worker's copy of its module's warm start;
  a module's users encode together (compress_shared.compress_tree)."""

  def encode(self, x, state):
    raise ValueError("lowrank_shared encodes a module's users together: "
                     "use diloco/compress_shared.compress_tree")


class _LeaderTopKCodec(_RoundCodec, _ChunkedTopKCodec):
  """`leader_topk`: the round says which user of a module leads; its users
  encode together (compress_leader.compress_tree) on the leader's chunked
  top-k indices, so a payload decodes as chunked topk's."""

  def encode(self, x, state):
    raise ValueError("leader_topk encodes a module's users together: "
                     "use diloco/compress_leader.compress_tree")


_CODECS = {"none": Codec, "int8": compress_block.IntCodec,
           "int4": compress_block.Int4Codec, "e3m0": compress_block.E3M0Codec,
           "lowrank": _LowRankCodec, "lowrank_shared": _SharedLowRankCodec,
           "topk": _TopKCodec, "leader_topk": _LeaderTopKCodec,
           "strided": _StridedCodec}


def make_codec(spec: CompressionSpec) -> Codec:
  """The codec of `spec`, or a clear error for a bad spec."""
  if spec.name not in _CODECS:
    raise ValueError(f"compression: unknown {spec.name!r}, not in {NAMES}")
  compress_spec.check(spec)
  if spec.name == "topk" and spec.topk_chunk:
    return _ChunkedTopKCodec(spec)
  return _CODECS[spec.name](spec)
