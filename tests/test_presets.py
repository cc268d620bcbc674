"""diloco.preset fills the fields left at their defaults and keeps the
user's; the warnings name the settings measured to do badly, and no preset
draws one."""

import pytest

from dipaco_jax import config_base
from dipaco_jax import testing
from dipaco_jax.diloco import presets


def _config(**diloco):
  config = testing.comm_config(**diloco)
  config.diloco.inner_steps = 20
  config.train.num_steps = 40
  return config


def test_sparseloco_fills_its_fields_and_keeps_the_users():
  config = _config(preset="sparseloco", compression_topk_fraction=0.03)
  lines = presets.apply(config)
  d = config.diloco
  assert (d.compression, d.compression_topk_chunk, d.error_feedback,
          d.error_feedback_decay, d.sparse_aggregate,
          d.compression_index_code) == (
              "topk", 4096, True, 0.95, "senders", "elias_fano")
  assert (d.outer_optimizer, d.outer_lr, d.outer_momentum) == ("sgd", 1.0,
                                                               0.0)
  assert d.compression_topk_fraction == 0.03  # The user's, kept.
  assert d.preset == ""  # Applied: the fields say what the run is.
  assert lines == [
      "diloco.preset=sparseloco: set compression=topk, "
      "compression_topk_chunk=4096, compression_index_code=elias_fano, "
      "error_feedback=True, "
      "error_feedback_decay=0.95, outer_optimizer=sgd, outer_lr=1, "
      "outer_momentum=0; kept your "
      "compression_topk_fraction=0.03"]
  assert presets.apply(config) == []  # Once.
  config_base.validate(config, 1)


def test_streaming_overlaps_a_tenth_of_a_round():
  config = _config(preset="streaming")
  presets.apply(config)
  d = config.diloco
  assert (d.delay, d.overlap_steps, d.compression, d.error_feedback,
          d.download_compression) == ("overlap", 2, "int4", True, "int4")
  short = _config(preset="streaming")
  short.diloco.inner_steps = 5
  presets.apply(short)
  assert short.diloco.overlap_steps == 1  # At least one step.


@pytest.mark.parametrize("name", ["streaming", "dilocox", "sparseloco"])
@pytest.mark.parametrize("h", [15, 20, 50])
def test_no_preset_draws_a_warning(name, h):
  # DiLoCo x8 (at H = 15 DiPaCo under Nesterov is warned, whatever the
  # preset: test_dipaco_at_short_rounds_...).
  config = _diloco_x(8, h, preset=name)
  presets.apply(config)
  config_base.validate(config, 1)
  assert presets.warnings(config) == []


def test_bad_presets_are_refused_naming_the_field():
  with pytest.raises(config_base.ConfigError,
                     match="config.diloco.preset: 'powersgd' is not one of"):
    presets.apply(_config(preset="powersgd"))
  dense = testing.tiny_config()
  dense.diloco.preset = "dilocox"
  with pytest.raises(config_base.ConfigError,
                     match="config.diloco.preset: .*inner_steps > 0"):
    presets.apply(dense)


def _rounds_of(h, config):
  config.diloco.inner_steps = h
  config.train.num_steps = 2 * h
  return config


def test_dilocox_takes_the_outer_lr_measured_best_for_its_round_length():
  # 1.0 from H = 50 (lr 0.7 cost 18.6% and more there), the default 0.7 at
  # H <= 15 (lr 1.0 cost +26.61% against +9.58% there).
  for h, lr in ((15, 0.7), (10, 0.7), (16, 1.0), (50, 1.0)):
    config = _rounds_of(h, _config(preset="dilocox"))
    presets.apply(config)
    assert (config.diloco.delay, config.diloco.outer_lr) == ("one_round", lr)


def _diloco_x(replicas, h, **diloco):
  config = testing.tiny_config("1x1", replicas=replicas, inner_steps=h,
                               num_steps=2 * h)
  config.diloco.update(diloco)
  return config


def test_late_delays_are_warned_by_the_round_length_they_were_measured_at():
  # one_round: lr 1.0 is best at H = 50 and worst at H = 15.
  fifty = presets.warnings(_rounds_of(50, _config(delay="one_round")))
  assert len(fifty) == 1 and "outer_lr=1.0" in fifty[0]
  assert presets.warnings(_rounds_of(
      50, _config(delay="one_round", outer_lr=1.0))) == []
  short = presets.warnings(_diloco_x(8, 15, delay="one_round", outer_lr=1.0))
  assert len(short) == 1 and "outer_lr=0.7" in short[0]
  assert presets.warnings(_diloco_x(8, 15, delay="one_round")) == []
  # Between the two round lengths measured, nothing is said.
  assert presets.warnings(_config(delay="one_round")) == []
  assert presets.warnings(_config(delay="one_round", outer_lr=1.0)) == []
  # eager: at 2 replicas, lr 0.35 and momentum 0.8 at short rounds; at 8,
  # not at all.
  lr_line, momentum_line = presets.warnings(_diloco_x(2, 15, delay="eager"))
  assert "outer lr 0.7" in lr_line and "outer_lr=0.35" in lr_line
  assert "momentum 0.9" in momentum_line and (
      "outer_momentum=0.8" in momentum_line)
  (momentum_only,) = presets.warnings(_diloco_x(2, 15, delay="eager",
                                                outer_lr=0.35))
  assert momentum_only == momentum_line
  for momentum in (0.8, 0.7):
    assert presets.warnings(_diloco_x(2, 15, delay="eager", outer_lr=0.35,
                                      outer_momentum=momentum)) == []
  # At H = 30 lr 0.35 to 0.45 measured alike, 0.55 worse; above 30, nothing.
  (thirty,) = presets.warnings(_diloco_x(2, 30, delay="eager",
                                         outer_lr=0.55))
  assert "H = 30" in thirty and "outer_lr=0.4" in thirty
  for lr in (0.35, 0.45):
    assert presets.warnings(_diloco_x(2, 30, delay="eager",
                                      outer_lr=lr)) == []
  assert presets.warnings(_diloco_x(2, 50, delay="eager")) == []
  for h in (15, 50):
    (eight,) = presets.warnings(_diloco_x(8, h, delay="eager",
                                          outer_lr=0.35))
    assert eight.startswith("delay eager with 8 users of a module") and (
        "delay=one_round" in eight)


def test_warnings_name_what_was_measured_to_do_badly():
  assert presets.warnings(_config()) == []
  long_rounds = _config(delay="one_round", outer_lr=1.0)
  long_rounds.diloco.inner_steps = 500
  long_rounds.train.num_steps = 1000
  assert "diverged at H = 500" in presets.warnings(long_rounds)[0]
  assert "lower bound" in presets.warnings(
      _config(delay="naive", outer_lr=1.0))[0]
  averaging = dict(outer_optimizer="sgd", outer_lr=1.0, outer_momentum=0.0)
  topk = _config(compression="topk", error_feedback=True, **averaging)
  assert presets.warnings(topk) == []  # Averaged over senders by default.
  topk.diloco.sparse_aggregate = "mean"
  assert "sparse_aggregate=senders" in presets.warnings(topk)[0]
  under_nesterov = presets.warnings(_config(compression="topk"))
  assert len(under_nesterov) == 1 and "outer_optimizer=sgd" in (
      under_nesterov[0])
  assert "diverged at rank 1-2" in presets.warnings(
      _config(compression="lowrank", error_feedback=True))[0]
  assert "+130%" in presets.warnings(
      _config(compression="lowrank_shared", error_feedback=True))[0]
  # strided, either way, once: its cost is the codec's, not the outer step's.
  for strided in (dict(compression="strided", error_feedback=True),
                  dict(download_compression="strided"),
                  dict(compression="strided", download_compression="strided")):
    assert ["+207%" in w for w in presets.warnings(
        _config(**strided, **averaging))] == [True], strided
  assert ["+248%" in w for w in presets.warnings(_config(
      compression="leader_topk", error_feedback=True,
      compression_topk_chunk=4096, **averaging))] == [True]
  # Top-k downloads thinner than a module's users' top-k together: the
  # tiny DiPaCo 2x2's shared module has 4 users.
  both = _config(compression="topk", error_feedback=True,
                 compression_topk_fraction=0.01,
                 download_compression="topk", **averaging)
  assert ["download_topk_fraction=0.04" in w for w in presets.warnings(
      both)] == [True]
  both.diloco.download_topk_fraction = 0.04
  assert presets.warnings(both) == []
  # A per-slot setting counts too.
  assert presets.warnings(_config(
      sparse_aggregate="mean", per_slot="level=compression:topk",
      **averaging))


def test_dipaco_at_short_rounds_under_nesterov_is_warned_dilocos_is_not():
  short = _config()
  short.diloco.inner_steps = 15
  (line,) = presets.warnings(short)
  assert line.startswith("DiPaCo at H = 15 under outer Nesterov") and (
      "outer_lr=1.4" in line)
  short.diloco.update(outer_optimizer="sgd", outer_lr=1.4, outer_momentum=0.0)
  assert presets.warnings(short) == []
  assert presets.warnings(_config()) == []  # H = 20: not measured to lose.
  dense_diloco = testing.tiny_config("1x1", replicas=2, inner_steps=15,
                                     num_steps=30)
  assert presets.warnings(dense_diloco) == []  # One module per level.


def test_check_config_announces_on_stderr(capsys):
  from dipaco_jax import pipeline  # pylint: disable=g-import-not-at-top
  config = _config(preset="dilocox")
  pipeline.check_config(config)
  err = capsys.readouterr().err.splitlines()
  assert err == ["diloco.preset=dilocox: set delay=one_round, outer_lr=1, "
                 "compression=int4, error_feedback=True"]
  config = _rounds_of(50, _config(delay="one_round"))
  pipeline.check_config(config)
  err = capsys.readouterr().err.splitlines()
  assert len(err) == 1 and err[0].startswith("warning: delay one_round at "
                                             "outer lr 0.7")
