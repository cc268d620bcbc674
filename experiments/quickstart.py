r"""Quickstart, the main job: DiPaCo 2x2 against a dense baseline on CPU.

Command (about 3.5 minutes on 2 CPU cores, the data stage included):
  python -m dipaco_jax.main --config=experiments/quickstart.py \
      --workdir=/tmp/dipaco_quickstart

What it runs, on the embedded corpus (the whole installed Python standard
library's source: 11,395 training documents, 13.3M tokens; 2% of the files
held out, 174 documents):
  tokenizer (SentencePiece, 1024 pieces) -> dense base, 200 steps ->
  prefix features (mean last hidden state over the first 32 tokens) ->
  product k-means 2 x 2 -> top-2 overlapping shards -> 4 paths forked from
  the base, 300 inner steps each, outer Nesterov every 50 steps -> routed
  evaluation against the dense base continued for the same 300 steps.

Expected result (2-core AMD EPYC CPU, 2026-11-29, seed 0, 204 s wall):
DiPaCo routed once per document 48.50 perplexity against 51.88 for the
dense baseline on the same 200,949 tokens (-6.5%): one path of a
dense-baseline size per document, at the baseline's inference cost, after
as many steps. `--config.seed=1`: 47.80 against 48.60 (183 s); seed 2:
47.48 against 49.31 (175 s) (docs/quality.md, "The main job on CPU",
also says how these settings were chosen). It spends 2.8x the
baseline's training FLOPs (the table says so; add
`--config.eval.dense_same_flops=True` for the dense model given as many).
Re-running the command reuses every finished stage.

`experiments/quickstart.py:small` is the quickstart before 2026-11-29
(3M characters, DiPaCo behind the dense baseline there: 58.47 against
54.94): the island, chaos and CPU-toy figures of the docs use it.
"""

from dipaco_jax import config_base

_SIZES = ("full", "small")


def get_config(size: str = "full"):
  """`size`: 'full' (the main job: the whole embedded corpus) or 'small'
  (the quickstart before 2026-11-29: 3M characters, 10% held out, the
  learned window router on; the island, chaos and CPU-toy figures of the
  docs were measured on it)."""
  if size not in _SIZES:
    raise ValueError(f"experiments/quickstart.py:{size}: the size must be "
                     f"one of {', '.join(_SIZES)}.")
  c = config_base.base_config()
  if size == "full":
    # More data a path is what puts DiPaCo ahead at this size (chosen on
    # data.selection_split, bench/main_job_selection.sh); 2% held out
    # (about 300k tokens) and no learned window router keep the job within
    # 4 minutes on 2 cores.
    c.data.max_corpus_chars = 0
    c.data.validation_fraction = 0.02
    c.eval.learned_reroute = False
  else:
    c.data.max_corpus_chars = 3_000_000
    c.data.validation_fraction = 0.1
  c.data.max_doc_chars = 3000
  c.data.vocab_size = 1024
  c.data.seq_len = 128
  c.model.num_layers = 4
  c.model.d_model = 64
  c.model.num_heads = 2
  c.model.head_dim = 32
  c.model.mlp_dim = 256
  c.model.dtype = "float32"  # CPUs have no fast bfloat16 matmuls.
  c.paths.shape = "2x2"
  c.base.num_steps = 200
  c.diloco.inner_steps = 50
  c.inner_opt.learning_rate = 3e-3
  c.inner_opt.warmup_steps = 20
  c.train.num_steps = 300
  c.train.batch_size = 8
  c.train.log_every = 25
  c.train.eval_batch_size = 32
  c.ckpt.every = 150
  return c
