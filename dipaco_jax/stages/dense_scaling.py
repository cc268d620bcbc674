"""Extra dense baselines for the DiPaCo paper's headline at our scale.

The paper: 256 paths of 150M match a 1.3B dense model at the same number of
steps, while spending far more FLOPs than a compute-optimal dense model.
Next to the dense baseline of one path's size (`experiment.dense_config_of`)
DiPaCo runs can train, on the same path documents and batch:

  * `eval.dense_scales`: dense models of m x one path's non-embedding
    parameters, from scratch, for the steps a path takes in all (base,
    paths and discriminative phase) at train.batch_size, under the same
    warmup + cosine shape stretched over those steps (where the base has
    its own base.batch_size, the tokens differ from a path's; the FLOPs
    count the real ones);
  * `eval.dense_same_flops`: the one-path-size model continued from the
    base for P x (path steps), so that it sees P times a path's tokens and
    spends DiPaCo's training FLOPs.

Training FLOPs are counted as 6 x (non-embedding + LM-head parameters) x
tokens: forward and backward of every matmul (Kaplan et al. 2020's C = 6N,
plus the head, which every token pays for). Attention's O(L^2) score
matmuls are left out: about 6% of a step at experiments/dipaco_4x4.py's
shape, and the same share of every layer for every model here.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp

from dipaco_jax import paths as paths_lib
from dipaco_jax.model import layers
from dipaco_jax.model import transformer
from dipaco_jax.stages import evaluation
from dipaco_jax.stages import experiment as experiment_lib
from dipaco_jax.stages import run_configs


# The extra runs' configs are derived with the other runs' configs
# (stages/run_configs.py, which `run_configs.plan` needs them for).
DenseSpec = run_configs.DenseSpec
specs = run_configs.dense_specs


@dataclasses.dataclass(frozen=True)
class DenseRun(experiment_lib.TrainedRun):
  """A trained extra dense run, with what the scaling plot needs."""
  spec: DenseSpec
  label: str  # Its row in results["models"].
  non_embedding_params: int
  train_flops: float


def _tokens_per_step(config) -> int:
  return config.train.batch_size * config.data.seq_len


def _base_tokens(config) -> int:
  batch = config.base.batch_size or config.train.batch_size
  return config.base.num_steps * batch * config.data.seq_len


def param_counts(dims: layers.ModelDims,
                 topology: paths_lib.Topology) -> tuple[int, int]:
  """(one path's, the whole bank's) non-embedding parameters: all but the
  embedding table and the LM head (Kaplan et al. 2020's N)."""
  model = transformer.build_model(dims, topology)
  shapes = jax.eval_shape(model.init, jax.random.key(0),
                          jax.ShapeDtypeStruct((1, 8), jnp.int32))["params"]
  path = bank = 0
  for slot in topology.slots:
    n = sum(math.prod(leaf.shape) for keys, leaf in
            jax.tree_util.tree_leaves_with_path(shapes[slot.name])
            if not any(getattr(k, "key", None) in ("embedding", "head")
                       for k in keys))
    path, bank = path + n, bank + n * slot.num_experts
  return path, bank


def flops_per_token(dims: layers.ModelDims, non_embedding: int) -> int:
  """Training FLOPs per token (module docstring); the head runs over the
  padded vocabulary."""
  return 6 * (non_embedding + dims.d_model * dims.padded_vocab)


def _dims(config, vocab_size: int) -> layers.ModelDims:
  return layers.dims_from_config(config.model, vocab_size)


def flops(config, vocab_size: int) -> dict[str, float]:
  """Training FLOPs of DiPaCo and its dense baselines, base included:
  {'dipaco', 'dense baseline', spec name...}."""
  dims = _dims(config, vocab_size)
  path_n, _ = param_counts(dims, paths_lib.topology_from_config(
      experiment_lib.dense_config_of(config)))
  per_token = flops_per_token(dims, path_n)
  num_paths = paths_lib.topology_from_config(config).num_paths
  base, step = _base_tokens(config), _tokens_per_step(config)
  steps = experiment_lib.path_steps(config)
  out = {"dipaco": per_token * (base + num_paths * steps * step),
         "dense baseline": per_token * (base + steps * step)}
  for spec in specs(config):
    if spec.role == "same_flops":
      out[spec.name] = per_token * (
          base + spec.config.train.num_steps * step)
    else:  # From scratch: all its steps at the train batch.
      d = _dims(spec.config, vocab_size)
      n, _ = param_counts(d, paths_lib.topology_from_config(spec.config))
      out[spec.name] = flops_per_token(d, n) * spec.steps * step
  return {k: float(v) for k, v in out.items()}


def _count(n: int) -> str:
  for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
    if n >= div:
      return f"{n / div:.1f}{unit}"
  return str(n)


def _label(config, spec: DenseSpec, non_embedding: int) -> str:
  if spec.role == "same_flops":
    num_paths = paths_lib.topology_from_config(config).num_paths
    after = " after the base" if config.base.num_steps else ""
    return (f"dense one path's size, DiPaCo's training FLOPs ({num_paths} x "
            f"{experiment_lib.path_steps(config)} steps{after})")
  return (f"dense {spec.scale:g}x ({_count(non_embedding)} non-embedding "
          f"params, from scratch, {spec.steps} steps)")


def train(config, data, workdir, dense: experiment_lib.TrainedRun,
          init_bank, init_from) -> list[DenseRun]:
  """Trains (or reuses) the extra dense runs on the dense baseline's shards
  (the path documents); `init_bank` (from `init_from`) is what the dense
  baseline started from, for the same-FLOPs run."""
  todo = specs(config)
  if not todo:
    return []
  all_flops = flops(config, data.vocab_size)
  out = []
  for spec in todo:
    exp = experiment_lib.Experiment(
        spec.config, data, workdir, spec.name, dense.experiment.shard_dir,
        dense.experiment.manifest)
    if spec.role == "same_flops":
      result = exp.train(init_bank, init_from=init_from)
    else:
      result = exp.train()
    n, _ = param_counts(exp.dims, exp.topology)
    out.append(DenseRun(exp, result, spec, _label(config, spec, n), n,
                        all_flops[spec.name]))
  return out


def score(config, data, runs: list[DenseRun]) -> dict[str, dict]:
  """The runs' rows of results["models"], on the validation tokens that
  `evaluation.evaluate_dipaco` scores (the same layout)."""
  if not runs:
    return {}
  return {r.label: evaluation.score(data.docs["validation"],
                                    r.experiment.model, r.path_params(),
                                    config) for r in runs}


def compute(config, data, models: dict, trained: experiment_lib.TrainedRun,
            runs: list[DenseRun]) -> dict[str, dict]:
  """results["compute"]: per row of `models`, the training FLOPs, the
  non-embedding parameters one token passes through, and the steps one
  model (or path) took, base included. Every DiPaCo row shares DiPaCo's."""
  all_flops = flops(config, data.vocab_size)
  exp = trained.experiment
  path_n, bank_n = param_counts(exp.dims, exp.topology)
  steps = config.base.num_steps + experiment_lib.path_steps(config)
  dipaco = {"role": "dipaco", "train_flops": all_flops["dipaco"],
            "non_embedding_params": path_n,
            "non_embedding_params_all_paths": bank_n, "steps": steps}
  dense = {evaluation.DENSE_BASELINE_ROW: {
      "role": "dense baseline", "train_flops": all_flops["dense baseline"],
      "non_embedding_params": path_n, "steps": steps, "scale": 1.0}}
  for r in runs:
    dense[r.label] = {"role": f"dense {r.spec.role}", "scale": r.spec.scale,
                      "train_flops": r.train_flops,
                      "non_embedding_params": r.non_embedding_params,
                      "steps": r.spec.steps}
  return {name: dense.get(name, dipaco) for name in models}
