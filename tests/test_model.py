"""Model: shapes, causality, path composition, remat, shardings."""

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dipaco_jax import paths as paths_lib
from dipaco_jax import testing
from dipaco_jax.model import layers
from dipaco_jax.model import transformer

DIMS = layers.ModelDims(vocab_size=97, num_layers=4, d_model=32, num_heads=2,
                        head_dim=16, mlp_dim=64, dtype="float32")


def _init(model, tokens):
  return nn.unbox(model.init(jax.random.key(0), tokens)["params"])


def test_logits_shape_and_finite():
  model = transformer.build_model(DIMS, paths_lib.build_topology(4, (2, 2)))
  tokens = jnp.ones((3, 11), jnp.int32)
  logits = model.apply({"params": _init(model, tokens)}, tokens)
  assert logits.shape == (3, 11, 128)  # vocab padded to 128
  assert np.all(np.asarray(logits)[..., 97:] < -1e8)
  assert np.isfinite(np.asarray(logits)).all()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_causal_future_tokens_never_change_earlier_logits(dtype):
  dims = layers.ModelDims(**{**DIMS.__dict__, "dtype": dtype})
  model = transformer.build_model(dims, paths_lib.build_topology(4, (1,)))
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 97, (2, 16)).astype(np.int32)
  params = _init(model, tokens)
  changed = tokens.copy()
  changed[:, 9:] = rng.integers(0, 97, (2, 7))
  a = np.asarray(model.apply({"params": params}, tokens), np.float32)
  b = np.asarray(model.apply({"params": params}, changed), np.float32)
  np.testing.assert_array_equal(a[:, :9], b[:, :9])
  assert np.abs(a[:, 9:] - b[:, 9:]).max() > 1e-3


def _dense_params_from_path(path_params, topology):
  """Concatenates the path's layer segments into one 4-layer stack."""
  stacks = [path_params[s.name]["blocks"] for s in topology.layer_slots]
  return {"embed_head": path_params["embed_head"],
          "layers_00_03": {"blocks": jax.tree.map(
              lambda *xs: jnp.concatenate(xs), *stacks)}}


def test_path_composed_from_bank_equals_dense_model():
  config = testing.tiny_config("2x2", inner_steps=2)
  runtime = testing.tiny_runtime(config)
  state = runtime.init_state(jax.random.key(1))
  # Make the experts differ so that gathering the wrong one would show.
  bank = jax.tree.map(
      lambda x: x + 0.01 * jnp.arange(x.shape[0]).reshape(
          (-1,) + (1,) * (x.ndim - 1)),
      jax.device_get(state["outer"]["params"]))
  dense_model = transformer.build_model(
      runtime.dims, paths_lib.build_topology(4, (1,)))
  tokens = np.random.default_rng(2).integers(0, 97, (2, 12)).astype(np.int32)
  for path in range(4):
    path_params = runtime.path_params(bank, path)
    ids = runtime.topology.path_level_ids(path)
    np.testing.assert_array_equal(
        path_params["layers_02_03"]["blocks"]["mlp"]["down"],
        bank["layers_02_03"]["blocks"]["mlp"]["down"][ids[1]])
    composed = runtime.model.apply({"params": path_params}, tokens)
    dense = dense_model.apply(
        {"params": _dense_params_from_path(path_params, runtime.topology)},
        tokens)
    np.testing.assert_allclose(composed, dense, rtol=1e-5, atol=1e-5)


def test_remat_and_unrolled_layers_give_the_same_logits():
  topology = paths_lib.build_topology(4, (1,))
  tokens = jnp.arange(24, dtype=jnp.int32).reshape(2, 12) % 97
  base = transformer.build_model(DIMS, topology)
  params = _init(base, tokens)
  want = base.apply({"params": params}, tokens)
  remat = transformer.build_model(
      layers.ModelDims(**{**DIMS.__dict__, "remat": "full"}), topology)
  np.testing.assert_allclose(remat.apply({"params": params}, tokens), want,
                             rtol=1e-6)
  unrolled = transformer.build_model(
      layers.ModelDims(**{**DIMS.__dict__, "scan_layers": False}), topology)
  blocks = params["layers_00_03"]["blocks"]
  unrolled_params = {"embed_head": params["embed_head"], "layers_00_03": {
      f"block_{i}": jax.tree.map(lambda x, i=i: x[i], blocks)
      for i in range(4)}}
  np.testing.assert_allclose(
      unrolled.apply({"params": unrolled_params}, tokens), want, rtol=1e-5,
      atol=1e-6)


def test_state_shardings_on_fake_8_device_mesh():
  assert jax.device_count() == 8
  config = testing.tiny_config("2x2", inner_steps=2)
  config.mesh.tensor = 2  # path=4 (auto), data=1, fsdp=1, tensor=2
  config.mesh.data = -1
  runtime = testing.tiny_runtime(config)
  assert dict(runtime.mesh.shape) == {"path": 4, "stage": 1, "data": 1,
                                      "fsdp": 1, "tensor": 2}
  state = runtime.init_state(jax.random.key(0))
  inner = state["inner"]["params"]
  gate_up = inner["layers_00_01"]["blocks"]["mlp"]["gate_up"]
  assert gate_up.shape == (4, 2, 32, 2, 64)  # [W, layers, D, 2, F]
  # Layers go on the pipeline's `stage` axis (size 1 here: not split).
  assert gate_up.sharding.spec == P("path", "stage", "fsdp", None, "tensor")
  assert inner["embed_head"]["embedding"].sharding.spec == P(
      "path", "tensor", "fsdp")
  bank = state["outer"]["params"]
  assert bank["layers_00_01"]["blocks"]["mlp"]["gate_up"].shape[0] == 2
  assert bank["embed_head"]["head"].sharding.spec == P(None, "fsdp",
                                                       "tensor")
  # Each device holds one worker's half of the MLP.
  shard = gate_up.addressable_shards[0].data
  assert shard.shape == (1, 2, 32, 2, 32)
  assert inner["embed_head"]["embedding"].shape == (4, 128, 32)
  # AdamW moments are sharded like the parameters they belong to.
  mu = jax.tree.leaves(state["inner"]["opt_state"],
                       is_leaf=lambda x: hasattr(x, "mu"))
  adam = [x for x in mu if hasattr(x, "mu")][0]
  assert adam.mu["layers_00_01"]["blocks"]["mlp"]["gate_up"].sharding == (
      gate_up.sharding)


def test_tied_embeddings_share_the_table_and_stay_causal():
  dims = layers.ModelDims(**{**DIMS.__dict__, "tie_embeddings": True})
  model = transformer.build_model(dims, paths_lib.build_topology(4, (1,)))
  tokens = jnp.arange(24, dtype=jnp.int32).reshape(2, 12) % 97
  params = _init(model, tokens)
  assert "head" not in params["embed_head"]
  logits = model.apply({"params": params}, tokens)
  assert logits.shape == (2, 12, 128) and np.isfinite(logits).all()
  bumped = jax.tree.map(lambda x: x, params)
  bumped["embed_head"]["embedding"] = params["embed_head"]["embedding"].at[
      5].add(1.0)  # token 5's row: both its input vector and its logit
  changed = model.apply({"params": bumped}, tokens)
  assert np.abs(np.asarray(changed - logits)[..., 5]).max() > 1e-3


def test_paper_config_paths_have_150m_parameters():
  from dipaco_jax import config_base  # pylint: disable=g-import-not-at-top
  config = config_base.load_experiment(
      os.path.join(os.path.dirname(__file__), "..", "experiments",
                   "paper_dipaco_16x16_c4.py"))
  dims = layers.dims_from_config(config.model, config.data.vocab_size)
  topology = paths_lib.build_topology(12, (16, 16), (6, 6))
  model = transformer.build_model(dims, topology)
  shapes = jax.eval_shape(model.init, jax.random.key(0),
                          jnp.zeros((1, 8), jnp.int32))["params"]
  count = sum(int(np.prod(x.value.shape)) for x in jax.tree.leaves(
      shapes, is_leaf=lambda x: hasattr(x, "value")))
  assert 145e6 < count < 155e6, count  # the paper: 150M per path


def test_swiglu_backward_concatenates_instead_of_padding():
  # The MLP's fused gate/up output is split, not indexed twice: its
  # backward concatenates the halves' cotangents rather than padding each
  # to the full [B, L, 2, F] and adding them (an extra pass over HBM per
  # layer on the GPU). The numbers are those of the two indexings.
  dims = layers.ModelDims(**{**DIMS.__dict__, "dtype": "bfloat16"})
  mlp = layers.GatedMlp(dims)
  x = jax.random.normal(jax.random.key(1), (2, 8, 32)).astype(jnp.bfloat16)
  params = nn.unbox(mlp.init(jax.random.key(0), x))

  def split_loss(p):
    return jnp.sum(mlp.apply(p, x).astype(jnp.float32) ** 2)

  def indexed_loss(p):
    h = jnp.einsum("bld,dtf->bltf", x,
                   p["params"]["gate_up"].astype(jnp.bfloat16))
    h = jax.nn.silu(h[:, :, 0]) * h[:, :, 1]
    out = jnp.einsum("blf,fd->bld", h,
                     p["params"]["down"].astype(jnp.bfloat16))
    return jnp.sum(out.astype(jnp.float32) ** 2)

  backward = str(jax.make_jaxpr(jax.grad(split_loss))(params))
  assert "concatenate" in backward and " pad" not in backward
  want = jax.jit(jax.grad(indexed_loss))(params)
  got = jax.jit(jax.grad(split_loss))(params)
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_array_equal(np.asarray(b, np.float32),
                                  np.asarray(a, np.float32))
