r"""DiPaCo 4x4 (16 paths of ~33M parameters) on the stdlib corpus, one GPU.

Command (one H100/H200):
  python -m dipaco_jax.main --config=experiments/dipaco_4x4.py \
      --workdir=/tmp/dipaco_4x4

Stages: dense base (300 steps) -> prefix features -> product k-means (4 x 4)
-> top-2 overlapping shards -> 16 paths x 500 inner steps, H = 50 -> routed
evaluation against the dense baseline continued for the same 500 steps
(re-routing every 64 tokens with a window router fit on held-out router
documents).
Expected result (H100, on the site-packages corpus of docs/quality.md):
validation perplexity routed once about 35.4, re-routed every 64 tokens by
the learned window router about 33.9, dense baseline about 44.8; with
`--config.eval.dense_scales=2,4 --config.eval.dense_same_flops=True`, dense
models of 2x and 4x a path's size about 41.8 and 42.1, and one path's size at
DiPaCo's training FLOPs about 8.6 (DiPaCo wins at equal steps, loses by
far at equal FLOPs); docs/quality.md ("DiPaCo vs dense") has the tables.
"""

from dipaco_jax import config_base


def get_config():
  c = config_base.base_config()
  c.data.vocab_size = 8192
  c.data.seq_len = 512
  c.data.max_doc_chars = 6000
  c.data.validation_fraction = 0.05
  c.model.num_layers = 8
  c.model.d_model = 512
  c.model.num_heads = 8
  c.model.head_dim = 64
  c.model.mlp_dim = 2048
  c.paths.shape = "4x4"
  c.base.num_steps = 300
  c.diloco.inner_steps = 50
  c.inner_opt.learning_rate = 1e-3
  c.inner_opt.warmup_steps = 50
  c.train.num_steps = 500
  c.train.batch_size = 8
  c.train.log_every = 50
  c.train.eval_batch_size = 64
  c.ckpt.every = 250
  return c
