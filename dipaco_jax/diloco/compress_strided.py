"""Strided sparsification ("strided", ours): the math of `compress.py`'s
codec of that name.

Top-k's downloads cannot be as thin as its uploads: each worker keeps its
own coordinates, so a module's change covers its users' kept entries
together, up to `users` times one worker's, and each kept entry pays an
index (12 of its 14 bits at SparseLoCo's chunks of 4096). Here every
worker sends the same entries in a round: those of flat index
j = phase (mod stride), phase = the round's index mod stride. A round's
change then has one worker's support, so the download is as thin as the
upload, and neither carries indices: only the round (which both ends
know) says which entries the values are. With error feedback every entry
goes out once every `stride` rounds with what it gathered meanwhile.

The values of a leaf's [ceil(N / stride)] entries are sent as 2 bits each
(sign, and which of its block's two magnitudes), per block of
`block_size` entries: entries above the block's mean |x| take the mean
|x| of those, the others the mean |x| of the rest (one Lloyd step of a
2-level quantizer, no sort). Bytes: 2 bits per entry sent, two float32
magnitudes per block, and the phase (int32).
"""

import jax
import jax.numpy as jnp


def layout(n: int, stride: int, block: int) -> tuple[int, int]:
  """(entries sent per round, blocks of them) for a leaf of n entries."""
  m = -(-n // stride)
  return m, -(-m // block)


def _rows(x_N, stride: int):
  """[N] -> [ceil(N / stride), stride], zero-padded: column p holds the
  entries of phase p."""
  n = x_N.shape[0]
  return jnp.pad(x_N, (0, -n % stride)).reshape(-1, stride)


def encode(x_N, stride: int, block: int, phase) -> dict:
  """x [N] float32, phase (traced int32 in [0, stride)) -> {"code" [M]
  uint8 (bit 1 = negative, bit 0 = large), "scales" [B, 2] float32 (small,
  large), "phase" int32}."""
  v_M = jax.lax.dynamic_index_in_dim(_rows(x_N, stride), phase, axis=1,
                                     keepdims=False)
  m, b = layout(x_N.shape[0], stride, block)
  abs_BxS = jnp.pad(jnp.abs(v_M), (0, b * block - m)).reshape(b, block)
  # The padding's zeros count as small entries: the last block's small
  # magnitude is then a little low, which the error feedback repays.
  threshold_B = abs_BxS.mean(axis=1)
  large_BxS = abs_BxS > threshold_B[:, None]

  def mean_where(mask_BxS):
    count_B = mask_BxS.sum(axis=1)
    total_B = jnp.where(mask_BxS, abs_BxS, 0.0).sum(axis=1)
    return jnp.where(count_B > 0, total_B / jnp.maximum(count_B, 1), 0.0)

  scales_Bx2 = jnp.stack([mean_where(~large_BxS), mean_where(large_BxS)], 1)
  large_M = large_BxS.reshape(-1)[:m]
  code_M = large_M.astype(jnp.uint8) | ((v_M < 0).astype(jnp.uint8) << 1)
  return {"code": code_M, "scales": scales_Bx2,
          "phase": jnp.asarray(phase, jnp.int32)}


def decode(payload, n: int, stride: int, block: int) -> jax.Array:
  """encode's inverse up to the quantization: [N] float32, zero off the
  phase's entries."""
  code_M, scales_Bx2 = payload["code"], payload["scales"]
  m = code_M.shape[0]
  block_M = jnp.arange(m) // block
  magnitude_M = jnp.where((code_M & 1) == 1, scales_Bx2[block_M, 1],
                          scales_Bx2[block_M, 0])
  value_M = jnp.where((code_M & 2) == 2, -magnitude_M, magnitude_M)
  phase_M = (jnp.arange(stride) == payload["phase"])[None, :]
  x_MxS = jnp.where(phase_M, value_M[:, None], 0.0)
  return x_MxS.reshape(-1)[:n]


def payload_bytes(n: int, stride: int, block: int) -> int:
  """Bytes on the wire: 2 bits per entry sent, two float32 magnitudes per
  block, the int32 phase."""
  m, b = layout(n, stride, block)
  return -(-2 * m // 8) + 8 * b + 4
