"""The chunked loss (`config.model.loss_chunk`) equals the plain
one: loss and gradient, tied and untied heads, a padded vocabulary, chunks
that do and do not divide the sequence; 0 is the plain code path bit for
bit; inner steps of the runtime agree.

Tolerances. In float32 every token's logits are the same operations either
way; only the order of the final sums differs: 1e-6 relative. In bfloat16
the head's weight gradient differs by rounding: unchunked, one matmul over
all tokens rounds it to bfloat16 once; chunked, each chunk's part is rounded
and the parts are summed in float32. That is up to about one bfloat16 ulp
(2^-8) of the largest entry: 1e-2 of the leaf's max; every other leaf
within 1e-6 (equal in practice: the same operations).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dipaco_jax import paths as paths_lib
from dipaco_jax import testing
from dipaco_jax.model import layers
from dipaco_jax.model import transformer
from dipaco_jax.stages import run_configs
from dipaco_jax.train import state as state_lib

SEQ = 24  # Chunks of 8 divide it, chunks of 7 leave 3.


@functools.cache
def _model(tie, dtype):
  # Vocabulary 97 pads to 128: the padding logits are masked.
  dims = layers.ModelDims(vocab_size=97, num_layers=1, d_model=32,
                          num_heads=2, head_dim=16, mlp_dim=64, dtype=dtype,
                          tie_embeddings=tie)
  model = transformer.build_model(dims, paths_lib.build_topology(1, (1,)))
  # Random parameters of the init's shapes: running the initializer itself
  # takes seconds on a small CPU. Norm scales near 1, the rest large
  # enough that the logits spread.
  shapes = jax.eval_shape(model.init, jax.random.key(0),
                          jnp.zeros((1, 8), jnp.int32))["params"]
  flat, tree = jax.tree.flatten(shapes, is_leaf=lambda x: hasattr(x, "value"))
  rng = np.random.default_rng(0)
  leaves = [rng.normal(1.0 if len(x.value.shape) == 1 else 0.0, 0.2,
                       x.value.shape).astype(np.float32) for x in flat]
  params = jax.tree.unflatten(tree, leaves)
  batch = rng.integers(0, 97, (4, SEQ + 1)).astype(np.int32)
  return model, params, batch


@functools.cache
def _loss_and_grad(tie, dtype, chunk):
  model, params, batch = _model(tie, dtype)
  fn = lambda p: state_lib.next_token_loss(model, p, batch, loss_chunk=chunk)
  return jax.jit(jax.value_and_grad(fn))(params)


def _max_relative_errors(grads, reference):
  flat = jax.tree_util.tree_flatten_with_path(grads)[0]
  return {jax.tree_util.keystr(path): float(
      jnp.max(jnp.abs(g - r)) / jnp.max(jnp.abs(r)))
          for (path, g), r in zip(flat, jax.tree.leaves(reference))}


# Each pair compiles two programs: the four combinations over two tests.
@pytest.mark.parametrize("tie,chunk", [(False, 8), (True, 7)],
                         ids=["untied-divides", "tied-remainder"])
def test_chunked_equals_plain_in_float32(tie, chunk):
  loss0, grads0 = _loss_and_grad(tie, "float32", 0)
  loss, grads = _loss_and_grad(tie, "float32", chunk)
  np.testing.assert_allclose(loss, loss0, rtol=1e-6)
  for leaf, error in _max_relative_errors(grads, grads0).items():
    assert error < 1e-6, leaf


@pytest.mark.parametrize("tie,chunk", [(False, 7), (True, 8)],
                         ids=["untied-remainder", "tied-divides"])
def test_chunked_equals_plain_in_bfloat16(tie, chunk):
  loss0, grads0 = _loss_and_grad(tie, "bfloat16", 0)
  loss, grads = _loss_and_grad(tie, "bfloat16", chunk)
  np.testing.assert_allclose(loss, loss0, rtol=1e-6)
  head = "['embed_head']['embedding']" if tie else "['embed_head']['head']"
  for leaf, error in _max_relative_errors(grads, grads0).items():
    assert error < (1e-2 if leaf == head else 1e-6), leaf


def _loss_before_chunking(model, params, batch):
  """The loss as written before the option existed (head inlined)."""
  d = model.dims
  inputs, targets = batch[:, :-1], batch[:, 1:]
  hidden = model.apply({"params": params}, inputs,
                       method=model.hidden_states)
  x = layers.RMSNorm(d).apply(
      {"params": params["embed_head"]["final_norm"]}, hidden)
  table = params["embed_head"]["embedding"] if d.tie_embeddings else None
  if table is not None:
    logits = jnp.einsum("bld,vd->blv", x, table.astype(d.compute_dtype))
  else:
    logits = jnp.einsum("bld,dv->blv", x,
                        params["embed_head"]["head"].astype(d.compute_dtype))
  real = jnp.arange(d.padded_vocab) < d.vocab_size
  logits = jnp.where(real, logits, jnp.asarray(-1e9, logits.dtype))
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), targets).mean()


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_zero_is_the_plain_loss_bit_for_bit(tie):
  model, params, batch = _model(tie, "bfloat16")
  loss, grads = _loss_and_grad(tie, "bfloat16", 0)
  ref_loss, ref_grads = jax.jit(jax.value_and_grad(
      lambda p: _loss_before_chunking(model, p, batch)))(params)
  np.testing.assert_array_equal(loss, ref_loss)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_array_equal(g, r)


def test_inner_steps_with_chunks_match_without():
  losses, params, initial = {}, {}, None
  for chunk in (0, 16):
    config = testing.tiny_config(num_steps=3)  # float32, seq_len 40
    config.model.num_layers = 2
    config.model.loss_chunk = chunk
    runtime = testing.tiny_runtime(config)
    if initial is None:  # One init program (slow to compile) for both.
      initial = runtime.init_state(jax.random.key(0))
    # The step donates its state: each run steps its own copy.
    state = jax.tree.map(jnp.copy, initial)
    batches = testing.RandomBatches(1, config.train.batch_size,
                                    config.data.seq_len)
    losses[chunk] = []
    for step in range(3):
      state, metrics = runtime.inner_step(
          state, runtime.worker_rows(batches.batch(step)))
      losses[chunk].append(np.asarray(metrics["loss"]))
    params[chunk] = jax.tree.leaves(state["inner"]["params"])
  np.testing.assert_allclose(losses[16], losses[0], rtol=1e-5)
  for a, b in zip(params[16], params[0]):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("field,value", [("loss_chunk", 64), ("fp8", True)])
def test_training_hash_changes_only_when_set(field, value):
  """Runs from before the speed options keep their hash (and checkpoints)."""
  config = testing.tiny_config()
  before = run_configs.training_hash(config)
  assert field not in run_configs.training_fields(config)["model"]
  config.model[field] = value
  assert run_configs.training_hash(config) != before
