"""The low rank per layer (`diloco.compression_matrix=per_layer`): a leaf
that stacks L layers' weights [L, ...] is coded as L matrices, each
exactly as the codec codes that layer's weight alone (payload, state,
residual, bytes), for the per-worker and the shared low rank; the wire
round-trips layers of different ranks; and comm.py sets it on the slots
whose leaves stack layers, and only there."""

import dataclasses

import jax
import numpy as np
import pytest

from dipaco_jax import config_base
from dipaco_jax import paths as paths_lib
from dipaco_jax.diloco import comm as comm_lib
from dipaco_jax.diloco import compress
from dipaco_jax.diloco import compress_apply
from dipaco_jax.diloco import compress_shared

LAYERS = 3
EXPERTS_W = np.array([0, 0, 1])
A_WxK = np.array([[0.25, 0.0], [0.75, 0.0], [0.0, 1.0]], np.float32)


def _stack(seed, shape=(LAYERS, 6, 2, 5)):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("factor_bits", [0, 4])
def test_each_layer_is_coded_as_that_layer_alone(factor_bits):
  base = compress.CompressionSpec(name="lowrank", rank_max=3, energy=0.8,
                                  error_feedback=True,
                                  factor_bits=factor_bits, block_size=4)
  per_layer = compress.make_codec(dataclasses.replace(base, layer_axis=True))
  alone = compress.make_codec(base)
  x, residual = _stack(0), _stack(1)
  sent, res, state, _, nbytes = compress_apply.compress_leaf(
      per_layer, x, residual, None)
  assert state["q"].shape == (LAYERS, 10, 3)  # [6, 2, 5]: a 6 x 10 matrix
  total = 0.0
  for i in range(LAYERS):
    s, r, st, _, b = compress_apply.compress_leaf(alone, x[i], residual[i],
                                                  None)
    np.testing.assert_array_equal(sent[i], s)
    np.testing.assert_array_equal(res[i], r)
    np.testing.assert_array_equal(state["q"][i], st["q"])
    total += float(b)
  assert float(nbytes) == total
  # Stacked, the same leaf is one 18 x 10 matrix: other numbers.
  stacked_sent = compress_apply.compress_leaf(alone, x, residual, None)[0]
  assert not np.allclose(stacked_sent, sent)


def test_a_layers_vector_goes_whole():
  codec = compress.make_codec(compress.CompressionSpec(
      name="lowrank", rank_max=2, layer_axis=True))
  scale = _stack(2, (LAYERS, 7))
  sent, _, state, _, nbytes = compress_apply.compress_leaf(codec, scale,
                                                           None, None)
  np.testing.assert_array_equal(sent, scale)
  assert state == {} and float(nbytes) == 4 * scale.size


@pytest.mark.parametrize("factor_bits", [0, 4])
def test_the_wire_carries_layers_of_different_ranks(factor_bits):
  codec = compress.make_codec(compress.CompressionSpec(
      name="lowrank", rank_max=4, energy=0.9, factor_bits=factor_bits,
      block_size=4, layer_axis=True))
  rng = np.random.default_rng(3)
  # Layer 0 of rank 1, layer 1 of rank 4, layer 2 zero: three ranks.
  x = np.stack([np.outer(rng.standard_normal(8), rng.standard_normal(6)),
                rng.standard_normal((8, 6)), np.zeros((8, 6))]
               ).astype(np.float32)
  sent, _, _, payload, nbytes = compress_apply.compress_leaf(codec, x, None,
                                                             None)
  payload = jax.device_get(payload)
  assert len(set(payload["rank"].tolist())) == 2  # 1, 4, and 1 for zero
  trimmed = codec.trim(payload)
  assert "rank" not in trimmed and "rank_layer2" in trimmed
  wire_bytes = sum(np.asarray(v).nbytes for v in trimmed.values())
  assert wire_bytes == float(nbytes)
  # What the receiver decodes is what the sender counted as sent.
  np.testing.assert_array_equal(codec.decode_trimmed(trimmed, x.shape), sent)


def test_shared_low_rank_codes_each_layer_on_its_own_basis():
  base = compress.CompressionSpec(name="lowrank_shared", rank_max=2,
                                  error_feedback=True)
  codec = compress.make_codec(dataclasses.replace(base, layer_axis=True))
  c_W = _stack(4, (3, LAYERS, 6, 5))
  residual_W = _stack(5, (3, LAYERS, 6, 5))
  q_W = jax.vmap(codec.init_state)(c_W)["q"]
  assert q_W.shape == (3, LAYERS, 5, 2)
  sent, res, q, bytes_W = compress_shared.compress_leaf(
      dataclasses.replace(base, layer_axis=True), c_W, residual_W, q_W,
      A_WxK, EXPERTS_W)
  total_W = 0.0
  for i in range(LAYERS):
    s, r, qi, b = compress_shared.compress_leaf(
        base, c_W[:, i], residual_W[:, i], q_W[:, i], A_WxK, EXPERTS_W)
    np.testing.assert_array_equal(sent[:, i], s)
    np.testing.assert_array_equal(res[:, i], r)
    np.testing.assert_array_equal(q[:, i], qi)
    total_W = total_W + np.asarray(b)
  np.testing.assert_array_equal(bytes_W, total_W)
  # The means read inside the round: P and Q per layer.
  *_, read_W = compress_shared.compress_tree(
      dataclasses.replace(base, layer_axis=True), {"w": c_W},
      {"w": residual_W}, {"w": {"q": q_W}}, A_WxK, EXPERTS_W)
  np.testing.assert_array_equal(read_W, 4.0 * (6 + 5) * 2 * LAYERS)


@pytest.mark.parametrize("matrix,scan,expected", [
    ("per_layer", True, True), ("stacked", True, False),
    ("per_layer", False, False)])
def test_comm_sets_the_layer_axis_on_stacked_layer_slots(matrix, scan,
                                                         expected):
  config = config_base.base_config()
  config.diloco.compression = "lowrank"
  config.diloco.compression_matrix = matrix
  config.model.scan_layers = scan
  slots = paths_lib.topology_from_config(config).slots
  comms = comm_lib.comm_by_slot(config, slots)
  for slot in slots:
    assert comms[slot.name].spec.layer_axis == (expected and
                                                bool(slot.layers))
  config.diloco.compression = "topk"  # Top-k has no matrices.
  assert not any(c.spec.layer_axis for c in comm_lib.comm_by_slot(
      config, slots).values())
