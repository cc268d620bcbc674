"""A lower bound on the memory a training step needs, checked before any
data is prepared, and one line when memory runs out anyway.

A config whose step cannot fit used to fail after the data stage, with a
64-line RESOURCE_EXHAUSTED traceback from XLA (or numpy's MemoryError for
the host batch). `check` estimates, from the config alone, what every
training run of the job needs at least, and refuses a run whose estimate
exceeds what the machine has: the smallest device's `bytes_limit`
(`device.memory_stats()`) against the estimate spread evenly over every
device of the job (all its processes'), or on CPU the host's available
memory against this host's share. An island run is checked as its tasks
train it: a group of paths on one worker's devices. The
estimate leaves out whatever it cannot be sure of (XLA's temporaries,
fragmentation, evaluation, the outer optimizer's extra state), so a
refused config surely does not fit; one that passes may still not, and
`out_of_memory_message` then says it in one line naming the same fields.

What is counted, for W workers (paths x replicas) of B rows of L tokens,
with c bytes per compute-dtype value, the model's widths D, H x Dh, F, its
Lyr layers and its vocabulary padded to Vp:

  state        W x P x (4 params + 8 AdamW + grad bytes), P the path
               model's parameters; + P x 8 for the outer bank and its
               momentum when the run synchronizes (diloco.inner_steps)
  activations  W x B x L x Lyr x what a layer keeps for the backward pass
               per token: model.remat none: D + 4 H Dh + 2 F (its input,
               q/k/v, attention output, gate and up); dots: 2 D + 3 H Dh
               + 2 F (the projections' outputs); full, any pipeline, or
               off the CPU (where XLA may rematerialize under memory
               pressure): D (the layer's input)
  attention    with the xla implementation (CPU; cudnn's fused kernel
               keeps none): the [B, H, L, L] scores, float32 for one layer,
               or with remat none the probabilities of every layer
  logits       W x B x min(L, model.loss_chunk or L) x Vp x c
  host batch   W x B x (L + 1) int32 tokens, per process
"""

import dataclasses
import re

import jax

from dipaco_jax import config_base
from dipaco_jax import errors
from dipaco_jax import paths as paths_lib

# Config fields that set each part (named in the refusal, with values).
_FIELDS = {
    "parameters and optimizer state": (
        "model.num_layers", "model.d_model", "model.mlp_dim",
        "data.vocab_size", "paths.shape", "paths.num_replicas"),
    "activations": ("train.batch_size", "data.seq_len", "model.num_layers",
                    "model.d_model", "model.mlp_dim", "model.remat"),
    "attention scores": ("train.batch_size", "data.seq_len",
                         "model.num_heads", "model.remat"),
    "logits": ("train.batch_size", "data.seq_len", "data.vocab_size",
               "model.loss_chunk"),
    "the host's batch": ("train.batch_size", "data.seq_len"),
}
_RUNTIME_FIELDS = ("train.batch_size", "data.seq_len", "model.d_model",
                   "model.num_layers", "model.remat", "model.loss_chunk")
_OUT_OF_MEMORY = re.compile(r"RESOURCE_EXHAUSTED|Out of memory|"
                            r"Unable to allocate|Cannot allocate memory")
# The config last checked: the runtime message names its values.
_checked = []


@dataclasses.dataclass(frozen=True)
class StepMemory:
  """Bytes a training step needs at least: on the devices (all of them
  together) per part, and on the host for the batch."""
  device_parts: dict
  host_batch: int

  @property
  def device_total(self) -> int:
    return sum(self.device_parts.values())


def path_parameters(model, vocab_size: int) -> int:
  """Parameters of one path's model (`model/layers.py`, transformer.py)."""
  d, f = model.d_model, model.mlp_dim
  heads = model.num_heads * model.head_dim
  padded_vocab = -(-vocab_size // 128) * 128
  embed = padded_vocab * d * (1 if model.tie_embeddings else 2) + d
  layer = 2 * d + d * 3 * heads + heads * d + d * 2 * f + f * d
  return embed + model.num_layers * layer


def estimate(config, attention: str, cpu: bool = True,
             workers: int | None = None) -> StepMemory:
  """The lower bound of the module docstring for one run's config;
  `attention` is the resolved implementation (xla or cudnn). Off the CPU
  (`cpu` False) XLA may rematerialize under memory pressure, so every
  remat setting counts as full. `workers`: how many of the run's workers
  (paths x replicas) one step trains; all of them unless given (an island
  task trains its group)."""
  m = config.model
  if workers is None:
    workers = paths_lib.topology_from_config(config).num_workers
  rows = workers * config.train.batch_size
  length = config.data.seq_len
  tokens = rows * length
  c = 4 if m.dtype == "float32" else 2
  d, f, heads = m.d_model, m.mlp_dim, m.num_heads * m.head_dim
  params = path_parameters(m, config.data.vocab_size)
  grad = 2 if config.train.grad_dtype == "bfloat16" else 4
  state = workers * params * (4 + 8 + grad)
  if config.diloco.inner_steps:
    state += params * 8
  remat = "full" if config.pipeline.stages > 1 or not cpu else m.remat
  per_token_layer = {"none": d + 4 * heads + 2 * f,
                     "dots": 2 * d + 3 * heads + 2 * f, "full": d}[remat]
  scores = 0
  if attention == "xla":
    score_values = rows * m.num_heads * length * length
    scores = score_values * (max(4, c * m.num_layers) if remat == "none"
                             else 4)
  chunk = min(length, m.loss_chunk or length)
  padded_vocab = -(-config.data.vocab_size // 128) * 128
  return StepMemory({
      "parameters and optimizer state": state,
      "activations": tokens * m.num_layers * per_token_layer * c,
      "attention scores": scores,
      "logits": rows * chunk * padded_vocab * c,
  }, rows * (length + 1) * 4 // jax.process_count())


def _capacity():
  """(what, bytes, shared): the smallest local device's memory limit, or
  on CPU the host's available memory (shared by every device and the
  host's batch); None when unknown (then nothing is checked)."""
  devices = jax.local_devices()
  if devices[0].platform == "cpu":
    available = _host_available()
    return None if available is None else ("host memory available",
                                           available, True)
  limits = []
  for device in devices:
    try:
      limits.append((device.memory_stats() or {}).get("bytes_limit"))
    except Exception:  # pylint: disable=broad-except
      limits.append(None)  # Backends without memory statistics.
  if None in limits or not limits:
    return None
  return (f"memory of one {devices[0].device_kind}", min(limits), False)


def _host_available() -> int | None:
  try:
    with open("/proc/meminfo", encoding="ascii") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    pass
  return None


def check(runs) -> None:
  """Refuses, before the data stage, a run whose step surely does not fit.

  Args:
    runs: (name, config) or (name, config, workers) of every training run
      of the job that trains here; name "" for the config itself; workers
      as `estimate` takes them.

  Raises:
    config_base.ConfigError: one line naming the fields that set the
      biggest part, the estimate and what the machine has.
  """
  if not runs:
    return
  _checked[:] = [runs[0][1]]
  capacity = _capacity()
  if capacity is None:
    return
  backend_attention = "cudnn" if jax.default_backend() == "gpu" else "xla"
  for name, config, *workers in runs:
    attention = config.model.attention
    step = estimate(config, backend_attention if attention == "auto"
                    else attention, cpu=capacity[2],
                    workers=workers[0] if workers else None)
    for need, parts, (what, limit, per_device) in _demands(step, capacity):
      if need > limit:
        raise config_base.ConfigError(_refusal(
            config, name, parts, need, limit, what,
            jax.device_count() if per_device else 1))


def _demands(step: StepMemory, capacity):
  """(bytes needed, its parts, (what, limit, per device)) to compare. The
  mesh spreads a step over every process's devices: off the CPU one
  device's share against one device, and the batch against the host; on
  CPU this host's share (its devices') and the batch against the host."""
  what, limit, shared = capacity
  if shared:
    local_share = jax.local_device_count() / jax.device_count()
    parts = {**{part: int(need * local_share)
                for part, need in step.device_parts.items()},
             "the host's batch": step.host_batch}
    return [(sum(parts.values()), parts, (what, limit, False))]
  demands = [(step.device_total // jax.device_count(), step.device_parts,
              (what, limit, True))]
  host = _host_available()
  if host is not None:
    demands.append((step.host_batch, {"the host's batch": step.host_batch},
                    ("host memory available", host, False)))
  return demands


def _refusal(config, name, parts, need, limit, what, num_devices) -> str:
  biggest = max(parts, key=parts.get)
  listed = ", ".join(f"{p} {errors.format_bytes(b)}" for p, b in sorted(
      parts.items(), key=lambda kv: -kv[1]) if b)
  per = f" per device (of {num_devices})" if num_devices > 1 else ""
  run = f" of the {name} run" if name else ""
  fix = ("use a smaller model, fewer paths or replicas, or more devices"
         if biggest == "parameters and optimizer state" else
         "lower config.train.batch_size or config.data.seq_len (config.model."
         "remat=full and config.model.loss_chunk=512 also cut activations and "
         "logits)")
  return (f"{_values(config, _FIELDS[biggest])}: a training step{run} needs "
          f"at least {errors.format_bytes(need)}{per} ({listed}; a lower "
          f"bound), more than the {errors.format_bytes(limit)} of {what}; "
          f"{fix}.")


def _values(config, fields) -> str:
  out = []
  for field in fields:
    section, key = field.split(".")
    out.append(f"config.{field}={config[section][key]}")
  return ", ".join(out)


def out_of_memory_message(error: BaseException) -> str | None:
  """One line for memory exhausted at run time (XLA's RESOURCE_EXHAUSTED,
  numpy's MemoryError) anywhere in `error`'s chain, naming the fields
  that set a step's size; None for anything else."""
  for e in errors.exception_chain(error):
    text = str(e)
    if isinstance(e, MemoryError) or (_OUT_OF_MEMORY.search(text) and
                                      not errors.mentions_disk_full(text)):
      first = (text.strip().splitlines() or [type(e).__name__])[0]
      first = first if len(first) <= 200 else first[:200] + "..."
      fields = (_values(_checked[0], _RUNTIME_FIELDS) if _checked else
                ", ".join(f"config.{f}" for f in _RUNTIME_FIELDS))
      return (f"out of memory ({first}); a training step's size is set by "
              f"{fields}: lower config.train.batch_size or "
              "config.data.seq_len, or set config.model.remat=full or "
              "config.model.loss_chunk=512.")
  return None
