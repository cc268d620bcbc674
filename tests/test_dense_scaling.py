"""The extra dense baselines (stages/dense_scaling.py): their sizes, their
config fields, their FLOPs bookkeeping, and one tiny end-to-end run."""

import json
import pathlib

import pytest

from dipaco_jax import config_base
from dipaco_jax import paths as paths_lib
from dipaco_jax import testing
from dipaco_jax.model import layers
from dipaco_jax.stages import dense_scaling
from dipaco_jax.stages import experiment as experiment_lib
import test_pipeline  # TINY_FLAGS and the CLI runner of the main job.

_EXPERIMENTS = pathlib.Path(__file__).parent.parent / "experiments"


def _non_embedding(config, vocab=512):
  dims = layers.dims_from_config(config.model, vocab)
  path, _ = dense_scaling.param_counts(
      dims, paths_lib.topology_from_config(config))
  return path


def _dipaco_4x4():
  return config_base.load_experiment(_EXPERIMENTS / "dipaco_4x4.py")


@pytest.mark.parametrize("make_config", [
    lambda: testing.tiny_config("2x2", inner_steps=4),
    _dipaco_4x4,
], ids=["tiny", "dipaco_4x4"])
def test_scaled_models_have_the_asked_multiple_of_a_paths_params(
    make_config):
  config = make_config()
  config.eval.dense_scales = "2,4"
  config.eval.dense_same_flops = True
  path = _non_embedding(experiment_lib.dense_config_of(config))
  specs = {s.name: s for s in dense_scaling.specs(config)}
  assert set(specs) == {"dense_2x", "dense_4x", "dense_same_flops"}
  for name, scale in (("dense_2x", 2), ("dense_4x", 4)):
    cfg = specs[name].config
    assert _non_embedding(cfg) == pytest.approx(scale * path, rel=0.15)
    # Same width, heads and schedule shape; from scratch for every step a
    # path takes (base + paths + discriminative phase).
    assert cfg.model.d_model == config.model.d_model
    assert cfg.model.head_dim == config.model.head_dim
    assert cfg.train.num_steps == specs[name].steps == (
        config.base.num_steps + config.train.num_steps +
        config.routing.discriminative_steps)
    assert cfg.train.batch_size == config.train.batch_size
    assert cfg.paths.shape == "1" and not cfg.eval.dense_scales
  same = specs["dense_same_flops"].config
  assert same.model == config.model
  num_paths = paths_lib.topology_from_config(config).num_paths
  assert same.train.num_steps == num_paths * config.train.num_steps


@pytest.mark.parametrize("field,value,match", [
    ("dense_scales", "2,x", "eval.dense_scales"),
    ("dense_scales", "0", "eval.dense_scales"),
    ("dense_scales", "-2", "eval.dense_scales"),
    ("dense_scales", "1.3", "eval.dense_scales"),  # 5.2 of 4 layers
    ("dense_scales", "2,2", "eval.dense_scales"),
    ("dense_scales", "nan", "eval.dense_scales"),
])
def test_bad_dense_scaling_fields_are_named(field, value, match):
  config = testing.tiny_config("2x2", inner_steps=4)
  config.eval[field] = value
  with pytest.raises(config_base.ConfigError, match=match):
    config_base.validate(config, num_devices=8)


def test_dense_scaling_is_refused_without_paths_and_checked_derived(
    monkeypatch):
  from dipaco_jax import pipeline  # pylint: disable=g-import-not-at-top
  config = testing.tiny_config("1", num_steps=8)
  config.eval.dense_same_flops = True
  with pytest.raises(config_base.ConfigError,
                     match="config.eval.dense_same_flops"):
    pipeline.check_config(config)
  config = testing.tiny_config("2x2", inner_steps=4, num_steps=8)
  config.eval.dense_scales = "1.5,2"  # 6 and 8 layers: both fine
  pipeline.check_config(config)
  # A derived run that cannot run is caught up front, by its name.
  specs = dense_scaling.specs

  def bad_specs(cfg):
    out = specs(cfg)
    out[0].config.train.batch_size = 3  # not divisible by mesh.data = 8
    return out
  monkeypatch.setattr(dense_scaling, "specs", bad_specs)
  with pytest.raises(config_base.ConfigError, match="dense_1.5x run derived"):
    pipeline.check_config(config)


def test_flops_bookkeeping_by_hand():
  config = testing.tiny_config("2x2", inner_steps=4, num_steps=8)
  config.base.num_steps = 4
  config.base.batch_size = 4
  config.routing.discriminative_steps = 4
  config.eval.dense_scales = "2"
  config.eval.dense_same_flops = True
  # d_model 32, 2 heads of 16, mlp 64: one block is qkv 32*3*2*16 + out
  # 2*16*32 + gate_up 32*2*64 + down 64*32 + 2 norms of 32 = 10,304.
  block, final_norm = 10_304, 32
  path = 4 * block + final_norm
  assert _non_embedding(config, vocab=97) == path
  head = 32 * 128  # d_model x the vocabulary padded to 128
  per_token, per_token_2x = 6 * (path + head), 6 * (8 * block + 32 + head)
  base_tokens = 4 * 4 * 40  # steps x base batch x seq_len
  step_tokens = 8 * 40
  path_steps = 8 + 4  # both phases
  got = dense_scaling.flops(config, vocab_size=97)
  assert got == {
      "dipaco": per_token * (base_tokens + 4 * path_steps * step_tokens),
      "dense baseline": per_token * (base_tokens + path_steps * step_tokens),
      "dense_same_flops": per_token * (base_tokens +
                                       4 * path_steps * step_tokens),
      "dense_2x": per_token_2x * (4 + path_steps) * step_tokens}


def test_dipaco_with_a_2x_dense_model_end_to_end(tmp_path):
  # No base (so token-embedding routing) and 2 steps: the extra run and its
  # bookkeeping are what is tested; the same-FLOPs run trains like the
  # dense baseline and is covered by the tests above.
  run = test_pipeline._main(  # pylint: disable=protected-access
      tmp_path, "--config.base.num_steps=0",
      "--config.routing.features=token_embedding",
      "--config.train.num_steps=2", "--config.diloco.inner_steps=2",
      "--config.eval.reroute_every=0", "--config.eval.dense_scales=2",
      fake_devices=8)
  assert run.returncode == 0, run.stderr[-3000:]
  results = json.loads((tmp_path / "results.json").read_text())
  models, compute = results["models"], results["compute"]
  label = "dense 2x (41.2k non-embedding params, from scratch, 2 steps)"
  assert label in models
  assert len({m["tokens"] for m in models.values()}) == 1  # same tokens
  assert set(compute) == set(models)
  dipaco = compute["dipaco routed once per document"]
  dense = compute["dense baseline (one path's size)"]
  assert compute[label]["role"] == "dense scaled"
  assert compute[label]["steps"] == dipaco["steps"] == dense["steps"] == 2
  assert compute[label]["non_embedding_params"] == pytest.approx(
      2 * dipaco["non_embedding_params"], rel=0.01)
  assert dipaco["non_embedding_params_all_paths"] > (
      dipaco["non_embedding_params"])
  # 4 paths: 4x the dense baseline's FLOPs (no base).
  assert dipaco["train_flops"] == pytest.approx(4 * dense["train_flops"])
  assert {r["name"]: r["steps"] for r in results["runs"]}["dense_2x"] == 2
  assert (tmp_path / "plots" / "scaling.png").exists()
  assert "training FLOPs" in run.stdout
