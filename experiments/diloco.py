r"""DiLoCo: 8 replicas of an ~8M model, H = 50, outer Nesterov 0.7 / 0.9,
with the two baselines of the DiLoCo paper as arms of the same config.

Commands (one H100/H200; the 8 replicas are vmapped on the one device):
  python -m dipaco_jax.main --config=experiments/diloco.py \
      --workdir=/tmp/diloco                       # DiLoCo, 8 replicas
  python -m dipaco_jax.main --config=experiments/diloco.py:one_replica \
      --workdir=/tmp/diloco_one                   # one replica, batch 32
  python -m dipaco_jax.main --config=experiments/diloco.py:sync_8x_batch \
      --workdir=/tmp/diloco_sync                  # synchronous, batch 256
All three fork from the same dense base (500 steps, batch 32) and run 3000
steps; `bash bench/diloco_runs.sh OUT` runs them sharing the data and base.

Expected result (H200, the full site-packages corpus of docs/quality.md,
116M training tokens): validation perplexity DiLoCo about 6.76, synchronous
8x batch about 6.81, one replica about 10.15. The regime matters: DiLoCo
matches or beats the 8x batch when each replica trains on several tokens per
parameter (here 49M tokens for 8.4M parameters), as in the DiLoCo paper; on
the ~33M model of dense.py with fewer tokens per parameter the 8x batch wins
(docs/quality.md, "DiLoCo vs synchronous", has every run). Non-i.i.d.
replica shards: --config.routing.replica_shards=kmeans.
"""

from dipaco_jax import config_base

_ARMS = ("diloco", "one_replica", "sync_8x_batch")


def get_config(arm: str = "diloco"):
  """`arm`: 'diloco' (8 replicas), or a baseline: 'one_replica' (the same
  batch per step), 'sync_8x_batch' (data parallel over the 8 replicas' batch)."""
  if arm not in _ARMS:
    raise ValueError(f"experiments/diloco.py:{arm}: the arm must be one of "
                     f"{', '.join(_ARMS)}.")
  c = config_base.load_experiment("dense.py", relative_to=__file__)
  c.model.num_layers = 4
  c.model.d_model = 256
  c.model.num_heads = 4
  c.model.head_dim = 64
  c.model.mlp_dim = 1024
  c.base.batch_size = 32
  c.train.num_steps = 3000
  c.train.batch_size = 32
  c.ckpt.every = 1000
  if arm == "diloco":
    c.paths.shape = "1"
    c.paths.num_replicas = 8
    c.diloco.inner_steps = 50
    c.routing.features = "token_embedding"  # only used for kmeans shards
  elif arm == "sync_8x_batch":
    c.train.batch_size = 8 * 32
  return c
