"""delay=overlap (Streaming DiLoCo's tau-step overlap): the rule by hand,
tau = H against one_round, resume with a round in flight, dispatches that
end at the apply steps, and the config's refusals."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dipaco_jax import config_base
from dipaco_jax import testing
from dipaco_jax.diloco import comm as comm_lib
from dipaco_jax.diloco import comm_step
from dipaco_jax.diloco import overlap_step
from dipaco_jax.errors import UserError
from dipaco_jax.islands import launcher
from dipaco_jax.stages import run_configs
from dipaco_jax.train import dispatch
from dipaco_jax.train import metrics as metrics_lib
from dipaco_jax.train import sync as sync_lib


def _leaves(tree):
  return jax.tree.leaves(jax.device_get(tree))


def _w(tree, key):
  return tuple(float(v) for v in np.ravel(tree[key]["s"]["w"]))


def test_overlap_by_hand():
  # Two workers, one scalar module, outer SGD at lr 1 without momentum:
  # g <- g - D. Each "move" stands in for inner steps.
  tx = optax.sgd(1.0)
  comms = {"s": comm_lib.SlotComm("overlap")}
  bank = {"s": {"w": jnp.zeros((1, 1))}}
  params = {"s": {"w": jnp.zeros((2, 1))}}
  inner_extra, outer_extra = comm_step.init_extra(comms, params, bank, tx)
  outer = {"params": bank, "opt_state": {"s": tx.init(bank["s"])},
           **outer_extra}
  inner = {"params": params, **inner_extra}
  assignment = np.zeros((2, 1), np.int32)
  kw = dict(assignment_WxS=assignment, slot_names=("s",))

  def move(inner, by):
    return dict(inner, params={"s": {"w": inner["params"]["s"]["w"] +
                                     jnp.array(by, jnp.float32)[:, None]}})

  def handover(outer, inner):
    return overlap_step.handover(outer, inner, comms=comms,
                                 weights_W=jnp.ones(2),
                                 rescale_by_sqrt_users=False, **kw)

  def seen(outer, inner):
    return (_w(outer, "params"), _w(inner, "params"), _w(inner, "anchor"),
            _w(inner, "handover"))

  # Round 0 moves x to (1, 3). Handover: c = a - x = (-1, -3), D0 = -2 in
  # flight, h = (1, 3); nothing applied: g = 0, x and a unchanged.
  outer, inner = handover(outer, move(inner, (1, 3)))
  assert float(outer["pending"]["s"]["w"][0, 0]) == -2.0
  assert seen(outer, inner) == ((0.0,), (1.0, 3.0), (0.0, 0.0), (1.0, 3.0))
  # tau steps move x by (2, -2) to (3, 1). Apply: g = 0 - (-2) = 2,
  # x + (g - h) = (3 + 2 - 1, 1 + 2 - 3) = (4, 0), a = (2, 2).
  outer, inner = overlap_step.apply(outer, move(inner, (2, -2)), tx, **kw)
  assert seen(outer, inner) == ((2.0,), (4.0, 0.0), (2.0, 2.0), (1.0, 3.0))
  assert int(outer["has_pending"]) == 0
  # The rest of round 1 moves x by (1, 1) to (5, 1). Handover: c = a - x =
  # (-3, 1), the whole round's progress (2 + 1, -2 + 1) negated; D1 = -1.
  outer, inner = handover(outer, move(inner, (1, 1)))
  assert float(outer["pending"]["s"]["w"][0, 0]) == -1.0
  assert seen(outer, inner) == ((2.0,), (5.0, 1.0), (2.0, 2.0), (5.0, 1.0))
  # Moves (0, 2) to (5, 3). Apply: g = 3, x = (5 + 3 - 5, 3 + 3 - 1) =
  # (3, 5), a = (3, 3).
  outer, inner = overlap_step.apply(outer, move(inner, (0, 2)), tx, **kw)
  assert seen(outer, inner) == ((3.0,), (3.0, 5.0), (3.0, 3.0), (5.0, 1.0))
  # Moves (1, -1) to (4, 4); handover: c = (-1, -1), D2 = -1. The flush at
  # the end applies it (g = 4) and restarts both workers there.
  outer, inner = handover(outer, move(inner, (1, -1)))
  outer, inner = comm_step.flush(outer, inner, tx, comms=comms, **kw)
  assert seen(outer, inner)[:3] == ((4.0,), (4.0, 4.0), (4.0, 4.0))


def _config(tau, delay="overlap", shape="1", replicas=2, **diloco):
  config = testing.tiny_config(shape, replicas=replicas, inner_steps=4,
                               num_steps=12)
  config.ckpt.every = 4
  config.ckpt.keep = 2
  config.diloco.delay = delay
  config.diloco.overlap_steps = tau
  for key, value in diloco.items():
    config.diloco[key] = value
  return config


_train = testing.train_on_random_batches


def _common(state):
  """The parts of the state one_round and overlap both have."""
  return ({k: state["inner"][k] for k in ("params", "opt_state", "anchor")},
          {k: state["outer"][k] for k in ("params", "opt_state")})


def test_tau_equal_to_h_is_one_round(tmp_path):
  # Not bit for bit: one_round's contribution is a - x with its anchor
  # a = x_prev + (g - a_prev), overlap's is g - x with x = x_prev + (g - h);
  # the same numbers in exact arithmetic, rounded differently in float32.
  one = _train(_config(0, delay="one_round"), tmp_path / "one").state
  over = _train(_config(4), tmp_path / "over").state
  for a, b in zip(_leaves(_common(one)), _leaves(_common(over)),
                  strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  # That a tau < H applies elsewhere, and how: the loop's apply steps
  # (test_loop_bookkeeping_of_the_apply_steps) and the rule by hand.


def test_a_round_in_flight_survives_a_kill(tmp_path):
  # DiPaCo 2x2, tau = 2: handovers at 4, 8, 12, applies at 6, 10. The
  # checkpoint of step 4 holds round 0 in flight (compressed with error
  # feedback, a low rank on the level slots).
  config = _config(2, shape="2x2", replicas=1, compression="int4",
                   error_feedback=True,
                   per_slot="level=compression:lowrank+rank_max:4")
  runtime = testing.tiny_runtime(config)
  assert {"anchor", "handover", "residual", "codec_state"} <= set(
      runtime.abstract_state["inner"])
  # Killed after step 5: the checkpoint of step 4 is between round 0's
  # handover (4) and its apply (6).
  state = testing.assert_resume_is_exact(functools.partial(_train, config),
                                         tmp_path, die_after=5,
                                         resumed_from=4)
  assert int(state["outer"]["has_pending"]) == 0  # Flushed at the end.


def test_dispatches_end_at_the_apply_steps(tmp_path):
  # tau = 2, H = 4: applies at 6 and 10, which dispatches of 3 steps would
  # pass over (0-3, 3-6 ...) without the loop's boundary there.
  one = _train(_config(2), tmp_path / "one").state
  config = _config(2)
  config.train.steps_per_dispatch = 3
  # after_outer_step runs where the global modules change: the applies
  # and the end (the flush), not the handovers.
  changed = []
  three = _train(config, tmp_path / "three", after_outer_step=[
      lambda step, state: changed.append(step)]).state
  assert changed == [6, 10, 12]
  # Scanned steps round as test_dispatch.py says.
  for a, b in zip(_leaves(one), _leaves(three), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_loop_bookkeeping_of_the_apply_steps():
  # H = 4, tau = 2, 12 steps: applies after steps 6 and 10 (round 2's is
  # due at 14, past the end: flushed); dispatches of 3 end there.
  runtime = testing.tiny_runtime(_config(2))
  sync = sync_lib.InProcessSync(runtime)
  assert [(s, sync_lib.finish_due(sync, s, 4)) for s in range(13)
          if sync_lib.finish_due(sync, s, 4) is not None] == [(6, 0),
                                                               (10, 1)]
  state = {"inner": {"params": {"w": jnp.ones(2)}}}
  guard = metrics_lib.DivergenceGuard(4, 0, state, outer_offset=2)
  assert [s for s in range(13) if guard.outer_step_at(s)] == [6, 10]
  plan = dispatch.plan(0, 12, 3, lambda done: done % 4 == 0 or (
      sync_lib.finish_due(sync, done, 4) is not None))
  ends = [step + n for step, n in plan]
  assert {4, 6, 8, 10, 12} <= set(ends)


def test_config_errors(tmp_path):
  for tau in (0, 5):
    with pytest.raises(UserError, match=r"config.diloco.overlap_steps: "
                       f"{tau} must be in"):
      config_base.validate(_config(tau), 8)
  with pytest.raises(UserError, match="overlap_steps: 2 is used only"):
    config_base.validate(_config(2, delay="one_round"), 8)
  for delay, per_slot in (("overlap", "level=delay:one_round"),
                          ("none", "level=delay:overlap")):
    with pytest.raises(UserError, match="diloco.per_slot: delay overlap "
                       "must be every slot's"):
      config_base.validate(_config(2, delay=delay, shape="2x2", replicas=1,
                                   per_slot=per_slot), 8)
  # Islands run it (islands/delayed.py); lookahead they still refuse.
  launcher.check_config(_config(2))
  with pytest.raises(UserError, match="config.diloco.delay"):
    launcher.check_config(_config(0, delay="lookahead"))
  # The field enters the run's hash only when used.
  plain = run_configs.training_fields(_config(0, delay="none"))
  assert "overlap_steps" not in plain["diloco"]
  assert run_configs.training_fields(_config(2))["diloco"][
      "overlap_steps"] == 2
