"""The full, documented default config that every experiment starts from.

Experiments in `experiments/` call `base_config()` and override fields; the
command line overrides them again (`--config.model.num_layers=4`). Every field
is commented here once; `validate()` checks every field (type, choices,
range) and the cross-field constraints before any compute so that a bad
config fails in a second, not an hour in.

Layers: `config_fields` (the error, the per-field rules and parsers) is the
bottom; the modules whose own rules `validate()` runs (diloco.comm,
model.pipelined, parallel.mesh, train.profiling) import it, never this
module; this module calls them from `validate()` (imported there: they
import JAX, which experiment files need not).
"""

import importlib.util
import math
import pathlib

import ml_collections

from dipaco_jax import config_fields

# Logical axis name -> mesh axes. Parameters and activations carry logical
# names (dipaco_jax.model.layers); these rules place them on the mesh
# `path x stage x data x fsdp x tensor`; data, not code, for sweeps.
DEFAULT_SHARDING_RULES = (
    ("workers", "path"),  # leading path/replica axis of inner state
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv", None),
    ("vocab", "tensor"),
    # Pipeline stages (model/pipelined.py) own their layers' parameters and
    # optimizer states. A no-op while the stage axis has size 1.
    ("layers", "stage"),
    ("experts", None),  # leading expert axis of the outer module bank
    ("length", None),
    ("act_embed", None),
)

# The mesh axes, in order (config_fields.MESH_AXES, where parallel/mesh.py
# reads them).
MESH_AXES = config_fields.MESH_AXES


def base_config() -> ml_collections.ConfigDict:
  """Returns the default config: a tiny dense model on the stdlib corpus."""
  c = ml_collections.ConfigDict()
  c.seed = 0  # Seeds init, data order and routing (not the data stage).

  # --- Data (dipaco_jax.data) -------------------------------------------
  c.data = ml_collections.ConfigDict()
  c.data.corpus = "python_stdlib"  # python_stdlib | text_files | c4
  c.data.text_glob = ""  # text_files: glob of .txt / .jsonl files.
  c.data.text_field = "text"  # text_files: the field of each .jsonl line.
  c.data.max_doc_chars = 4000  # Longer files become several documents.
  c.data.max_corpus_chars = 0  # 0 = whole corpus; else a deterministic cap.
  c.data.validation_fraction = 0.05  # Share of files held out (by hash).
  # For choosing settings: the validation files are left out and the same
  # share of the training files is held out and scored instead (another
  # hash), so the real validation set is never looked at while choosing.
  c.data.selection_split = False
  c.data.max_documents = 0  # c4 only: documents read per split (0 = all).
  c.data.vocab_size = 4096  # SentencePiece vocabulary trained on train split.
  c.data.tokenizer_model = ""  # Use this .model file instead of training.
  c.data.tokenizer_max_sentences = 200_000  # Lines fed to the trainer.
  c.data.seq_len = 256  # Training sequence length (tokens).
  c.data.prefix_len = 32  # Routing context; never scored in evaluation.
  c.data.prefetch = 2  # Batches prepared ahead by a host thread.

  # --- Model (dipaco_jax.model) -----------------------------------------
  c.model = ml_collections.ConfigDict()
  c.model.num_layers = 4  # Transformer blocks.
  c.model.d_model = 128  # Residual stream width.
  c.model.num_heads = 4  # Attention heads.
  c.model.head_dim = 32  # Width of each head.
  c.model.mlp_dim = 512  # Gated (SwiGLU) hidden width.
  c.model.rope_base = 10_000.0  # RoPE wavelength base.
  c.model.dtype = "bfloat16"  # Compute dtype; parameters stay float32.
  c.model.attention = "auto"  # auto (cudnn: GPU and 16-bit) | xla | cudnn
  c.model.remat = "none"  # none | full | dots (save matmul outputs)
  c.model.scan_layers = True  # Stack each segment's layers on one axis.
  c.model.scan_unroll = 0  # Layers per scan iteration; 0 = fully unrolled
  #                          (fastest step), 1 = rolled (fastest compile).
  c.model.init_std = 0.02  # Std of the normal initializer.
  c.model.tie_embeddings = False  # One table for input embedding and head.
  # The training loss's logits in chunks of this many positions per row
  # (model/chunked_loss.py): no [B, L, V] float32 logits in memory, the
  # backward pass recomputes each chunk's. 0 = all at once (as before).
  c.model.loss_chunk = 0
  # The blocks' matmuls in FP8 with per-tensor current scaling
  # (model/fp8.py); needs an NVIDIA GPU of compute capability >= 8.9.
  c.model.fp8 = False

  # --- Paths: the module bank (dipaco_jax.paths) ------------------------
  c.paths = ml_collections.ConfigDict()
  c.paths.shape = "1x1"  # Experts per level: 1x1 dense, 2x2, 4x4, 2x2x2...
  c.paths.layers_per_level = ""  # e.g. "6,6"; empty = split layers evenly.
  c.paths.private_layers = ""  # e.g. "0,5,6,11": blocks owned by each path.
  c.paths.private_embedding = False  # Embedding + head owned by each path.
  c.paths.num_replicas = 1  # DiLoCo workers per path (8 for DiLoCo).

  # --- Dense base model the paths fork from (DiPaCo section 4) ------------
  c.base = ml_collections.ConfigDict()
  c.base.num_steps = 0  # Dense pretraining steps; 0 = paths start from init.
  c.base.batch_size = 0  # Its batch; 0 = train.batch_size.

  # --- Routing (dipaco_jax.routing), offline, on the first prefix_len tokens
  c.routing = ml_collections.ConfigDict()
  c.routing.method = "product_kmeans"  # product_kmeans | kmeans
  c.routing.features = "base_hidden"  # base_hidden | token_embedding
  c.routing.train_top_k = 2  # Overlapping shards: each doc to its top-k paths.
  c.routing.min_shard_fraction = 0.25  # Top up paths below this x mean.
  c.routing.router_fraction = 0.05  # Train docs held out for the router.
  c.routing.kmeans_iters = 50  # Lloyd iterations of each k-means fit.
  c.routing.kmeans_max_points = 65_536  # k-means fits on these (0 = all).
  c.routing.discriminative_steps = 0  # >0: discriminative phase, then these
  #                                    more inner steps on the new shards.
  c.routing.replica_shards = "iid"  # DiLoCo replicas: iid | kmeans

  # --- Evaluation ----------------------------------------------------------
  c.eval = ml_collections.ConfigDict()
  c.eval.reroute_every = 64  # Also score re-routing every N tokens (0: off).
  # With re-routing, also fit the learned window router on the router
  # documents (labels: each chunk's best path) and score its re-routing.
  c.eval.learned_reroute = True
  # The learned window router's target: expected_nll (the excess NLL of the
  # chosen path over the best one) | best_path (the paper's: each chunk
  # labelled with its best path); routing/router.py.
  c.eval.window_router_objective = "expected_nll"
  # Also write router/reroute_data_{router,validation}.npz: chunk features
  # and per-path chunk NLLs, for bench/window_router_study.py.
  c.eval.dump_reroute_data = False
  c.eval.early_stopping = False  # Keep each path's best snapshot (paper 2.7)
  c.eval.holdout_fraction = 0.05  # Training docs (whole files) held out.
  # Early stopping scores the paths after every N-th outer step (and the
  # last): with short rounds scoring is a large share of each (its cost:
  # docs/performance.md); a best is then picked among those steps only.
  c.eval.early_stopping_every = 1
  # Paths scored together, sharded over this process's devices (paths over
  # one axis, windows over the rest; eval/sharded.py). 0 = gcd(paths,
  # devices): one path per device of the path axis.
  c.eval.path_group = 0
  c.eval.block_tokens = 1 << 20  # Scored a block at a time (0 = all at once).
  # DiPaCo only (stages/dense_scaling.py): also train dense models of these
  # multiples of one path's non-embedding parameters ("2,4"; "" = none)
  # from scratch, for the steps a path takes in all, base included.
  c.eval.dense_scales = ""
  # DiPaCo only: also continue the one-path-size dense model from the base
  # for paths x path steps, so that it spends DiPaCo's training FLOPs.
  c.eval.dense_same_flops = False

  # --- Inner optimizer: AdamW per worker ---------------------------------
  c.inner_opt = ml_collections.ConfigDict()
  c.inner_opt.name = "adamw"  # adamw | sgd (sgd: for equivalence tests)
  c.inner_opt.learning_rate = 3e-3  # Peak, after warmup.
  c.inner_opt.warmup_steps = 20  # Linear warmup from 0.
  c.inner_opt.final_lr_fraction = 0.1  # Cosine decays to this x peak.
  c.inner_opt.b1 = 0.9  # AdamW first-moment decay.
  c.inner_opt.b2 = 0.95  # AdamW second-moment decay.
  c.inner_opt.weight_decay = 0.1  # AdamW's, on matrices (not norm scales).
  c.inner_opt.grad_clip = 1.0  # Global norm per worker; 0 disables.

  # --- Outer optimizer (DiLoCo, per module) -----------------------------
  c.diloco = ml_collections.ConfigDict()
  c.diloco.inner_steps = 0  # H. 0 = never sync (plain dense training).
  c.diloco.outer_optimizer = "nesterov"  # nesterov | sgd | adam
  c.diloco.outer_lr = 0.7  # Outer learning rate on the averaged delta.
  c.diloco.outer_momentum = 0.9  # Nesterov/SGD momentum, or Adam's b1.
  c.diloco.weight_by_shard_size = True  # Paper Eq. 2-3.
  c.diloco.rescale_by_sqrt_users = False  # Paper section 2.7 (multiply).
  # A recipe filling the communication fields below left at their defaults
  # (diloco/presets.py): streaming | dilocox | sparseloco; "" = none.
  c.diloco.preset = ""
  # DiLoCoX communication (diloco/comm.py, compress.py). The defaults are
  # plain DiLoCo/DiPaCo, hashed as before these fields existed.
  # none | one_round | naive | lookahead | eager | overlap
  c.diloco.delay = "none"
  # tau of delay=overlap (diloco/overlap_step.py): a round's outer step is
  # applied tau inner steps late, 1 <= tau <= H (H: one_round's rule); 0 =
  # unused (delay=overlap only takes it), so no default tau is hashed.
  c.diloco.overlap_steps = 0
  # none | int8 | int4 | e3m0 | lowrank | lowrank_shared | topk |
  # leader_topk (chunked, on one support per module a round) | strided
  c.diloco.compression = "none"
  c.diloco.error_feedback = False  # Keep what compression drops, per worker.
  c.diloco.compression_block_size = 256  # int codes (factors too): per scale.
  c.diloco.compression_rank_min = 1  # lowrank: lowest rank.
  # lowrank: highest rank; lowrank_shared: its (fixed) rank.
  c.diloco.compression_rank_max = 32
  c.diloco.compression_energy = 0.9  # lowrank: energy share kept.
  # lowrank: factor bits, 0 (float32) | 8 | 4 (int blocks: DiLoCoX's).
  c.diloco.compression_factor_bits = 0
  # lowrank, lowrank_shared: per_layer = each layer's weight alone (as
  # PowerSGD) | stacked = a slot's stacked layers as one matrix.
  c.diloco.compression_matrix = "stacked"
  c.diloco.compression_topk_fraction = 0.01  # topk: share of entries sent.
  # topk per chunk (indices inside it; SparseLoCo: 4096, 12-bit); 0 = one
  # top-k over the whole leaf, 32-bit indices.
  c.diloco.compression_topk_chunk = 0
  c.diloco.compression_stride = 8  # strided: 1 / stride of entries a round.
  # Chunked top-k's indices on the wire (lossless): fixed = log2(chunk)
  # bits each | elias_fano = about 2 + log2(chunk / k) bits each.
  c.diloco.compression_index_code = "fixed"
  # SparseLoCo's accumulator e <- decay * e + delta; 1 = plain feedback.
  c.diloco.error_feedback_decay = 1.0
  # How a module's users' decoded top-k contributions are averaged: senders
  # (each coordinate over the users that sent it, SparseLoCo's reference
  # aggregation) | mean (every user, its zeros included). Other codecs
  # always take the mean (docs/communication.md has the measurements).
  c.diloco.sparse_aggregate = "senders"
  # What workers read back: the new modules (none), or each one's change
  # since their copy, compressed (int8 | int4 | e3m0 | topk | strided; the
  # rest goes next round). Delay none or overlap; not on pipelined islands.
  c.diloco.download_compression = "none"
  c.diloco.download_topk_fraction = 0.0  # topk down's share; 0 = upload's.
  # Per-slot overrides "SELECTOR=key:value+key:value;..." by a slot's name
  # or kind (shared | level | private), e.g. "level=compression:int8".
  c.diloco.per_slot = ""

  # --- Training -----------------------------------------------------------
  c.train = ml_collections.ConfigDict()
  c.train.num_steps = 200  # Inner steps per worker.
  c.train.batch_size = 16  # Sequences per worker per step.
  c.train.log_every = 10  # Inner steps between progress lines.
  # Dispatches between one's dispatch and reading its metrics (loss, grad
  # norm) on the host; 1 reads each one's metrics while the next runs.
  # Measured: 2 changes nothing for DiPaCo 2x2 on 4 H100s
  # (docs/performance.md).
  c.train.metrics_lag = 1
  # Inner steps per jitted call (train/dispatch.py): > 1 pays the host's
  # work per call once per that many steps (small models on GPUs).
  c.train.steps_per_dispatch = 1
  # With steps_per_dispatch > 1: a path's layer slots merged into one
  # stacked leaf for the dispatch's steps (train/merged_slots.py), so AdamW
  # launches one kernel per layer leaf instead of one per slot and leaf.
  # The same update up to the clipping norm's summation order. On one
  # H100 at K = 10: DiPaCo 2x2 6.0% faster (docs/performance.md). Off by
  # default only because K is 1 by default.
  c.train.merge_layer_slots = False
  # The gradient's dtype (train/state.py `_worker_step`): bfloat16 is meant
  # to halve the bytes of the data-parallel all-reduce, at the cost of the
  # forward pass seeing bf16-rounded parameters and the gradient's own
  # rounding. Measured: no faster (dense.py on 2 H100s, 1.10x against
  # 1.09x in float32; docs/performance.md); on CPU XLA still reduces in
  # float32.
  c.train.grad_dtype = "float32"
  c.train.eval_batch_size = 32  # Sequences per evaluation batch.
  # "START:COUNT": trace inner steps START .. START + COUNT - 1 (numbered
  # as the progress lines) with jax.profiler into the run's logs/profile
  # (island workers: the store's logs/profile/worker_ID); "" = off
  # (train/profiling.py). Changes timing, never a number.
  c.train.profile_steps = ""
  # With profile_steps: also trace the host's Python calls (their stacks
  # name what the host did in a device gap, bench/trace_gaps.py; it adds
  # host time to each call). False: only XLA's own host events.
  c.train.profile_python = True

  # --- Checkpoints --------------------------------------------------------
  c.ckpt = ml_collections.ConfigDict()
  c.ckpt.every = 100  # Inner steps between saves (0 = only the last step).
  c.ckpt.keep = 2  # Checkpoints kept.
  c.ckpt.async_save = True  # Write checkpoints in the background.
  # SIGTERM/SIGINT (preemption): save at the current step's end and exit
  # 75, within this many seconds (what cloud VMs get), else without it.
  c.ckpt.preemption_grace_s = 30.0

  # --- Pipeline stages inside a worker (model/pipelined.py) --------------
  # Stage s holds the s-th n/S layers of every layer segment; only the inner
  # step is pipelined. Bubble: (S-1)/(M+S-1) of a step (gpipe).
  c.pipeline = ml_collections.ConfigDict()
  c.pipeline.stages = 1  # S; 1 = no pipeline (the plain step, exactly).
  c.pipeline.microbatches = 1  # M >= S; each is train.batch_size / M rows.
  # gpipe: each layer segment (slot) its own pipeline; circular: all G
  # segments in one, microbatches going round G times (equal segments;
  # bubble (S-1)/(G M + S-1)).
  c.pipeline.schedule = "gpipe"

  # --- Mesh: path x stage x data x fsdp x tensor; one -1 takes the rest --
  c.mesh = ml_collections.ConfigDict()
  c.mesh.path = 0  # 0 = auto: gcd(workers, devices).
  c.mesh.stage = 0  # 0 = auto: pipeline.stages; 1: all stages everywhere.
  c.mesh.data = -1  # Data parallelism; -1 = the devices left.
  c.mesh.fsdp = 1  # Parameters and optimizer state sharded.
  c.mesh.tensor = 1  # Tensor (Megatron-style) parallelism.
  c.sharding_rules = DEFAULT_SHARDING_RULES
  return c


def load_experiment(path, relative_to: str | None = None):
  """`get_config()` of an experiment file; `relative_to` (a file) resolves a
  bare name like 'dense.py' next to it, so configs can build on each other."""
  path = pathlib.Path(path)
  if relative_to is not None:
    path = pathlib.Path(relative_to).with_name(path.name)
  spec = importlib.util.spec_from_file_location(path.stem, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


# The error of a bad config and the per-field rules live in
# config_fields.py; validate() below adds the rules across fields.
ConfigError = config_fields.ConfigError
_fail = config_fields.fail


# Parsers of single fields, in config_fields.py with the per-field rules
# (the modules that validate() calls use them too, and import config_fields,
# never this module).
parse_shape = config_fields.parse_shape
parse_int_list = config_fields.parse_int_list
num_workers_of = config_fields.num_workers_of


def validate(config: ml_collections.ConfigDict, num_devices: int) -> None:
  """Checks every field and the cross-field constraints; raises ConfigError
  naming the field."""
  config_fields.validate_fields(config)
  m, p, d, t = config.model, config.paths, config.data, config.train
  if d.corpus == "text_files" and not d.text_glob:
    _fail("data.text_glob", "corpus text_files needs a glob of .txt/.jsonl.")
  if m.attention == "cudnn" and m.dtype not in ("bfloat16", "float16"):
    _fail("model.attention", f"cudnn needs model.dtype 16-bit, not {m.dtype}")
  if d.seq_len <= d.prefix_len:
    _fail("data.seq_len", f"{d.seq_len} must exceed data.prefix_len "
          f"({d.prefix_len}), the routing context that is never scored.")
  levels = parse_shape(p.shape)
  layers_per_level = parse_int_list("paths.layers_per_level",
                                    p.layers_per_level)
  if layers_per_level:
    if len(layers_per_level) != len(levels):
      _fail("paths.layers_per_level", f"has {len(layers_per_level)} entries "
            f"but paths.shape {p.shape!r} has {len(levels)} levels.")
    if sum(layers_per_level) != m.num_layers or min(layers_per_level) < 1:
      _fail("paths.layers_per_level", f"{p.layers_per_level!r} must be "
            f"positive and sum to model.num_layers={m.num_layers}.")
  elif m.num_layers % len(levels):
    _fail("paths.shape", f"{len(levels)} levels do not split "
          f"model.num_layers={m.num_layers} evenly; set "
          "paths.layers_per_level.")
  private = parse_int_list("paths.private_layers", p.private_layers)
  if any(not 0 <= i < m.num_layers for i in private):
    _fail("paths.private_layers", f"{p.private_layers!r} has a layer outside "
          f"[0, {m.num_layers}).")
  if p.num_replicas > 1 and math.prod(levels) > 1:
    _fail("paths.num_replicas", "replicas of DiPaCo paths are not supported "
          "yet: use one path (shape '1') for DiLoCo, or num_replicas=1.")
  num_workers = num_workers_of(config)
  if num_workers > 1 and config.diloco.inner_steps == 0:
    _fail("diloco.inner_steps", f"{num_workers} workers need H > 0, else "
          "shared modules never synchronize.")
  h = config.diloco.inner_steps
  if h and t.num_steps % h:
    _fail("train.num_steps", f"{t.num_steps} must be a multiple of "
          f"diloco.inner_steps={h}, so training ends on an outer step.")
  r = config.routing
  multi_path = math.prod(levels) > 1
  if h and multi_path and r.discriminative_steps % h:
    # The phase is a run of its own with these steps (pipeline.run_dipaco).
    _fail("routing.discriminative_steps", f"{r.discriminative_steps} must be "
          f"a multiple of diloco.inner_steps={h}, so the phase ends on an "
          "outer step.")
  if r.features == "base_hidden" and config.base.num_steps < 1 and multi_path:
    _fail("routing.features", "base_hidden needs a base model: set "
          "base.num_steps > 0, or routing.features=token_embedding.")
  if multi_path and r.router_fraction == 0 and (
      r.discriminative_steps > 0 or (config.eval.reroute_every > 0 and
                                     config.eval.learned_reroute)):
    _fail("routing.router_fraction", "the discriminative phase and the "
          "learned re-router are fit on held-out router documents: set it > 0 "
          "(e.g. 0.05), or turn them off (routing.discriminative_steps=0, "
          "eval.learned_reroute=False).")
  config_fields.check_dense_scales(config)
  # Imported here: they import jax, which config files need not. None of
  # them imports this module (tests/test_import_cycles.py).
  from dipaco_jax.diloco import comm as comm_lib  # pylint: disable=g-import-not-at-top
  from dipaco_jax.train import profiling  # pylint: disable=g-import-not-at-top
  comm_lib.check_config(config)
  profiling.parse_window(t.profile_steps)
  if t.merge_layer_slots and t.steps_per_dispatch < 2:
    _fail("train.merge_layer_slots", "merges once per dispatch: set "
          "train.steps_per_dispatch > 1 (e.g. 10), or turn it off.")
  if config.eval.early_stopping and multi_path and (
      config.eval.holdout_fraction == 0):
    _fail("eval.holdout_fraction", "per-path early stopping scores paths on "
          "held-out documents: set it > 0 (e.g. 0.05), or turn "
          "eval.early_stopping off.")
  from dipaco_jax.model import pipelined  # pylint: disable=g-import-not-at-top
  pipelined.check_config(config)
  from dipaco_jax.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  mesh = mesh_lib.resolve_mesh_shape(config, num_devices)
  if num_workers % mesh["path"]:
    _fail("mesh.path", f"{num_workers} workers (paths x replicas) must be "
          f"divisible by mesh.path={mesh['path']}.")
  batch_shards = mesh["data"] * mesh["fsdp"]
  if t.batch_size % batch_shards:
    _fail("train.batch_size", f"{t.batch_size} must be divisible by "
          f"mesh.data x mesh.fsdp = {batch_shards}.")
  pipelined.check_mesh(config, mesh)
