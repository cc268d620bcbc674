"""Config validation: bad configs fail before compute, naming the field."""

import importlib.util
import pathlib

import pytest

from dipaco_jax import config_base
from dipaco_jax import testing
from dipaco_jax.parallel import mesh as mesh_lib

_EXPERIMENTS = pathlib.Path(__file__).parent.parent / "experiments"


@pytest.mark.parametrize("field,value,match", [
    ("paths.shape", "2y2", "paths.shape"),
    ("paths.shape", "3x3", "paths.shape"),  # with 5 layers, below
    ("paths.layers_per_level", "1,2", "paths.layers_per_level"),
    ("paths.private_layers", "0,9", "paths.private_layers"),
    ("diloco.inner_steps", -1, "diloco.inner_steps"),
    ("model.attention", "flash", "model.attention"),
    ("data.seq_len", 16, "data.seq_len"),
    ("train.batch_size", 7, "train.batch_size"),
    ("train.num_steps", 9, "train.num_steps"),
    ("data.corpus", "wiki", "data.corpus"),
    ("inner_opt.name", "lion", "inner_opt.name"),
    ("eval.window_router_objective", "accuracy",
     "eval.window_router_objective"),
    ("routing.router_fraction", 0.0, "routing.router_fraction"),  # learned
])
def test_bad_fields_are_named(field, value, match):
  config = testing.tiny_config("2x2", inner_steps=4, num_steps=8)
  section, key = field.split(".")
  config[section][key] = value
  if field == "paths.shape" and value == "3x3":
    config.model.num_layers = 5  # 2 levels cannot split 5 layers evenly
  with pytest.raises(config_base.ConfigError, match=match):
    config_base.validate(config, num_devices=8)


def test_workers_without_sync_are_rejected():
  config = testing.tiny_config("1", replicas=8, inner_steps=0)
  with pytest.raises(config_base.ConfigError, match="H > 0"):
    config_base.validate(config, num_devices=8)


def test_mesh_must_divide_devices_and_workers():
  config = testing.tiny_config("2x2", inner_steps=4)
  config.mesh.path = 8
  config.mesh.data = 1
  with pytest.raises(config_base.ConfigError, match="mesh.path"):
    config_base.validate(config, num_devices=8)
  config.mesh.path = 3
  with pytest.raises(config_base.ConfigError, match="mesh"):
    config_base.validate(config, num_devices=8)


def test_auto_mesh_puts_workers_on_the_path_axis():
  config = testing.tiny_config("2x2", inner_steps=4)
  assert mesh_lib.resolve_mesh_shape(config, 8) == {
      "path": 4, "stage": 1, "data": 2, "fsdp": 1, "tensor": 1}


@pytest.mark.parametrize("path", sorted(_EXPERIMENTS.glob("*.py")),
                         ids=lambda p: p.stem)
def test_every_experiment_config_validates(path):
  spec = importlib.util.spec_from_file_location(path.stem, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  from dipaco_jax import pipeline  # pylint: disable=g-import-not-at-top
  pipeline.check_config(config)  # with the derived base/dense/phase runs
  assert module.__doc__ and any(command in module.__doc__ for command in (
      "python -m dipaco_jax.main", "python -m dipaco_jax.islands",
      "python launch/sweep.py"))  # Its exact command.
  assert "Expected" in module.__doc__


def test_derived_dense_runs_are_validated_up_front():
  from dipaco_jax import pipeline  # pylint: disable=g-import-not-at-top
  config = testing.tiny_config("2x2", inner_steps=4, num_steps=8)
  config.base.num_steps = 4
  config.train.batch_size = 2  # fine for 4 paths on 8 devices (data = 2)...
  config_base.validate(config, num_devices=8)
  with pytest.raises(config_base.ConfigError, match="base run derived"):
    pipeline.check_config(config)  # ...but the 1-worker base has data = 8


def test_diloco_config_arms_share_everything_but_the_workers_and_batch():
  """The paper's comparison: the baselines differ from DiLoCo only in the
  number of replicas and, for synchronous training, an 8x batch."""
  from dipaco_jax import pipeline  # pylint: disable=g-import-not-at-top
  path = _EXPERIMENTS / "diloco.py"
  spec = importlib.util.spec_from_file_location(path.stem, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  arms = {a: module.get_config(a)
          for a in ("diloco", "one_replica", "sync_8x_batch")}
  for config in arms.values():
    pipeline.check_config(config)
  assert arms["diloco"].paths.num_replicas == 8
  assert arms["sync_8x_batch"].train.batch_size == (
      8 * arms["one_replica"].train.batch_size)
  assert (arms["diloco"].model.to_dict() == arms["one_replica"].model.to_dict()
          == arms["sync_8x_batch"].model.to_dict())
  base_hashes = {pipeline.training_hash(pipeline.base_config_of(c))
                 for c in arms.values()}
  assert len(base_hashes) == 1  # all three fork from one dense base
  with pytest.raises(ValueError, match="one of"):
    module.get_config("sync")
