r"""The DiPaCo paper's 16x16 setup on C4 (256 paths of ~150M), for TPU slices.

How it is spread (docs/paper_scale.md): as islands, the main job on a small
CPU VM and one worker per single-host TPU slice, each task a group of
--paths_per_task paths (at 1 a step's lower bound is under the HBM of
every slice on that page; 256 paths in one SPMD program need at least
11 TiB). Commands (C4 prepared with
TFDS in TFDS_DATA_DIR; the workers as in launch/tpu_islands.sh's header):
  python -m dipaco_jax.islands --config=experiments/paper_dipaco_16x16_c4.py \
      --workdir=gs://BUCKET/dipaco_16x16 --num_workers=0 --paths_per_task=1 \
      --config.eval.early_stopping=False
(islands refuse per-path early stopping, which the paper's 11.38 below
used). tests/test_paper_config.py runs this config so, at a tiny width,
on CPU: 256 paths, top-2 shards, C4 through TFDS's mock, groups of 64.

The paper's hyperparameters (Douillard et al. 2024, "DiPaCo: Distributed
Path Composition", arXiv:2403.10616, section 4 and appendix 7.1):
paths of 12 blocks, d_model 896, 16 heads of 64, 150M parameters (our
gated MLP of 2432 has the parameters of the paper's 4x MLP, 3584, and the
embedding is tied: 151.2M per path, checked by a test); SentencePiece
32k vocabulary trained on C4; a dense base pretrained 24k steps, then 64k
DiPaCo steps (88k in all); inner AdamW lr 4e-4, 1000 warmup steps, cosine,
weight decay 0.1, batch 512 x 1024 per path; outer Nesterov lr 0.7,
momentum 0.9; product k-means routing on the base's mean last hidden state
over the first 32 tokens; top-2 overlapping training shards; 0.5% of the
training documents held out for the discriminative routing phase (off here:
set routing.discriminative_steps > 0 to run it after the 64k steps, with
that many more steps; the paper runs it once, mid-training).
Choices where the paper is silent (BUILD_NOTES.md): H = 150 inner steps (the
paper's path-scaling experiment; the headline run's H is not stated), levels
of 6 + 6 blocks with everything shared but the experts (the paper does not
say whether its 16x16 used path-specific modules), outer gradients weighted
by shard size and not rescaled by sqrt(paths through a module).
Expected result (the paper, Table 3): validation perplexity 12.39 routed
once per document, 11.38 with early stopping and re-routing every 64 tokens
(its learned transformer re-router; ours is a linear window router fit on
the held-out router documents), against 16.23 for the dense 150M baseline.
Not yet run here at its size: C4 streams into token stores on disk (no
process holds the corpus; docs/paper_scale.md, "Per-host memory"), but
neither a TPU slice nor the whole of C4 was at hand.
"""

from dipaco_jax import config_base


def get_config():
  c = config_base.base_config()
  c.data.corpus = "c4"
  c.data.max_documents = 0  # Whole splits.
  c.data.vocab_size = 32_000
  c.data.tokenizer_max_sentences = 2_000_000
  c.data.max_doc_chars = 100_000  # C4 documents are kept whole.
  c.data.seq_len = 1024
  c.model.num_layers = 12
  c.model.d_model = 896
  c.model.num_heads = 16
  c.model.head_dim = 64
  c.model.mlp_dim = 2432  # Gated: 3 x 896 x 2432 ~ 2 x 896 x 3584.
  c.model.tie_embeddings = True
  c.model.remat = "dots"
  c.paths.shape = "16x16"
  c.paths.layers_per_level = "6,6"
  c.base.num_steps = 24_000
  c.base.batch_size = 512
  c.routing.method = "product_kmeans"
  c.routing.train_top_k = 2
  c.routing.router_fraction = 0.005
  c.routing.discriminative_steps = 0  # > 0: the phase, then these steps.
  c.inner_opt.learning_rate = 4e-4
  c.inner_opt.warmup_steps = 1000
  c.inner_opt.weight_decay = 0.1
  c.inner_opt.b2 = 0.95
  c.diloco.inner_steps = 150
  c.diloco.outer_lr = 0.7
  c.diloco.outer_momentum = 0.9
  c.train.num_steps = 64_050  # 427 rounds of H = 150 (the paper: 64k).
  c.train.batch_size = 512
  c.train.log_every = 50
  c.train.eval_batch_size = 64
  c.eval.early_stopping = True
  c.eval.holdout_fraction = 0.01
  c.ckpt.every = 1050
  c.ckpt.keep = 3
  c.mesh.path = 0  # auto: one group of devices per path where possible
  c.mesh.data = -1
  return c
