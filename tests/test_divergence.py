"""The divergence guard: a diverged state is never checkpointed, and the
error names the learning rate to lower; healthy training never trips it."""

import jax.numpy as jnp
import numpy as np
import pytest

from dipaco_jax import errors
from dipaco_jax import testing
from dipaco_jax.train import loop
from dipaco_jax.train import metrics as metrics_lib

H = 50  # Inner steps between outer steps in the synthetic curves.


def _state(scale=1.0):
  return {"inner": {"params": {"w": jnp.full((2, 3), scale)}},
          "outer": {"params": {"w": jnp.full((3,), scale)}}}


def _healthy_curve(seed, steps=3000, workers=4, floor=2.0):
  """Losses [steps, W] like a run from random init: a fast fall from
  ln(32k), noise, a bump of up to 0.5 nats right after every outer step
  that decays over a few steps, and an early rise (steps 2-6)."""
  rng = np.random.default_rng(seed)
  t = np.arange(1, steps + 1)[:, None]
  curve = floor + (10.4 - floor) * np.exp(-t / 150.0)
  curve = curve + rng.normal(0, 0.08, (steps, workers))
  since_outer = (t - 1) % H
  curve = curve + np.where(t > H, rng.uniform(0, 0.5, (steps, workers)) *
                           np.exp(-since_outer / 3.0), 0)
  curve[1:6] += np.array([0.3, 0.6, 0.8, 0.5, 0.2])[:, None]
  return curve


def _feed(guard, curve, first_step=1):
  for i, losses in enumerate(curve):
    guard.check_losses(first_step + i, losses)


@pytest.mark.parametrize("seed", range(5))
def test_healthy_curves_never_trip(seed):
  _feed(metrics_lib.DivergenceGuard(H, 0, _state()), _healthy_curve(seed))
  # Low losses (a memorized batch): a 0.3-nat bump is not a divergence.
  rng = np.random.default_rng(seed)
  low = 0.05 + rng.normal(0, 0.01, (200, 2)).clip(-0.04)
  low[100] += 0.3
  _feed(metrics_lib.DivergenceGuard(0, 0, _state()), low)


@pytest.mark.parametrize("step,after_outer", [(700, False), (701, True)])
def test_a_loss_spike_trips_naming_the_cause(step, after_outer):
  curve = _healthy_curve(0)
  curve[step - 1, 2] += 4.0
  guard = metrics_lib.DivergenceGuard(H, 0, _state())
  with pytest.raises(metrics_lib.DivergenceError,
                     match=f"Loss jumped at step {step} on workers 2") as e:
    _feed(guard, curve)
  if after_outer:
    assert ("Lower config.diloco.outer_lr (diverged right after the outer "
            "step at step 700)") in str(e.value)
  else:
    assert ("Lower config.inner_opt.learning_rate (diverged at step 700)"
            in str(e.value))
  assert isinstance(e.value, FloatingPointError)
  assert isinstance(e.value, errors.UserError)
  assert len(str(e.value).splitlines()) == 1


def test_a_non_finite_loss_trips():
  curve = _healthy_curve(1)[:60]
  curve[40, 0] = np.nan
  with pytest.raises(metrics_lib.DivergenceError,
                     match="Non-finite loss at step 41 on workers 0: "):
    _feed(metrics_lib.DivergenceGuard(H, 0, _state()), curve)


def test_parameter_norm_jumps_trip_before_saving():
  guard = metrics_lib.DivergenceGuard(H, 0, _state(1.0))
  guard.check_params(100, _state(3.0))  # Slow growth is fine,
  with pytest.raises(metrics_lib.DivergenceError,
                     match=r"norm .* after step 150 is more than 10x its "
                     r".* at step 100; not saved. Lower config.diloco.outer_lr"
                     r" \(diverged right after the outer step at step 150\)"):
    guard.check_params(150, _state(40.0))  # ... a 13x jump is not.
  with pytest.raises(metrics_lib.DivergenceError,
                     match="Non-finite parameters after step 170; not saved. "
                     "Lower config.inner_opt.learning_rate"):
    guard.check_params(170, _state(np.inf))
  with pytest.raises(metrics_lib.DivergenceError, match="not finite"):
    metrics_lib.DivergenceGuard(H, 0, _state(np.nan))  # A bad checkpoint.


def _diloco_config(outer_lr, ckpt_every):
  config = testing.tiny_config("1", replicas=2, inner_steps=2, num_steps=8)
  config.diloco.outer_lr = outer_lr
  config.ckpt.every = ckpt_every
  config.train.log_every = 1
  return config


@pytest.mark.parametrize("ckpt_every", [2, 4])
def test_exploding_outer_step_stops_before_any_checkpoint(tmp_path,
                                                         ckpt_every):
  # Measured before the guard: the state after the outer step at step 2 is
  # finite (max ~1e28), so it was saved, and the NaN loss at step 4 blamed
  # the inner learning rate.
  config = _diloco_config(1e30, ckpt_every)
  data = testing.RandomBatches(2, 8, config.data.seq_len)
  with pytest.raises(metrics_lib.DivergenceError) as e:
    loop.train(testing.tiny_runtime(config), data, str(tmp_path), {}, "x")
  assert ("Lower config.diloco.outer_lr (diverged right after the outer step"
          " at step 2)") in str(e.value)
  saved = [p.name for p in (tmp_path / "checkpoints").glob("*")]
  assert not [s for s in saved if s[:1].isdigit()], saved  # tmp ones too
  assert not (tmp_path / metrics_lib.SUMMARY).exists()


def test_a_healthy_tiny_diloco_run_does_not_trip(tmp_path):
  # (A loss falling fast to ~0: test_train's learnable-data test.)
  config = _diloco_config(0.7, 4)
  data = testing.RandomBatches(2, 8, config.data.seq_len)
  result = loop.train(testing.tiny_runtime(config), data,
                      str(tmp_path / "diloco"), {}, "x")
  assert result.steps == 8
  summary = metrics_lib.read_run_summary(tmp_path / "diloco")
  assert summary["steps"] == 8 and summary["tokens_per_s"] > 0
  assert summary["final_loss"] == pytest.approx(
      float(np.mean(result.final_losses_W)))


def test_run_summary_adds_up_the_segments_of_a_resumed_run(tmp_path):
  write = metrics_lib.write_run_summary
  write(tmp_path, 0, 4, 2.0, 100, [3.0, 5.0])
  write(tmp_path, 0, 8, 4.0, 100, [2.0, 4.0])  # Same process, later save.
  write(tmp_path, 8, 10, 9.0, 100, [1.0])  # Another process, then killed.
  # Its checkpoint 10 was damaged: the next one resumes from step 8.
  write(tmp_path, 8, 12, 6.0, 100, [1.0, 1.0])
  summary = metrics_lib.read_run_summary(tmp_path)
  assert [(s["from"], s["to"]) for s in summary["segments"]] == [(0, 8),
                                                                  (8, 12)]
  assert summary["train_seconds"] == 10.0
  assert summary["tokens_per_s"] == pytest.approx(1200 / 10.0)
  assert summary["final_loss"] == 1.0 and summary["steps"] == 12


@pytest.mark.parametrize("k", [1, 2])
def test_the_guard_checks_each_outer_step_without_waiting_for_the_newest_state(
    tmp_path, monkeypatch, k):
  # The guard once read the norm of the loop's newest state at every outer
  # step, which waits for the device to drain its queue. Now the norm is
  # measured on the device right after each outer step and read with that
  # dispatch's metrics: the blocking `param_norm` runs once, for the state
  # the run starts from (the final save's state was measured already).
  blocking, measured = [], []
  param_norm, device_norm = (metrics_lib.param_norm,
                             metrics_lib.device_param_norm)
  check_norm = metrics_lib.DivergenceGuard.check_norm
  monkeypatch.setattr(metrics_lib, "param_norm",
                      lambda s: blocking.append(1) or param_norm(s))
  monkeypatch.setattr(metrics_lib, "device_param_norm",
                      lambda s: measured.append(1) or device_norm(s))
  checked = []
  monkeypatch.setattr(
      metrics_lib.DivergenceGuard, "check_norm",
      lambda self, step, norm, finite: checked.append(step) or check_norm(
          self, step, norm, finite))
  config = _diloco_config(0.7, 0)
  config.train.steps_per_dispatch = k
  data = testing.RandomBatches(2, 8, config.data.seq_len)
  loop.train(testing.tiny_runtime(config), data, str(tmp_path), {}, "x")
  assert len(blocking) == 1
  assert checked == [2, 4, 6, 8]
  assert len(measured) == 4 + 1  # (`param_norm` measures through it too.)
