r"""DiLoCo: 8 replicas of one ~33M model, H = 50, outer Nesterov 0.7 / 0.9.

Command (one H100/H200; the 8 replicas are vmapped on the one device):
  python -m dipaco_jax.main --config=experiments/diloco.py \
      --workdir=/tmp/diloco

Compare with experiments/dense.py (one replica, same steps) and with
synchronous data parallel over the same 8x batch:
  python -m dipaco_jax.main --config=experiments/dense.py \
      --config.train.batch_size=64 --workdir=/tmp/dense_8x
Expected result (H200, the site-packages corpus of BUILD_NOTES.md): about
9.1 validation perplexity, far better than one replica (about 21.1) but
behind synchronous training with the 8x batch (about 6.9) at this scale
(33M parameters, 40 outer steps); BUILD_NOTES.md has the table. Non-i.i.d. replica shards:
--config.routing.replica_shards=kmeans.
"""

from dipaco_jax import config_base


def get_config():
  c = config_base.load_experiment("dense.py", relative_to=__file__)
  c.paths.shape = "1"
  c.paths.num_replicas = 8
  c.diloco.inner_steps = 50
  c.routing.features = "token_embedding"  # only used for kmeans shards
  return c
