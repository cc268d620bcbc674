"""Chunked top-k of SparseLoCo: the math of `compress.py`'s "topk" codec
when `topk_chunk` > 0; and the bit packing of every codec's wire form
(`pack_bits` / `unpack_bits`).

A leaf's flattened values are cut into chunks of `chunk` entries (the last
one padded with zeros); each chunk keeps its k largest |x|, sent as an
index inside the chunk (ceil(log2(chunk)) bits: 12 for SparseLoCo's 4096)
and 2 bits (sign, and which of the chunk's two magnitudes). Against one
top-k over the whole leaf with 32-bit indices, a kept entry costs 14 bits
instead of 34, so at the same bytes 2.4x as many entries go out, and every
chunk gets its share (a leaf's largest entries cannot crowd out the rest).

The indices go on the wire in one of two index codes (`index_code`):
`fixed`, each at ceil(log2(chunk)) bits (12 at 4096, what every figure
before 2026-12-04 counts), or `elias_fano`, each chunk's sorted indices as
an Elias-Fano sequence, about 2 + log2(chunk / k) bits each: 8 instead of
12 at 64 of 4096, 5 instead of 12 at 512 of 4096. Both are lossless: the
same entries decode to the same values, only the bytes differ.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np


def layout(n: int, chunk: int, fraction: float) -> tuple[int, int, int]:
  """(entries per chunk, number of chunks, kept per chunk) for a leaf of n
  entries: a leaf smaller than `chunk` is one chunk of its own size."""
  c = min(chunk, n)
  k = min(c, max(1, math.floor(fraction * c + 0.5)))
  return c, -(-n // c), k


def index_bits(chunk: int) -> int:
  return max(1, math.ceil(math.log2(chunk)))


def quantize(v_MxK):
  """Each chunk's kept values [M, k] -> (code [M, k] uint8: bit 1 =
  negative, bit 0 = large; scales [M, 2] float32: small, large). The larger
  magnitude is the mean |v| of the larger half of a chunk's values
  (ceil(k / 2) of them), the smaller one of the other half (the same when
  k = 1); a value takes the large code from their midpoint up. Shared with
  leader_topk (compress_leader.py), whose values need not be its own
  largest, hence the sort."""
  k = v_MxK.shape[1]
  abs_MxK = jnp.abs(v_MxK)
  sorted_MxK = -jnp.sort(-abs_MxK, axis=1)  # descending
  s2_M = sorted_MxK[:, :k - k // 2].mean(axis=1)
  s1_M = sorted_MxK[:, k - k // 2:].mean(axis=1) if k > 1 else s2_M
  large_MxK = abs_MxK >= ((s1_M + s2_M) / 2)[:, None]
  code_MxK = large_MxK.astype(jnp.uint8) | ((v_MxK < 0).astype(jnp.uint8)
                                            << 1)
  return code_MxK, jnp.stack([s1_M, s2_M], axis=1)


def chunks(x_N, chunk: int, fraction: float):
  """x [N] -> [M, c], the last chunk padded with zeros (`layout`)."""
  n = x_N.shape[0]
  c, m, _ = layout(n, chunk, fraction)
  return jnp.pad(x_N, (0, m * c - n)).reshape(m, c)


def encode(x_N, chunk: int, fraction: float) -> dict:
  """x [N] float32 -> {"idx" [M, k] int32, "code" [M, k] uint8, "scales"
  [M, 2] float32}: each chunk's k largest |x|, quantized by `quantize`."""
  _, _, k = layout(x_N.shape[0], chunk, fraction)
  x_MxC = chunks(x_N, chunk, fraction)
  _, idx_MxK = jax.lax.top_k(jnp.abs(x_MxC), k)
  code_MxK, scales_Mx2 = quantize(jnp.take_along_axis(x_MxC, idx_MxK,
                                                      axis=1))
  return {"idx": idx_MxK.astype(jnp.int32), "code": code_MxK,
          "scales": scales_Mx2}


def decode(payload, n: int, chunk: int) -> jax.Array:
  """encode's inverse up to the quantization: [N] float32."""
  idx_MxK, code_MxK, scales_Mx2 = (payload["idx"], payload["code"],
                                   payload["scales"])
  m = idx_MxK.shape[0]
  c = min(chunk, n)
  magnitude_MxK = jnp.where((code_MxK & 1) == 1, scales_Mx2[:, 1:2],
                            scales_Mx2[:, 0:1])
  value_MxK = jnp.where((code_MxK & 2) == 2, -magnitude_MxK, magnitude_MxK)
  rows_MxK = jnp.broadcast_to(jnp.arange(m)[:, None], idx_MxK.shape)
  x_MxC = jnp.zeros((m, c), jnp.float32).at[rows_MxK, idx_MxK].set(value_MxK)
  return x_MxC.reshape(-1)[:n]


def payload_bytes(n: int, chunk: int, fraction: float,
                  index_code: str = "fixed") -> int:
  """Bytes on the wire: the indices (`index_bytes`), the codes at 2 bits
  each, and two float32 magnitudes per chunk."""
  _, m, k = layout(n, chunk, fraction)
  return (index_bytes(n, chunk, fraction, index_code) + -(-m * k * 2 // 8)
          + 8 * m)


def index_bytes(n: int, chunk: int, fraction: float,
                index_code: str = "fixed") -> int:
  """The indices' bytes of a leaf of n entries: `fixed`, index_bits(chunk)
  each (a leaf smaller than a chunk too); `elias_fano`, each chunk's
  `elias_fano_bits` over indices in [0, chunk), the chunks' streams back
  to back. A leaf smaller than a chunk is coded over [0, chunk) too (a
  byte or two more than over its own size): `trim` sees the payload, not
  the leaf's size."""
  _, m, k = layout(n, chunk, fraction)
  if index_code == "elias_fano":
    return -(-m * elias_fano_bits(chunk, k) // 8)
  return -(-m * k * index_bits(chunk) // 8)


def elias_fano_split(c: int, k: int) -> tuple[int, int]:
  """(low bits per index, buckets) of k sorted distinct indices in [0, c):
  an index's low `low` bits are stored as they are, its high part
  (index >> low, one of `buckets`) in unary."""
  low = max(0, math.floor(math.log2(c / k)))
  return low, ((c - 1) >> low) + 1


def elias_fano_bits(c: int, k: int) -> int:
  """One chunk's Elias-Fano stream: k low parts, then a bit vector of
  k + buckets bits with index i's bit at high_i + i."""
  low, buckets = elias_fano_split(c, k)
  return k * low + k + buckets


def elias_fano_pack(idx_MxK, code_MxK, c: int) -> tuple[np.ndarray,
                                                        np.ndarray]:
  """Eager: (each chunk's indices as an Elias-Fano stream, the streams
  packed back to back, uint8; the codes in the same, ascending, order)."""
  order_MxK = np.argsort(idx_MxK, axis=1, kind="stable")
  sorted_MxK = np.take_along_axis(np.asarray(idx_MxK), order_MxK, axis=1
                                  ).astype(np.int64)
  m, k = sorted_MxK.shape
  low, buckets = elias_fano_split(c, k)
  low_MxKxL = (sorted_MxK[:, :, None] >> np.arange(low)) & 1
  upper_MxU = np.zeros((m, k + buckets), np.uint8)
  np.put_along_axis(upper_MxU, (sorted_MxK >> low) + np.arange(k), 1, axis=1)
  stream_MxB = np.concatenate([low_MxKxL.reshape(m, k * low).astype(
      np.uint8), upper_MxU], axis=1)
  return (np.packbits(stream_MxB.reshape(-1), bitorder="little"),
          np.take_along_axis(np.asarray(code_MxK), order_MxK, axis=1))


def elias_fano_unpack(packed, m: int, k: int, c: int) -> np.ndarray:
  """elias_fano_pack's indices back: [M, k] int32, ascending per chunk."""
  low, buckets = elias_fano_split(c, k)
  flat = np.unpackbits(np.asarray(packed, np.uint8), bitorder="little")
  stream_MxB = flat[:m * elias_fano_bits(c, k)].reshape(m, -1)
  low_MxKxL = stream_MxB[:, :k * low].reshape(m, k, low).astype(np.int64)
  low_MxK = (low_MxKxL << np.arange(low)).sum(axis=2)
  # Each chunk's vector holds exactly k ones, in index order.
  _, position = np.nonzero(stream_MxB[:, k * low:])
  high_MxK = position.reshape(m, k) - np.arange(k)
  return ((high_MxK << low) | low_MxK).astype(np.int32)


def pack_bits(values, bits: int) -> np.ndarray:
  """Unsigned values [N] of `bits` bits each -> uint8 [ceil(N bits / 8)],
  little-endian bit order (the first value in the lowest bits)."""
  v = np.asarray(values).astype(np.uint32).reshape(-1)
  bits_NxB = (v[:, None] >> np.arange(bits, dtype=np.uint32)) & 1
  return np.packbits(bits_NxB.astype(np.uint8).reshape(-1),
                     bitorder="little")


def unpack_bits(packed, bits: int, n: int) -> np.ndarray:
  flat = np.unpackbits(np.asarray(packed, np.uint8), bitorder="little")
  bits_NxB = flat[:n * bits].reshape(n, bits).astype(np.uint32)
  return (bits_NxB << np.arange(bits, dtype=np.uint32)).sum(axis=1)
