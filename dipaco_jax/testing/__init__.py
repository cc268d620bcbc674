"""Tiny configs and runtimes for tests (and for trying things in a shell)."""

import jax
import numpy as np

from dipaco_jax import config_base
from dipaco_jax import paths as paths_lib
from dipaco_jax.model import layers
from dipaco_jax.parallel import mesh as mesh_lib
from dipaco_jax.train import shared_runtime
from dipaco_jax.train import state as state_lib

TINY_VOCAB = 97


def tiny_config(shape="1x1", replicas=1, inner_steps=0, num_steps=8):
  c = config_base.base_config()
  c.paths.shape = shape
  c.paths.num_replicas = replicas
  c.diloco.inner_steps = inner_steps
  c.model.num_layers = 4
  c.model.d_model = 32
  c.model.num_heads = 2
  c.model.head_dim = 16
  c.model.mlp_dim = 64
  c.model.dtype = "float32"
  c.data.seq_len = 40
  c.data.vocab_size = 512
  c.train.num_steps = num_steps
  c.train.batch_size = 8
  c.inner_opt.warmup_steps = 2
  c.routing.features = "token_embedding"  # No base model in unit tests.
  return c


def tiny_runtime(config, vocab_size=TINY_VOCAB, weights_W=None,
                 devices=None, fresh=False):
  """The Runtime of `config`: the one built last for an equal config
  (`train/shared_runtime.py`: a resumed run and its uninterrupted twin
  trace their programs once), or with `fresh` a new one, for a test that
  changes it."""
  config_base.validate(config, len(devices or jax.devices()))
  topology = paths_lib.topology_from_config(config)
  dims = layers.dims_from_config(config.model, vocab_size)
  mesh = mesh_lib.make_mesh(config, devices)
  if weights_W is None:
    weights_W = np.ones(topology.num_workers)
  build = state_lib.Runtime if fresh else shared_runtime.runtime_for
  return build(config, topology, dims, mesh,
               np.asarray(weights_W, np.float64))


def comm_config(**diloco):
  """DiPaCo 2x2 with H = 2 over 8 steps, a checkpoint every 2, and the
  given `config.diloco` fields (the communication tests' run)."""
  config = tiny_config("2x2", inner_steps=2, num_steps=8)
  config.ckpt.every = 2
  config.ckpt.keep = 2
  for key, value in diloco.items():
    config.diloco[key] = value
  return config


def train_on_random_batches(config, run_dir, hooks=(), after_outer_step=()):
  """`train.loop.train` of `config`'s tiny runtime on RandomBatches."""
  from dipaco_jax.train import loop  # pylint: disable=g-import-not-at-top
  runtime = tiny_runtime(config)
  return loop.train(runtime, RandomBatches(
      runtime.topology.num_workers, 8, config.data.seq_len), str(run_dir),
                    {"h": "1"}, "t", hooks=hooks,
                    after_outer_step=after_outer_step)


class RandomBatches:
  """Deterministic random token batches [W, B, L+1] by step."""

  def __init__(self, num_workers, batch_size, seq_len, vocab_size=TINY_VOCAB,
               seed=0, salt_W=None):
    self.shape = (num_workers, batch_size, seq_len + 1)
    self.vocab_size, self.seed = vocab_size, seed
    self.salt_W = salt_W if salt_W is not None else np.zeros(num_workers,
                                                             np.int64)

  def batch(self, step, streams=None):
    streams = range(self.shape[0]) if streams is None else streams
    out = np.empty((len(streams),) + self.shape[1:], np.int32)
    for i, w in enumerate(streams):
      rng = np.random.default_rng([self.seed, w, int(self.salt_W[w]), step])
      out[i] = rng.integers(4, self.vocab_size, self.shape[1:])
    return out


class Preempted(Exception):
  """A kill in the middle of a training run (raised by `preempt_after`)."""


def preempt_after(step_to_die: int):
  """A training-loop hook that raises Preempted once step `step_to_die`'s
  metrics arrive (the checkpoints before it stay)."""
  def hook(step, state, losses_W):
    del state, losses_W
    if step == step_to_die:
      raise Preempted(step)
  return hook


def assert_resume_is_exact(train, tmp_path, die_after: int,
                           resumed_from: int):
  """`train(run_dir, hooks=...)` run straight, and killed after step
  `die_after` then run again in its directory: the second must resume from
  the checkpoint of step `resumed_from` and end on the same state, bit for
  bit. Returns that state on the host."""
  straight = jax.device_get(train(tmp_path / "straight").state)
  try:
    train(tmp_path / "resumed", hooks=[preempt_after(die_after)])
  except Preempted:
    pass
  else:
    raise AssertionError(f"the run ended before step {die_after}")
  resumed = train(tmp_path / "resumed")
  assert resumed.resumed_from == resumed_from, resumed.resumed_from
  state = jax.device_get(resumed.state)
  for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(state),
                  strict=True):
    np.testing.assert_array_equal(a, b)
  return state
