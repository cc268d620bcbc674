r"""Dense baseline: one small transformer on the embedded stdlib corpus.

Command (CPU, about 2 minutes on 2 cores):
  python -m dipaco_jax.main --config=experiments/dense.py \
      --workdir=/tmp/dipaco_dense

Expected: validation perplexity around 30-40 after 300 steps (tokens of a
4k SentencePiece vocabulary, first 32 tokens of each document not scored).
"""

from dipaco_jax import config_base


def get_config():
  c = config_base.base_config()
  c.data.max_corpus_chars = 3_000_000
  c.data.vocab_size = 4096
  c.data.seq_len = 256
  c.model.num_layers = 4
  c.model.d_model = 128
  c.model.num_heads = 4
  c.model.head_dim = 32
  c.model.mlp_dim = 512
  c.train.num_steps = 300
  c.train.batch_size = 16
  c.train.log_every = 25
  c.ckpt.every = 100
  return c
