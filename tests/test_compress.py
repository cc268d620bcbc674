"""The compressors: golden round trips by hand, wire bytes, error feedback."""

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from dipaco_jax.diloco import compress
from dipaco_jax.diloco import compress_apply
from dipaco_jax.diloco import compress_lowrank
from dipaco_jax.diloco import compress_topk

Spec = compress.CompressionSpec

# One small spec per codec: blocks of 8 so that a leaf of 35 values has a
# padded last block and an odd count of nibbles; topk keeps 7 of 35 (codes
# not a multiple of 4); lowrank's 3 columns fit a [5, 7] leaf.
SPECS = {
    "none": Spec(),
    "int8": Spec("int8", block_size=8),
    "int4": Spec("int4", block_size=8),
    "e3m0": Spec("e3m0", block_size=8),
    "lowrank": Spec("lowrank", rank_max=3, energy=0.9),
    # Integer factors, blocks of 4: a factor column of 5 or 7 pads a block.
    "lowrank_int8": Spec("lowrank", rank_max=3, energy=0.9, factor_bits=8,
                         block_size=4),
    "lowrank_int4": Spec("lowrank", rank_max=3, energy=0.9, factor_bits=4,
                         block_size=4),
    "topk": Spec("topk", topk_fraction=0.2),
    # Chunks of 8 (3-bit indices), 2 kept per chunk; 35 values pad a chunk.
    "topk_chunk": Spec("topk", topk_fraction=0.25, topk_chunk=8),
    # The same with each chunk's indices as an Elias-Fano stream: 2 of 8
    # at 1 low bit, 4 buckets, 2 + 2 + 4 = 8 bits a chunk.
    "topk_chunk_ef": Spec("topk", topk_fraction=0.25, topk_chunk=8,
                          index_code="elias_fano"),
    # A third of the entries a round, blocks of 4: 35 values pad the last
    # row of 3 and the last block.
    "strided": Spec("strided", stride=3, block_size=4),
}
ALL = sorted(SPECS)


def _codec(name, **changes):
  return compress.make_codec(dataclasses.replace(SPECS[name], **changes))


def _round_trip(codec, x):
  """(decoded, payload) of x; jitted: compiling op by op is slower."""
  x = np.asarray(x, np.float32)
  return _jit_round_trip(codec, x)


@functools.partial(jax.jit, static_argnums=0)
def _jit_round_trip(codec, x):
  payload, _ = codec.encode(x, codec.init_state(x))
  return codec.decode(payload, x.shape), payload


def test_none_is_bit_exact_identity():
  x = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
  x[0, 0] = 1e-42  # a denormal survives too
  codec = _codec("none")
  sent, payload = _round_trip(codec, x)
  np.testing.assert_array_equal(sent, x)
  assert float(codec.payload_bytes(payload, x.shape)) == 4 * 15


def test_int8_golden():
  codec = _codec("int8", block_size=4)
  # Block 1: absmax 1.27, scale 0.01: codes 127, -50, round(0.4) = 0, 0.
  # Block 2 (padded with two zeros): absmax 2.54, scale 0.02: codes -127,
  # round(0.55) = 1.
  sent, payload = _round_trip(codec, [1.27, -0.5, 0.004, 0.0, -2.54, 0.011])
  np.testing.assert_array_equal(payload["code"], [127, -50, 0, 0, -127, 1])
  np.testing.assert_allclose(payload["scale"], [0.01, 0.02], rtol=1e-6)
  np.testing.assert_allclose(sent, [1.27, -0.5, 0, 0, -2.54, 0.02],
                             rtol=1e-6)
  # 6 one-byte codes + 2 scales.
  assert float(codec.payload_bytes(payload, (6,))) == 6 + 2 * 4


def test_int4_golden():
  codec = _codec("int4", block_size=4)
  # Block 1: absmax 0.7, scale 0.1: codes 7, round(-2.6) = -3,
  # round(0.4) = 0, round(1.6) = 2. Block 2: all zero -> scale 0, codes 0.
  x = [0.7, -0.26, 0.04, 0.16, 0.0, 0.0, 0.0]
  sent, payload = _round_trip(codec, x)
  np.testing.assert_array_equal(payload["code"], [7, -3, 0, 2, 0, 0, 0])
  np.testing.assert_allclose(sent, [0.7, -0.3, 0, 0.2, 0, 0, 0], rtol=1e-6)
  # ceil(7 / 2) = 4 bytes of nibbles + 2 scales.
  assert float(codec.payload_bytes(payload, (7,))) == 4 + 2 * 4
  # Packed: low nibble first; -3 = 0xD, 2 = 0x2.
  np.testing.assert_array_equal(codec.trim(payload)["code"],
                                [0xD7, 0x20, 0x00, 0x00])


def test_e3m0_golden():
  codec = _codec("e3m0", block_size=4)
  # Block 1, scale = absmax = 8, levels 8 * 2^(e - 7) = 0.125 ... 8:
  #   8    -> r 1      -> 8 (e 7)
  #   -3   -> r 0.375, log2 = -1.415 -> 2^-1 -> -4 (e 6)
  #   5.5  -> r 0.6875 < 2^-0.5 = 0.7071 -> 2^-1 -> 4 (e 6)
  #   5.7  -> r 0.7125 >= 0.7071 -> 2^0 -> 8 (e 7; linear rounding would say 4)
  # Block 2, scale 8 again:
  #   -8   -> -8 (e 7)
  #   0.1  -> r 0.0125, log2 = -6.32 -> 2^-6 -> 0.125 (e 1)
  #   0.08 -> r 0.01, log2 = -6.64 < -6.5 -> flushes to 0
  #   0    -> 0
  # Block 3: all zero -> 0.
  x = [8, -3, 5.5, 5.7, -8, 0.1, 0.08, 0, 0, 0]
  sent, payload = _round_trip(codec, x)
  np.testing.assert_array_equal(payload["code"],
                                [7, -6, 6, 7, -7, 1, 0, 0, 0, 0])
  np.testing.assert_array_equal(sent, [8, -4, 4, 8, -8, 0.125, 0, 0, 0, 0])
  # ceil(10 / 2) = 5 bytes of nibbles + 3 scales.
  assert float(codec.payload_bytes(payload, (10,))) == 5 + 3 * 4


def test_topk_golden():
  codec = _codec("topk", topk_fraction=0.5)
  # k = 4 of 8: |x| 4, 3, 2, 1. Larger half (4, 3): s2 = 3.5; smaller half
  # (2, 1): s1 = 1.5; from the midpoint 2.5 up, s2: -4 -> -3.5, 3 -> 3.5,
  # 2 -> 1.5, -1 -> -1.5.
  x = [0.1, -4, 3, 0.2, -1, 2, 0, 0.5]
  sent, payload = _round_trip(codec, x)
  np.testing.assert_array_equal(sent, [0, -3.5, 3.5, 0, -1.5, 1.5, 0, 0])
  # 4 int32 indices + one byte of 2-bit codes + 2 float32 scales.
  assert float(codec.payload_bytes(payload, (8,))) == 16 + 1 + 8


def test_chunked_topk_golden():
  codec = _codec("topk_chunk", topk_fraction=0.375)
  # Chunks of 8, k = round(3.0) = 3 each. Chunk 0 keeps -4, 3, 2: larger
  # half (k - k // 2 = 2 of them) 4, 3 -> s2 = 3.5, smaller 2 -> s1 = 2,
  # midpoint 2.75. Chunk 1 keeps -6, 5, -2: s2 = 5.5, s1 = 2.
  x = [0.1, -4, 3, 0.2, -1, 2, 0, 0.5, 1, 1, -2, 0, 0, 0, 5, -6]
  sent, payload = _round_trip(codec, x)
  np.testing.assert_array_equal(
      sent, [0, -3.5, 3.5, 0, 0, 2, 0, 0, 0, 0, -2, 0, 0, 0, 5.5, -5.5])
  np.testing.assert_array_equal(payload["idx"], [[1, 2, 5], [7, 6, 2]])
  # 6 indices of 3 bits (3 B) + 6 codes of 2 bits (2 B) + 2 x 2 scales.
  assert float(codec.payload_bytes(payload, (16,))) == 3 + 2 + 16


def test_strided_golden():
  codec = _codec("strided", stride=3, block_size=4)
  # Rows of 3 (the last padded with two zeros): [1, -2, 3], [0.5, -4, 6],
  # [0, 8, -1], [2, 0, 0]; round r sends column r mod 3, one block of 4.
  x = np.array([1, -2, 3, 0.5, -4, 6, 0, 8, -1, 2], np.float32)
  state = codec.init_state(x)
  sent = []
  for _ in range(4):
    payload, state = codec.encode(x, state)
    sent.append(np.asarray(codec.decode(payload, x.shape)))
    assert float(codec.payload_bytes(payload, x.shape)) == 1 + 8 + 4
  # Round 0, column [1, 0.5, 0, 2]: mean |x| 0.875; above it 1, 2 -> 1.5,
  # the rest 0.5, 0 -> 0.25 (a zero codes as +small).
  np.testing.assert_allclose(sent[0], [1.5, 0, 0, 0.25, 0, 0, 0.25, 0, 0,
                                       1.5])
  # Round 1, column [-2, -4, 8, 0 (padding)]: mean 3.5; large -4, 8 -> 6,
  # small -2, 0 -> 1; the padding's entry (index 10) is not in the leaf.
  np.testing.assert_allclose(sent[1], [0, -1, 0, 0, -6, 0, 0, 6, 0, 0])
  # Round 2, column [3, 6, -1, 0]: mean 2.5; large 3, 6 -> 4.5, small 0.5.
  np.testing.assert_allclose(sent[2], [0, 0, 4.5, 0, 0, 4.5, 0, 0, -0.5, 0])
  # Round 3 is round 0's phase again.
  np.testing.assert_array_equal(sent[3], sent[0])
  assert int(state["round"]) == 4


def test_strided_workers_share_each_rounds_entries_and_cover_the_leaf():
  # The phase is the round's, not the data's: every worker sends the same
  # entries, so a module's users' mean has one worker's support, and
  # `stride` rounds cover every entry once.
  codec = _codec("strided", stride=4, block_size=8)
  rng = np.random.default_rng(9)
  contribs = {"w": rng.standard_normal((3, 6, 5)).astype(np.float32)}
  states = compress_apply.init_states(codec, contribs)
  step = jax.jit(lambda c, s: compress_apply.compress_tree(codec, c, None, s))
  covered = np.zeros((6, 5), int)
  for _ in range(4):
    sent, _, states, bytes_w = step(contribs, states)
    support = np.asarray(sent["w"]) != 0
    assert (support == support[0]).all()
    covered += support[0]
    # ceil(30 / 4) = 8 entries: 2 bytes of codes + one block + the phase.
    np.testing.assert_array_equal(bytes_w, [2 + 8 + 4] * 3)
  np.testing.assert_array_equal(covered, 1)


def test_chunked_topk_at_sparseloco_settings_sends_136x_fewer_bytes():
  # 64 of every 4096 (Covenant-72B's setting): 64 x 12 bits + 64 x 2 bits
  # + 8 B of scales = 120 B per 16384 B of float32.
  codec = _codec("topk_chunk", topk_fraction=64 / 4096, topk_chunk=4096)
  n = 4 * 4096
  assert float(codec.payload_bytes(None, (n,))) == 4 * 120
  assert 136 < 4 * n / (4 * 120) < 137


def test_elias_fano_indices_at_sparseloco_settings():
  # 64 of 4096: 6 low bits, 64 buckets: 64 x 6 + 64 + 64 = 512 bits, so
  # 64 + 16 + 8 = 88 B a chunk, against 120 B at 12-bit indices. 512 of
  # 4096 (the 8-worker download): 3 low bits, 512 buckets: 2,560 bits.
  codec = _codec("topk_chunk_ef", topk_fraction=64 / 4096, topk_chunk=4096)
  n = 4 * 4096
  assert float(codec.payload_bytes(None, (n,))) == 4 * 88
  assert compress_topk.elias_fano_bits(4096, 512) == 2560
  # Lossless at that size too, whatever the order top-k found them in.
  x = np.random.default_rng(7).standard_normal(n).astype(np.float32)
  sent, payload = _round_trip(codec, x)
  fixed = _codec("topk_chunk", topk_fraction=64 / 4096, topk_chunk=4096)
  np.testing.assert_array_equal(sent, _round_trip(fixed, x)[0])
  trimmed = codec.trim(payload)
  assert trimmed["idx"].nbytes == 4 * 64
  np.testing.assert_array_equal(codec.decode_trimmed(trimmed, (n,)), sent)


@pytest.mark.parametrize("c,k", [(8, 1), (8, 8), (4096, 64), (4096, 512),
                                 (100, 7)])
def test_elias_fano_round_trips_any_indices(c, k):
  rng = np.random.default_rng(c + k)
  idx_MxK = np.stack([rng.permutation(c)[:k] for _ in range(5)])
  code_MxK = rng.integers(0, 4, idx_MxK.shape).astype(np.uint8)
  packed, code_sorted = compress_topk.elias_fano_pack(idx_MxK, code_MxK, c)
  assert packed.nbytes == -(-5 * compress_topk.elias_fano_bits(c, k) // 8)
  idx_back = compress_topk.elias_fano_unpack(packed, 5, k, c)
  np.testing.assert_array_equal(idx_back, np.sort(idx_MxK, axis=1))
  # Each code travels with its index.
  for m in range(5):
    assert dict(zip(idx_MxK[m], code_MxK[m])) == dict(
        zip(idx_back[m], code_sorted[m]))


def test_error_feedback_decay_scales_the_residual():
  codec = _codec("topk", error_feedback=True, feedback_decay=0.5)
  rng = np.random.default_rng(8)
  x1, x2 = rng.standard_normal((2, 5, 7)).astype(np.float32)
  sent1, res1, *_ = compress_apply.compress_leaf(codec, x1, None, None)
  np.testing.assert_allclose(res1, x1 - sent1, atol=1e-6)
  sent2, res2, *_ = compress_apply.compress_leaf(codec, x2, res1, None)
  # e <- 0.5 e + delta, then what was sent leaves it.
  np.testing.assert_allclose(res2, 0.5 * res1 + x2 - sent2, atol=1e-6)
  with pytest.raises(ValueError, match="error_feedback_decay"):
    _codec("topk", feedback_decay=0.0)
  with pytest.raises(ValueError, match="topk_chunk"):
    _codec("topk", topk_chunk=-1)


def test_matrix_shape_is_the_squarest_split():
  assert compress_lowrank.matrix_shape((2, 3, 4, 5)) == (6, 20)  # not 24x5
  assert compress_lowrank.matrix_shape((4, 9)) == (4, 9)
  assert compress_lowrank.matrix_shape((7,)) is None
  assert compress_lowrank.matrix_shape(()) is None


def test_orthonormalize_spans_the_columns_like_qr():
  rng = np.random.default_rng(3)
  a_MxR = rng.standard_normal((40, 6)).astype(np.float32)
  q_MxR = np.asarray(compress_lowrank.orthonormalize(jnp.asarray(a_MxR)))
  np.testing.assert_allclose(q_MxR.T @ q_MxR, np.eye(6), atol=1e-5)
  # Same span, column by column, as Householder QR: each pair of columns
  # is equal up to its sign.
  householder_MxR = np.linalg.qr(a_MxR)[0]
  np.testing.assert_allclose(np.abs((q_MxR * householder_MxR).sum(0)),
                             np.ones(6), atol=1e-5)


def test_orthonormalize_zeroes_a_dependent_column():
  a_MxR = np.array([[1.0, 2.0, 0.0], [0.0, 0.0, 3.0], [0.0, 0.0, 0.0]],
                   np.float32)  # column 1 = 2 x column 0
  q_MxR = np.asarray(compress_lowrank.orthonormalize(jnp.asarray(a_MxR)))
  np.testing.assert_allclose(
      q_MxR, [[1.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 0.0]], atol=1e-6)


def test_orthonormalize_zeroes_a_column_dependent_up_to_rounding():
  # Column 1 is 3 x column 0 plus noise of float32 rounding's size: what
  # Gram-Schmidt leaves of it is noise, which must come out zero, not
  # scaled up to a unit column in a direction no CPU agrees on.
  rng = np.random.default_rng(4)
  a_M = rng.standard_normal(64).astype(np.float32)
  noise_M = 1e-7 * rng.standard_normal(64).astype(np.float32)
  b_M = rng.standard_normal(64).astype(np.float32)
  a_MxR = np.stack([a_M, 3 * a_M + noise_M, b_M], axis=1)
  q_MxR = np.asarray(compress_lowrank.orthonormalize(jnp.asarray(a_MxR)))
  np.testing.assert_array_equal(q_MxR[:, 1], np.zeros(64))
  np.testing.assert_allclose(np.linalg.norm(q_MxR[:, [0, 2]], axis=0),
                             [1.0, 1.0], rtol=1e-6)


def test_lowrank_of_a_rank_1_matrix_sends_exact_zero_columns():
  # The warm start has 4 columns; M Q has rank 1, so P's columns past the
  # first are exactly zero, whatever order the CPU sums in, and the
  # decode is M to float32 rounding (a machine where it came out 1% off
  # normalized rounding noise into a column).
  rng = np.random.default_rng(2)
  m = np.outer(rng.standard_normal(8), rng.standard_normal(6)).astype(
      np.float32)
  p, q, rank, _ = compress_lowrank.power_step(
      jnp.asarray(m), compress_lowrank.init_q(6, 4), rank_min=1, energy=1.0)
  np.testing.assert_array_equal(np.asarray(p)[:, 1:], np.zeros((8, 3)))
  np.testing.assert_array_equal(np.asarray(q)[:, 1:], np.zeros((6, 3)))
  assert int(rank) == 4  # energy 1: rank_max, yet only one column is live
  np.testing.assert_allclose(compress_lowrank.expand(p, q), m,
                             rtol=1e-5, atol=1e-6)


def test_lowrank_compiles_without_lapack_qr():
  # Batched LAPACK QR deadlocked whole runs on a 2-core CPU (jaxlib
  # 0.10.2): the workers' vmapped power step must not call it.
  codec = _codec("lowrank", rank_max=4, energy=1.0)
  x_WxMxN = jnp.ones((2, 12, 9))
  state = jax.vmap(codec.init_state)(x_WxMxN)
  hlo = jax.jit(jax.vmap(codec.encode)).lower(x_WxMxN, state).as_text()
  assert "geqrf" not in hlo and "householder" not in hlo.lower()


def test_lowrank_full_energy_recovers_a_rank_2_matrix():
  rng = np.random.default_rng(1)
  m = (rng.standard_normal((12, 2)) @ rng.standard_normal((2, 9))
       ).astype(np.float32)
  codec = _codec("lowrank", rank_max=4, energy=1.0)
  state = codec.init_state(m)
  for _ in range(3):  # warm-started rounds on the same matrix
    payload, state = codec.encode(m, state)
  np.testing.assert_allclose(codec.decode(payload, m.shape), m, atol=1e-5)
  assert int(payload["rank"]) == 4  # energy 1: always rank_max
  assert float(codec.payload_bytes(payload, m.shape)) == (12 + 9) * 4 * 4 + 4


def test_lowrank_adaptive_rank_is_1_on_a_rank_1_matrix():
  rng = np.random.default_rng(2)
  m = np.outer(rng.standard_normal(8), rng.standard_normal(6)).astype(
      np.float32).reshape(8, 2, 3)  # viewed as [8, 6]
  codec = _codec("lowrank", rank_max=4, energy=0.9)
  payload, _ = codec.encode(m, codec.init_state(m))
  assert int(payload["rank"]) == 1
  np.testing.assert_allclose(codec.decode(payload, m.shape), m, atol=1e-5)
  assert float(codec.payload_bytes(payload, m.shape)) == (8 + 6) * 1 * 4 + 4


def test_lowrank_int8_factors_golden():
  # x = a b^T with a = [3, 4], b = [0.8, -2, 0.6]: rank 1, so P = a / 5 =
  # [0.6, 0.8] and Q = x^T P = 5 b = [4, -10, 3], up to one common sign.
  # Blocks of 2 per factor column: P's scale 0.8 / 127, codes
  # round(95.25) = 95 and 127; Q's blocks [4, -10] (scale 10 / 127, codes
  # round(50.8) = 51, -127) and [3] (scale 3 / 127, code 127).
  codec = _codec("lowrank", rank_max=1, factor_bits=8, block_size=2)
  x = np.outer([3.0, 4.0], [0.8, -2.0, 0.6])
  sent, payload = _round_trip(codec, x)
  sign = np.sign(payload["p_code"][0, 0])
  np.testing.assert_array_equal(sign * payload["p_code"], [[95, 127]])
  np.testing.assert_array_equal(sign * payload["q_code"], [[51, -127, 127]])
  np.testing.assert_allclose(payload["p_scale"], [[0.8 / 127]], rtol=1e-5)
  np.testing.assert_allclose(payload["q_scale"], [[10 / 127, 3 / 127]],
                             rtol=1e-5)
  np.testing.assert_allclose(
      sent, np.outer([95 * 0.8 / 127, 0.8], [51 * 10 / 127, -10, 3]),
      rtol=1e-5)
  # The rank (4 B); P: 2 codes + 1 scale; Q: 3 codes + 2 scales.
  assert float(codec.payload_bytes(payload, x.shape)) == 4 + 6 + 11


def test_lowrank_int4_factors_send_8x_fewer_bytes_at_the_same_rank():
  x = np.random.default_rng(9).standard_normal((64, 64)).astype(np.float32)
  def sent_and_bytes(bits):
    codec = _codec("lowrank", rank_max=8, energy=1.0, factor_bits=bits,
                   block_size=64)
    sent, payload = _round_trip(codec, x)
    return sent, float(codec.payload_bytes(payload, x.shape))
  exact, float_bytes = sent_and_bytes(0)
  sent, int4_bytes = sent_and_bytes(4)
  # Per factor 8 columns of 64 nibbles + one scale each; + the rank.
  assert int4_bytes == 2 * (8 * 32 + 8 * 4) + 4
  assert float_bytes == (64 + 64) * 8 * 4 + 4
  assert 7 < float_bytes / int4_bytes < 8
  # The rounding adds little to the rank-8 approximation's own error.
  err = lambda s: np.linalg.norm(s - x) / np.linalg.norm(x)
  assert err(sent) < err(exact) + 0.02
  with pytest.raises(ValueError, match="factor_bits must be"):
    _codec("lowrank", factor_bits=2)


@pytest.mark.parametrize("name", ALL)
def test_error_feedback_loses_nothing_over_rounds(name):
  codec = _codec(name, error_feedback=True)
  rng = np.random.default_rng(3)
  rounds = [{"s": {"w": rng.standard_normal((2, 5, 7)).astype(np.float32),
                   "b": rng.standard_normal((2, 7)).astype(np.float32)}}
            for _ in range(4)]
  residuals = compress_apply.init_residuals(rounds[0])
  states = compress_apply.init_states(codec, rounds[0])
  step = jax.jit(lambda c, r, s: compress_apply.compress_tree(codec, c, r, s))
  total_sent = jax.tree.map(np.zeros_like, rounds[0])
  for c in rounds:
    sent, residuals, states, _ = step(c, residuals, states)
    total_sent = jax.tree.map(np.add, total_sent, sent)
  want = jax.tree.map(lambda *xs: sum(xs), *rounds)
  got = jax.tree.map(np.add, total_sent, residuals)
  jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, atol=1e-5),
               got, want)


def test_payload_bytes_ratios():
  shape, n = (64, 64), 4096
  x = np.random.default_rng(4).standard_normal(shape).astype(np.float32)
  def nbytes(name, **changes):
    codec = _codec(name, **changes)
    return float(codec.payload_bytes(_round_trip(codec, x)[1], shape))
  assert nbytes("none") == 4 * n
  # int8: one byte a value + one float32 scale per 256 values: 3.94x.
  assert nbytes("int8", block_size=256) == n + 4 * (n // 256)
  # int4 / e3m0: two values a byte + the scales: 7.76x.
  assert nbytes("int4", block_size=256) == n // 2 + 4 * (n // 256)
  assert nbytes("e3m0", block_size=256) == n // 2 + 4 * (n // 256)
  assert 3.9 < 4 * n / nbytes("int8", block_size=256) < 4
  assert 7.7 < 4 * n / nbytes("int4", block_size=256) < 8
  # topk 1%: k = round(40.96) = 41 indices (4 B) + ceil(41 / 4) B + 2 scales.
  assert nbytes("topk", topk_fraction=0.01) == 41 * 4 + 11 + 8
  # strided 1/8 in blocks of 256: 2 bits a sent entry + 2 float32 scales
  # per block + the phase: 113.8x fewer.
  assert nbytes("strided", stride=8, block_size=256) == 512 // 4 + 2 * 8 + 4
  assert 110 < 4 * n / nbytes("strided", stride=8, block_size=256) < 115
  # lowrank at energy 1: the full width, (m + n) r floats + the rank.
  assert nbytes("lowrank", rank_max=8, energy=1.0) == (64 + 64) * 8 * 4 + 4


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("shape", [(5, 7), (35,), (3, 1, 4)])
def test_trim_is_lossless_and_counts_the_bytes(name, shape):
  codec = _codec(name)
  x = np.random.default_rng(5).standard_normal(shape).astype(np.float32)
  x.reshape(-1)[:8] = 0.0  # a zero block, and a matrix not of full rank
  sent, payload = _round_trip(codec, x)
  trimmed = codec.trim(payload)
  np.testing.assert_array_equal(codec.decode_trimmed(trimmed, shape), sent)
  assert all(isinstance(v, np.ndarray | np.generic) for v in trimmed.values())
  wire = sum(np.asarray(v).nbytes for v in trimmed.values())
  assert wire == float(codec.payload_bytes(payload, shape))


@pytest.mark.parametrize("name", ALL)
def test_compress_tree_jits_over_workers(name):
  codec = _codec(name)
  rng = np.random.default_rng(6)
  num_workers = 3
  contribs = {"a": {"w": rng.standard_normal((num_workers, 4, 6)),
                    "b": rng.standard_normal((num_workers, 6))},
              "e": rng.standard_normal((num_workers, 2, 3, 5))}
  contribs = jax.tree.map(lambda x: x.astype(np.float32), contribs)
  states = compress_apply.init_states(codec, contribs) if codec.stateful else None
  sent, residuals, states, bytes_w = jax.jit(
      lambda c, s: compress_apply.compress_tree(codec, c, None, s))(contribs, states)
  assert residuals is None
  assert bytes_w.shape == (num_workers,) and bytes_w.dtype == jnp.float32
  # Each worker alone, leaf by leaf: the same.
  for w in range(num_workers):
    total = 0.0
    for path, x_w in jax.tree_util.tree_leaves_with_path(contribs):
      got, _, _, _, nbytes = compress_apply.compress_leaf(codec, x_w[w], None, None)
      np.testing.assert_allclose(got, _leaf_at(sent, path)[w], atol=1e-5)
      total += float(nbytes)
    assert math.isclose(float(bytes_w[w]), total, rel_tol=1e-6)


def _leaf_at(tree, path):
  for key in path:
    tree = tree[key.key]
  return tree


@pytest.mark.parametrize("name", ALL)
def test_zero_stays_zero(name):
  codec = _codec(name, error_feedback=True)
  x = np.zeros((6, 5), np.float32)
  state, residual = codec.init_state(x), np.zeros_like(x)
  for _ in range(2):
    sent, residual, state, _, nbytes = compress_apply.compress_leaf(
        codec, x, residual, state)
    np.testing.assert_array_equal(sent, 0.0)
    np.testing.assert_array_equal(residual, 0.0)
    assert np.isfinite(float(nbytes))
  # After zeros, a real contribution still goes through (lowrank's warm
  # start did not die).
  y = np.ones_like(x)
  sent, *_ = compress_apply.compress_leaf(codec, y, np.zeros_like(x), state)
  assert np.isfinite(sent).all() and np.abs(sent).sum() > 0


def test_spec_from_config_and_bad_specs():
  cfg = ml_collections.ConfigDict(dict(
      compression="lowrank", error_feedback=True, compression_rank_max=8))
  spec = compress.spec_from_config(cfg)
  assert spec == Spec("lowrank", error_feedback=True, rank_max=8)
  # Every per-leaf codec is tested here; lowrank_shared and leader_topk,
  # which encode a module's users together, in test_compress_shared.py and
  # test_compress_leader.py.
  assert set(compress.NAMES) - {"lowrank_shared", "leader_topk"} == {
      spec.name for spec in SPECS.values()}
  for together in (Spec("lowrank_shared"), Spec("leader_topk", topk_chunk=8)):
    with pytest.raises(ValueError, match="users together"):
      compress.make_codec(together).encode(np.ones((4, 4)), {})
  with pytest.raises(ValueError, match="topk_chunk > 0"):
    compress.make_codec(Spec("leader_topk"))
  with pytest.raises(ValueError, match="unknown"):
    compress.make_codec(Spec("fp8"))
  with pytest.raises(ValueError):
    compress.make_codec(Spec("lowrank", rank_min=4, rank_max=2))


def _eigh_batch_sizes(hlo: str) -> list[int]:
  """The batch of every LAPACK eigh call in a lowered CPU module: its
  operand's leading dims (1 for a lone [R, R] matrix)."""
  sizes = []
  for line in hlo.splitlines():
    call = re.search(r"custom_call @lapack_\w*syevd\w*\(.* : \(tensor<([0-9x]+)"
                     r"xf32>\)", line)
    if call:
      dims = [int(d) for d in call.group(1).split("x")]
      sizes.append(math.prod(dims[:-2]))
  return sizes


def test_lowrank_calls_lapack_eigh_one_matrix_at_a_time():
  # jaxlib 0.10's batched CPU eigh deadlocks like QR did: on CPU the
  # workers' (and any outer) vmap must not batch it.
  if jax.default_backend() != "cpu":
    pytest.skip("the CPU lowering is what this checks")
  codec = _codec("lowrank", rank_max=4, energy=0.9)
  x_VxWxMxN = jnp.ones((3, 2, 12, 9))
  state = jax.vmap(jax.vmap(codec.init_state))(x_VxWxMxN)
  encode = jax.jit(jax.vmap(jax.vmap(codec.encode)))
  hlo = encode.lower(x_VxWxMxN, state).as_text()
  assert _eigh_batch_sizes(hlo) and set(_eigh_batch_sizes(hlo)) == {1}
  # Same results as the batched call, matrix by matrix.
  rng = np.random.default_rng(5)
  a_BxRxR = rng.standard_normal((3, 4, 5, 5)).astype(np.float32)
  gram_BxRxR = jnp.asarray(a_BxRxR @ np.swapaxes(a_BxRxR, -1, -2))
  mine = jax.jit(jax.vmap(jax.vmap(compress_lowrank.eigh_one_at_a_time)))(
      gram_BxRxR)
  theirs = jnp.linalg.eigh(gram_BxRxR)
  for a, b in zip(mine, theirs):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
