"""Each config field on its own: its type, its range, its allowed values
(`validate_fields`; `eval.dense_scales` parsed and checked against the
layer count by `check_dense_scales`), and the one-line error of a config
that cannot run. `config_base.validate` runs these first, then the rules
across fields."""

import dataclasses
import math
import numbers

from dipaco_jax import errors


class ConfigError(errors.UserError, ValueError):
  """A config that cannot run; the message names the field and the fix.

  Still a ValueError, for callers that caught it as one before UserError."""


def fail(field: str, message: str):
  raise ConfigError(f"config.{field}: {message}")


# `stage` sits outside the data axes: a pipeline's activations between
# neighbours are far fewer bytes than data/fsdp/tensor traffic.
MESH_AXES = ("path", "stage", "data", "fsdp", "tensor")


@dataclasses.dataclass(frozen=True)
class _Range:
  """The allowed values of one numeric field of `base_config()`.

  `kind` is int (the value must be an integer) or float (any finite real).
  `low`/`high` are inclusive unless `low_open`/`high_open`; `why` is added to
  the message, so that it says what the value means, not only its bounds.
  """
  field: str
  kind: type
  low: float | None = None
  high: float | None = None
  low_open: bool = False
  high_open: bool = True
  why: str = ""

  def allows(self, value) -> bool:
    if self.low is not None and (value <= self.low if self.low_open
                                 else value < self.low):
      return False
    return self.high is None or (value < self.high if self.high_open
                                 else value <= self.high)

  def requirement(self) -> str:
    if self.high is None:
      return f"{'>' if self.low_open else '>='} {self.low:g}"
    return (f"in {'(' if self.low_open else '['}{self.low:g}, "
            f"{self.high:g}{')' if self.high_open else ']'}")


_I, _F = int, float
# Every numeric field of base_config(), with the range its code accepts. The
# sentinels documented next to each field (0 = off / all / auto) stay legal;
# ranges that depend on other fields are checked in validate() below.
_RANGES = (
    _Range("seed", _I, 0, why="NumPy's generators reject negative seeds"),
    _Range("data.max_doc_chars", _I, 1,
           why="longer files are cut into documents of this many characters"),
    _Range("data.max_corpus_chars", _I, 0, why="0 = the whole corpus"),
    _Range("data.validation_fraction", _F, 0, 1, low_open=True,
           why="every model is scored on this held-out share of the files"),
    _Range("data.max_documents", _I, 0, why="0 = the whole split"),
    _Range("data.vocab_size", _I, 260,
           why="the byte fallback and the special pieces need 260"),
    _Range("data.tokenizer_max_sentences", _I, 1),
    _Range("data.seq_len", _I, 2),
    _Range("data.prefix_len", _I, 1,
           why="routing features are computed on these first tokens"),
    _Range("data.prefetch", _I, 1,
           why="the batches a host thread prepares ahead; its queue holds "
           "at least one"),
    _Range("model.num_layers", _I, 1),
    _Range("model.d_model", _I, 1),
    _Range("model.num_heads", _I, 1),
    _Range("model.head_dim", _I, 1),
    _Range("model.mlp_dim", _I, 1),
    _Range("model.rope_base", _F, 1, low_open=True,
           why="the RoPE wavelength base (10000 is usual)"),
    _Range("model.scan_unroll", _I, 0, why="0 = fully unrolled, 1 = rolled"),
    _Range("model.init_std", _F, 0, low_open=True),
    _Range("model.loss_chunk", _I, 0,
           why="positions per chunk of the loss; 0 = the whole sequence"),
    _Range("paths.num_replicas", _I, 1, why="DiLoCo workers per path"),
    _Range("pipeline.stages", _I, 1, why="1 = no pipeline"),
    _Range("pipeline.microbatches", _I, 1,
           why="the pipeline's microbatches per step"),
    _Range("base.num_steps", _I, 0, why="0 = paths start from init"),
    _Range("base.batch_size", _I, 0, why="0 = train.batch_size"),
    _Range("routing.train_top_k", _I, 1,
           why="each document goes to its top-k paths (capped at the number "
           "of paths)"),
    _Range("routing.min_shard_fraction", _F, 0, 1, high_open=False,
           why="paths with fewer documents than this x the mean are topped up"),
    _Range("routing.router_fraction", _F, 0, 0.5,
           why="the share of training documents held out for the router"),
    _Range("routing.kmeans_iters", _I, 0),
    _Range("routing.kmeans_max_points", _I, 0, why="0 = every document"),
    _Range("routing.discriminative_steps", _I, 0,
           why="0 = no discriminative phase"),
    _Range("eval.reroute_every", _I, 0, why="0 = no re-routing"),
    _Range("eval.path_group", _I, 0, why="0 = one path per device"),
    _Range("eval.block_tokens", _I, 0, why="0 = the whole split at once"),
    _Range("eval.early_stopping_every", _I, 1,
           why="1 = score after every outer step"),
    _Range("train.metrics_lag", _I, 1),
    _Range("train.steps_per_dispatch", _I, 1, why="1 = one step per call"),
    _Range("eval.holdout_fraction", _F, 0, 0.5,
           why="the share of training files held out for early stopping"),
    _Range("inner_opt.learning_rate", _F, 0, low_open=True,
           why="a peak learning rate <= 0 does not train"),
    _Range("inner_opt.warmup_steps", _I, 0),
    _Range("inner_opt.final_lr_fraction", _F, 0, 1, high_open=False,
           why="the cosine decays to this fraction of the peak"),
    _Range("inner_opt.b1", _F, 0, 1, why="AdamW's first-moment decay"),
    _Range("inner_opt.b2", _F, 0, 1, why="AdamW's second-moment decay"),
    _Range("inner_opt.weight_decay", _F, 0),
    _Range("inner_opt.grad_clip", _F, 0, why="0 = no clipping"),
    _Range("diloco.inner_steps", _I, 0, why="H; 0 = never sync"),
    _Range("diloco.overlap_steps", _I, 0,
           why="tau of delay=overlap; 0 = not used"),
    _Range("diloco.outer_lr", _F, 0, low_open=True,
           why="outer SGD with 1.0 is plain averaging; <= 0 drops or reverses "
           "the workers' updates"),
    _Range("diloco.outer_momentum", _F, 0, 1,
           why="the Nesterov/SGD momentum or Adam's b1"),
    _Range("diloco.compression_block_size", _I, 1),
    _Range("diloco.compression_rank_min", _I, 1),
    _Range("diloco.compression_rank_max", _I, 1),
    _Range("diloco.compression_energy", _F, 0, 1, low_open=True,
           high_open=False, why="the share of the delta's energy kept"),
    _Range("diloco.compression_topk_fraction", _F, 0, 1, low_open=True,
           high_open=False, why="the share of entries sent"),
    _Range("diloco.download_topk_fraction", _F, 0, 1, high_open=False,
           why="the share of entries read back; 0 = the upload's"),
    _Range("diloco.compression_topk_chunk", _I, 0,
           why="entries per top-k chunk; 0 = one top-k per leaf"),
    _Range("diloco.compression_stride", _I, 1,
           why="strided: a round sends 1 / stride of the entries"),
    _Range("diloco.error_feedback_decay", _F, 0, 1, low_open=True,
           high_open=False, why="the residual's scale each round; 1 = keep "
           "all of it"),
    _Range("train.num_steps", _I, 1),
    _Range("train.batch_size", _I, 1),
    _Range("train.log_every", _I, 1),
    _Range("train.eval_batch_size", _I, 1),
    _Range("ckpt.every", _I, 0, why="0 = save only the last step"),
    _Range("ckpt.keep", _I, 1,
           why="keep=0 would delete every checkpoint, the final one included"),
    _Range("ckpt.preemption_grace_s", _F, 0.0),
)

_BOOL_FIELDS = (
    "model.scan_layers", "model.tie_embeddings", "model.fp8",
    "paths.private_embedding",
    "eval.learned_reroute", "eval.dump_reroute_data", "eval.early_stopping",
    "eval.dense_same_flops", "diloco.weight_by_shard_size",
    "diloco.rescale_by_sqrt_users", "diloco.error_feedback",
    "ckpt.async_save", "train.profile_python", "train.merge_layer_slots")

# String fields that take one of a few values (the others are free text).
_CHOICES = {
    "data.corpus": ("python_stdlib", "text_files", "c4"),
    "model.dtype": ("bfloat16", "float32"),
    "train.grad_dtype": ("float32", "bfloat16"),
    "pipeline.schedule": ("gpipe", "circular"),
    "model.attention": ("auto", "xla", "cudnn"),
    "model.remat": ("none", "full", "dots"),
    "routing.method": ("product_kmeans", "kmeans"),
    "routing.features": ("base_hidden", "token_embedding"),
    "routing.replica_shards": ("iid", "kmeans"),
    "eval.window_router_objective": ("expected_nll", "best_path"),
    "inner_opt.name": ("adamw", "sgd"),
    "diloco.outer_optimizer": ("nesterov", "sgd", "adam"),
    "diloco.delay": ("none", "one_round", "naive", "lookahead", "eager",
                     "overlap"),
    "diloco.compression": ("none", "int8", "int4", "e3m0", "lowrank",
                           "lowrank_shared", "topk", "leader_topk",
                           "strided"),
    "diloco.download_compression": ("none", "int8", "int4", "e3m0",
                                    "topk", "strided"),
    "diloco.sparse_aggregate": ("mean", "senders"),
    "diloco.compression_matrix": ("per_layer", "stacked"),
    "diloco.compression_index_code": ("fixed", "elias_fano"),
    "diloco.preset": ("", "streaming", "dilocox", "sparseloco"),
}


def _field(config, field: str):
  """`config` at a dotted path; a config not built on base_config() may lack
  a field, which would otherwise surface as a KeyError mid-run."""
  value = config
  for key in field.split("."):
    if not hasattr(value, "keys") or key not in value:
      fail(field, "is missing; start the config from "
            "config_base.base_config().")
    value = value[key]
  return value


def _check_number(rule: _Range, value) -> None:
  # bool is an int subclass: True must not pass as 1 step.
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    fail(rule.field, f"must be a number (got {value!r}).")
  if rule.kind is int and not isinstance(value, numbers.Integral):
    fail(rule.field, f"must be an integer (got {value!r}).")
  if not math.isfinite(value):
    fail(rule.field, f"must be finite (got {value!r}).")
  if not rule.allows(value):
    why = f"; {rule.why}" if rule.why else ""
    fail(rule.field, f"must be {rule.requirement()} (got {value!r}){why}.")


def validate_fields(config) -> None:
  """Each field on its own: types, enum values and numeric ranges. Runs
  first, so that a negative count is reported as such rather than through a
  cross-field rule it happens to break."""
  for field, choices in _CHOICES.items():
    value = _field(config, field)
    if value not in choices:
      fail(field, f"{value!r}: use {', '.join(choices[:-1])} or "
            f"{choices[-1]}.")
  for field in _BOOL_FIELDS:
    value = _field(config, field)
    if not isinstance(value, bool):
      fail(field, f"must be True or False (got {value!r}).")
  for rule in _RANGES:
    _check_number(rule, _field(config, rule.field))


def parse_scales(text: str) -> tuple[float, ...]:
  """`eval.dense_scales`: '2,4' -> (2.0, 4.0); '' -> ()."""
  if not text.strip():
    return ()
  try:
    return tuple(float(s) for s in text.split(","))
  except ValueError:
    fail("eval.dense_scales", f"{text!r} is not a comma-separated list of "
         "numbers such as '2,4'.")


def check_dense_scales(config) -> None:
  """The larger dense baselines get more layers (stages/dense_scaling.py),
  so every multiple must give a whole number of them."""
  scales = parse_scales(config.eval.dense_scales)
  if len(set(scales)) != len(scales):
    fail("eval.dense_scales", f"{config.eval.dense_scales!r} repeats a "
         "multiple; list each once.")
  layers = config.model.num_layers
  for s in scales:
    if not (math.isfinite(s) and s > 0 and
            abs(s * layers - round(s * layers)) < 1e-6):
      fail("eval.dense_scales", f"{s:g} x model.num_layers={layers} is not "
           "a positive whole number of layers; use multiples such as 2,4.")


def parse_shape(shape: str) -> tuple[int, ...]:
  """`paths.shape`: '2x4' -> (2, 4)."""
  try:
    sizes = tuple(int(s) for s in shape.lower().split("x"))
  except ValueError:
    fail("paths.shape", f"{shape!r} is not like '2x2' (experts per level).")
  if not sizes or any(s < 1 for s in sizes):
    fail("paths.shape", f"{shape!r}: every level needs at least 1 expert.")
  return sizes


def parse_int_list(field: str, text: str) -> tuple[int, ...]:
  """A field such as `paths.private_layers`: '0,5' -> (0, 5); '' -> ()."""
  if not text.strip():
    return ()
  try:
    return tuple(int(s) for s in text.split(","))
  except ValueError:
    fail(field, f"{text!r} is not a comma-separated list of integers.")


def num_workers_of(config) -> int:
  """Workers = paths x replicas: the leading axis of the inner state."""
  return math.prod(parse_shape(config.paths.shape)) * config.paths.num_replicas
