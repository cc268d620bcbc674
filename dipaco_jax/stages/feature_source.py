"""Where routing features come from: the dense base model or, without one,
the initial (random) model's token embedding."""

import dataclasses

import jax
import numpy as np

from dipaco_jax import paths as paths_lib
from dipaco_jax.model import bank as bank_lib
from dipaco_jax.model import layers
from dipaco_jax.parallel import mesh as mesh_lib
from dipaco_jax.routing import features as features_lib
from dipaco_jax.stages import experiment as experiment_lib
from dipaco_jax.train import shared_runtime


def _fresh_bank(config, data):
  """The initial (random) module bank, for routing without a base."""
  topology = paths_lib.topology_from_config(config)
  runtime = shared_runtime.runtime_for(
      config, topology, layers.dims_from_config(config.model, data.vocab_size),
      mesh_lib.make_mesh(config), np.ones(topology.num_workers))
  return runtime.init_state(jax.random.key(config.seed))["outer"]["params"]


@dataclasses.dataclass(frozen=True)
class FeatureSource:
  """The base run and its path parameters, or (without a base) the initial
  path parameters; exactly one of `base_params` and `init_params` is set."""
  base_exp: experiment_lib.Experiment | None
  base_params: dict | None
  init_params: dict | None

  @classmethod
  def of(cls, config, data, base_exp, base_params) -> "FeatureSource":
    """The source for `config`; without a base this initializes the model,
    a computation over the global mesh that every process must join."""
    init_params = None
    if base_params is None:
      init_params = bank_lib.bank_path(
          jax.device_get(_fresh_bank(config, data)),
          paths_lib.topology_from_config(config), 0)
    return cls(base_exp, base_params, init_params)

  def model_and_params(self):
    """The model (None without a base) and the parameters it routes with."""
    model = self.base_exp.model if self.base_exp is not None else None
    params = (self.base_params if self.base_params is not None
              else self.init_params)
    return model, params

  def cache_key(self, config):
    """What routing features depend on besides the documents: the base run,
    or (without one) the initial model, which the model config shapes."""
    if self.base_exp is not None:
      return self.base_exp.hashes
    return {"init": config.model.to_dict(), "seed": config.seed}


def features(config, docs, source: FeatureSource) -> np.ndarray:
  """Prefix features from the base model (or token embeddings)."""
  model, params = source.model_and_params()
  if config.routing.features == "base_hidden":
    return features_lib.prefix_features(
        model, params, docs, config.data.prefix_len, "base_hidden",
        config.train.eval_batch_size)
  return features_lib.prefix_features(None, params, docs,
                                      config.data.prefix_len,
                                      "token_embedding")


def group_sums_fn(config, layout, source: FeatureSource):
  """Routing-feature sums over groups of `layout`'s input positions, from
  the base model (or the initial embedding when there is no base)."""
  model, params = source.model_and_params()

  def group_sums(group_MxL, num_groups):
    return features_lib.group_feature_sums(
        model, params, layout.windows["inputs"], group_MxL, num_groups,
        config.routing.features, config.train.eval_batch_size)
  return group_sums
