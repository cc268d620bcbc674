"""The block codecs of `compress.py`: int8, int4 and e3m0, each an
absmax scale per block of the flattened leaf and a code per value; also
the low rank's integer factors (`compress.py`'s factor_bits)."""

from typing import ClassVar

import jax.numpy as jnp
import numpy as np

from dipaco_jax.diloco import compress_base
from dipaco_jax.diloco import compress_topk

Codec = compress_base.Codec
_size, _flat = compress_base.size, compress_base.flat


class BlockCodec(Codec):
  """Absmax scaling per block of the flattened leaf (zero-padded to whole
  blocks), then an int8 code per value. The payload holds the codes of the
  real values only, [N] int8 (the padding is not sent), and the scales
  [ceil(N / block_size)] float32. A subclass says how: `_scale(absmax_B)`,
  `_code(x / scale)`, and `_value(code)` in units of the scale."""
  bits: ClassVar[int] = 8

  def _blocks(self, x_N):
    b = self.spec.block_size
    pad = -x_N.shape[0] % b
    return jnp.pad(x_N, (0, pad)).reshape(-1, b)

  def encode(self, x, state):
    x_N = _flat(x)
    x_BxS = self._blocks(x_N)
    scale_B = self._scale(jnp.abs(x_BxS).max(1))
    # A zero block has scale 0: divide by 1 instead, its codes are all 0.
    safe_B = jnp.where(scale_B > 0, scale_B, 1.0)
    code_BxS = self._code(x_BxS / safe_B[:, None])
    return ({"code": code_BxS.reshape(-1)[:x_N.shape[0]], "scale": scale_B},
            state)

  def decode(self, payload, shape):
    code_BxS = self._blocks(payload["code"])
    x_BxS = self._value(code_BxS) * payload["scale"][:, None]
    return x_BxS.reshape(-1)[:_size(shape)].reshape(shape)

  def payload_bytes(self, payload, shape):
    n = _size(shape)
    return jnp.float32(-(-n * self.bits // 8) + 4 * payload["scale"].shape[0])

  def trim(self, payload):
    trimmed = super().trim(payload)
    if self.bits == 4:
      trimmed["code"] = compress_topk.pack_bits(trimmed["code"] & 15, 4)
    return trimmed

  def untrim(self, trimmed, shape):
    payload = dict(trimmed)
    if self.bits == 4:
      payload["code"] = compress_base.unpack_signed(trimmed["code"], 4,
                                                    _size(shape))
    return payload


class IntCodec(BlockCodec):
  """Symmetric integers: scale = absmax / qmax, round half to even."""
  qmax: ClassVar[int] = 127

  def _scale(self, absmax_B):
    return absmax_B / self.qmax

  def _code(self, r_BxS):
    return jnp.clip(jnp.round(r_BxS), -self.qmax, self.qmax).astype(jnp.int8)

  def _value(self, code):
    return code.astype(jnp.float32)


class Int4Codec(IntCodec):
  bits = 4
  qmax = 7


# e3m0 magnitudes by exponent code e: 0, then 2^(e - 7) for e = 1..7.
_E3M0_LEVELS = np.array([0.0] + [2.0 ** (e - 7) for e in range(1, 8)],
                        np.float32)


class E3M0Codec(BlockCodec):
  """4-bit floats, scale = absmax, coded sign * e in [-7, 7] (int8; packed
  as a nibble like int4).

  Rounding is to the nearest power of two *in log2 space*: |r| = mant * 2^q
  with mant in [0.5, 1) (frexp, exact) goes to 2^q when mant >= 2^-0.5,
  else to 2^(q - 1); the boundary between 2^k and 2^(k+1) is their geometric
  mean, e.g. 0.7071 * absmax, not 0.75 * absmax. Below 2^-6.5 (the log2
  midpoint to a notional next level 2^-7) a value flushes to 0.
  """
  bits = 4

  def _scale(self, absmax_B):
    return absmax_B

  def _code(self, r_BxS):
    mant, q = jnp.frexp(jnp.abs(r_BxS))
    k = jnp.where(mant >= 2.0 ** -0.5, q, q - 1)  # round(log2 |r|), <= 0
    e = jnp.where(r_BxS == 0, 0, jnp.clip(k + 7, 0, 7))
    return jnp.where(r_BxS < 0, -e, e).astype(jnp.int8)

  def _value(self, code):
    magnitude = jnp.asarray(_E3M0_LEVELS)[jnp.abs(code).astype(jnp.int32)]
    return jnp.where(code < 0, -magnitude, magnitude)
