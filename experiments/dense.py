r"""Dense baseline: one ~33M transformer (8 x 512) on the stdlib corpus.

Command (one H100/H200, about a minute after the data stage):
  python -m dipaco_jax.main --config=experiments/dense.py \
      --workdir=/tmp/dense
On a CPU, shrink it: --config.model.num_layers=2 --config.model.d_model=128
--config.model.mlp_dim=512 --config.train.num_steps=100
--config.data.max_corpus_chars=2000000 --config.model.dtype=float32.

The model matches a path of experiments/dipaco_4x4.py; experiments/diloco.py
builds on this file with a smaller model and a larger batch.
Expected result (H200, site-packages corpus capped at 150M characters,
docs/quality.md "DiLoCo vs synchronous"): validation perplexity about 21;
with --config.train.batch_size=64 about 6.9.
"""

from dipaco_jax import config_base


def get_config():
  c = config_base.base_config()
  c.data.vocab_size = 8192
  c.data.seq_len = 512
  c.data.max_doc_chars = 6000
  c.model.num_layers = 8
  c.model.d_model = 512
  c.model.num_heads = 8
  c.model.head_dim = 64
  c.model.mlp_dim = 2048
  c.inner_opt.learning_rate = 1e-3
  c.inner_opt.warmup_steps = 50
  c.base.num_steps = 500  # DiLoCo's setup: start from a pretrained model.
  c.base.batch_size = 8
  c.train.num_steps = 2000
  c.train.batch_size = 8
  c.train.log_every = 50
  c.train.eval_batch_size = 64
  c.ckpt.every = 500
  return c
