"""DiLoCoX's delayed outer step: the one-round rule against a hand-computed
two-worker example, and the simulation in the SPMD loop (plain settings
unchanged bit for bit, resume exact with a round in flight)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dipaco_jax import testing
from dipaco_jax.diloco import comm as comm_lib
from dipaco_jax.diloco import comm_step
from dipaco_jax.diloco import outer as outer_lib

# One slot "s" with one module (K = 1) of one scalar, used by every worker.
# Outer SGD with lr 1 and (heavy-ball) momentum 0.5: m <- D + 0.5 m,
# g <- g - m.
TX = optax.sgd(1.0, momentum=0.5)
# What each worker's inner steps move it by in rounds 0, 1, 2 (a stand-in
# for training that ignores where it starts).
PROGRESS = [(1.0, 3.0), (2.0, -2.0), (4.0, 0.0)]


def _start(delay, num_workers=2, tx=TX):
  comms = {"s": comm_lib.SlotComm(delay)}
  bank = {"s": {"w": jnp.zeros((1, 1))}}
  params = {"s": {"w": jnp.zeros((num_workers, 1))}}
  inner_extra, outer_extra = comm_step.init_extra(comms, params, bank, tx)
  outer = {"params": bank, "opt_state": {"s": tx.init(bank["s"])},
           **outer_extra}
  inner = {"params": params, **inner_extra}
  return comms, outer, inner


def _rounds(delay, progress=PROGRESS, tx=TX):
  """(global g, workers' x) after each outer step, then after the flush."""
  num_workers = len(progress[0])
  comms, outer, inner = _start(delay, num_workers, tx)
  assignment = np.zeros((num_workers, 1), np.int32)
  seen = []
  for p in progress:
    inner = dict(inner, params={"s": {"w": inner["params"]["s"]["w"] +
                                      jnp.array(p)[:, None]}})
    outer, inner = comm_step.outer_update(
        outer, inner, tx, comms=comms, assignment_WxS=assignment,
        slot_names=("s",), weights_W=jnp.ones(num_workers),
        rescale_by_sqrt_users=False)
    seen.append((float(outer["params"]["s"]["w"][0, 0]),
                 tuple(np.asarray(inner["params"]["s"]["w"][:, 0]))))
  outer, inner = comm_step.flush(outer, inner, tx, comms=comms,
                                 assignment_WxS=assignment,
                                 slot_names=("s",))
  seen.append((float(outer["params"]["s"]["w"][0, 0]),
               tuple(np.asarray(inner["params"]["s"]["w"][:, 0]))))
  return seen


def test_one_round_by_hand():
  # Round 0: x = (1, 3), anchors (0, 0): c0 = (-1, -3), D0 = -2 in flight;
  #   nothing has arrived: g = 0, workers keep x, anchors <- (1, 3).
  # Round 1: x = (3, 1), c1 = (1-3, 3-1) = (-2, 2), D1 = 0 in flight;
  #   D0 arrives: m = -2, g = 2; x + (g - anchor) = (3+2-1, 1+2-3) = (4, 0).
  # Round 2: x = (8, 0), c2 = (4-8, 0-0) = (-4, 0), D2 = -2 in flight;
  #   D1 arrives: m = 0 + 0.5 * -2 = -1, g = 3; x = (8+3-4, 0+3-0) = (7, 3).
  # Flush: D2 arrives: m = -2 + 0.5 * -1 = -2.5, g = 5.5; x = (5.5, 5.5).
  assert _rounds("one_round") == [
      (0.0, (1.0, 3.0)), (2.0, (4.0, 0.0)), (3.0, (7.0, 3.0)),
      (5.5, (5.5, 5.5))]


def test_naive_by_hand():
  # The one_round global steps, but each worker restarts from the global.
  # Round 0: x = (1, 3), c0 = (-1, -3), D0 = -2 in flight; nothing has
  #   arrived: g = 0, and the workers restart from it: x = (0, 0).
  # Round 1: x = (2, -2), c1 = (0 - 2, 0 + 2) = (-2, 2), D1 = 0 in flight;
  #   D0 arrives: m = -2, g = 2; x = (2, 2).
  # Round 2: x = (6, 2), c2 = (2 - 6, 2 - 2) = (-4, 0), D2 = -2 in flight;
  #   D1 arrives: m = 0 + 0.5 * -2 = -1, g = 3; x = (3, 3).
  # Flush: D2 arrives: m = -2 + 0.5 * -1 = -2.5, g = 5.5; x = (5.5, 5.5).
  assert _rounds("naive") == [
      (0.0, (0.0, 0.0)), (2.0, (2.0, 2.0)), (3.0, (3.0, 3.0)),
      (5.5, (5.5, 5.5))]


def test_lookahead_by_hand():
  # The global steps as one_round's (the contributions are the same:
  # PROGRESS ignores the start); each worker starts from the outer step
  # applied to its own contribution with the global's momentum m:
  # m_w = c_w + 0.5 m, x_w = g - m_w.
  # Round 0: c0 = (-1, -3), g = 0, m = 0: x = (1, 3).
  # Round 1: x = (3, 1), c1 = (-2, 2); D0 arrives: m = -2, g = 2;
  #   m_w = (-2, 2) - 1 = (-3, 1): x = (5, 1).
  # Round 2: x = (9, 1), c2 = (-4, 0); D1 = 0 arrives: m = -1, g = 3;
  #   m_w = (-4, 0) - 0.5 = (-4.5, -0.5): x = (7.5, 3.5).
  # Flush: D2 = -2 arrives: m = -2.5, g = 5.5; x = (5.5, 5.5).
  assert _rounds("lookahead") == [
      (0.0, (1.0, 3.0)), (2.0, (5.0, 1.0)), (3.0, (7.5, 3.5)),
      (5.5, (5.5, 5.5))]


def test_lookahead_with_averaging_is_one_round():
  # Outer SGD at lr 1 without momentum predicts g - c = x + (g - a).
  averaging = optax.sgd(1.0)
  assert (_rounds("lookahead", tx=averaging)
          == _rounds("one_round", tx=averaging))


@pytest.mark.parametrize("tx", [
    TX, optax.sgd(0.7, momentum=0.9, nesterov=True),
    optax.adam(0.5, b1=0.9, eps=0.1)], ids=["momentum", "nesterov", "adam"])
def test_lookahead_with_one_worker_is_plain_diloco(tx):
  # One worker's contribution is the mixed pseudo-gradient: its predicted
  # start is the undelayed global, round after round (the optimizer's
  # state, Adam's step count too, taken from the global's).
  progress = [(1.0,), (2.0,), (4.0,)]
  lookahead = [x for _, x in _rounds("lookahead", progress, tx)[:-1]]
  plain = [x for _, x in _rounds("none", progress, tx)[:-1]]
  assert lookahead == plain


def test_no_delay_by_hand():
  # Round 0: D0 = -2, m = -2, g = 2, x = (2, 2). Round 1: x = (4, 0),
  # D1 = (-2 + 2) / 2 = 0, m = -1, g = 3. Round 2: x = (7, 3), D2 = -2,
  # m = -2.5, g = 5.5. The flush has nothing in flight.
  assert _rounds("none") == [
      (2.0, (2.0, 2.0)), (3.0, (3.0, 3.0)), (5.5, (5.5, 5.5)),
      (5.5, (5.5, 5.5))]


def test_eager_by_hand():
  # Each worker's own view v and momentum m; a = 1/2 (equal weights).
  # Round 0: c0 = (-1, -3); E = 0 + (c0 - 0) / 2 = (-0.5, -1.5); m = E,
  #   v = (0.5, 1.5) = x; the global g stays 0 (D0 = -2 in flight).
  # Round 1: x = (2.5, -0.5), c1 = v - x = (-2, 2); E = D0 + (c1 - c0) / 2
  #   = -2 + (-0.5, 2.5) = (-2.5, 0.5); m = E + m / 2 = (-2.75, -0.25);
  #   v = (3.25, 1.75). D0 arrives at the global: g = 2 (as one_round).
  # Round 2: x = (7.25, 1.75), c2 = (-4, 0); E = D1 + (c2 - c1) / 2
  #   = 0 + (-1, -1); m = (-1 - 1.375, -1 - 0.125) = (-2.375, -1.125);
  #   v = (5.625, 2.875). Global: g = 3.
  # Flush: g = 5.5 (as one_round), every worker restarts from it.
  assert _rounds("eager") == [
      (0.0, (0.5, 1.5)), (2.0, (3.25, 1.75)), (3.0, (5.625, 2.875)),
      (5.5, (5.5, 5.5))]


def test_eager_with_one_worker_is_plain_diloco():
  # With one worker its eager estimate D^{r-1} + (c^r - c^{r-1}) is c^r
  # (D^{r-1} = c^{r-1}): its view follows the undelayed global exactly.
  progress = [(1.0,), (2.0,), (4.0,)]
  eager = [x for _, x in _rounds("eager", progress)[:-1]]
  plain = [x for _, x in _rounds("none", progress)[:-1]]
  assert eager == plain


# The SPMD runtime's simulation.


_config = testing.comm_config
_train = testing.train_on_random_batches


def _leaves(state):
  return jax.tree.leaves(jax.device_get(state))


def test_plain_settings_take_the_plain_chain():
  # compression=none, delay=none: the state and the jitted chain are those
  # of before DiLoCoX (test_golden_step pins their numbers).
  runtime = testing.tiny_runtime(_config())
  assert runtime.comm_plain
  assert set(runtime.abstract_state["inner"]) == {"params", "opt_state"}
  assert set(runtime.abstract_state["outer"]) == {"params", "opt_state"}


def test_identity_compressor_with_feedback_matches_the_plain_step():
  runtime = testing.tiny_runtime(_config(error_feedback=True))
  state = runtime.init_state(jax.random.key(0))
  data = testing.RandomBatches(4, 8, 40)
  for step in range(2):
    state, _ = runtime.inner_step(state,
                                  runtime.worker_rows(data.batch(step)))
  host = jax.device_get(state)
  chained_outer, chained_inner = comm_step.outer_update(
      host["outer"], host["inner"], runtime.outer_tx, comms=runtime.comms,
      assignment_WxS=runtime.topology.assignment_WxS,
      slot_names=runtime.slot_names, weights_W=jnp.ones(4),
      rescale_by_sqrt_users=False)
  plain_outer, plain_params = outer_lib.outer_update(
      host["outer"], host["inner"]["params"], runtime.outer_tx,
      assignment_WxS=runtime.topology.assignment_WxS,
      slot_names=runtime.slot_names, weights_W=jnp.ones(4),
      rescale_by_sqrt_users=False)
  for a, b in zip(_leaves(plain_outer), _leaves(
      {k: chained_outer[k] for k in plain_outer}), strict=True):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
  for a, b in zip(_leaves(plain_params), _leaves(chained_inner["params"]),
                  strict=True):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
  assert all(not np.any(r) for r in _leaves(chained_inner["residual"]))
  # 4 bytes per parameter of each worker's path.
  path_params = sum(x.size for x in _leaves(host["inner"]["params"])) // 4
  np.testing.assert_array_equal(chained_inner["sent_bytes_W"],
                                np.full(4, 4.0 * path_params))


def test_a_round_in_flight_survives_a_kill(tmp_path):
  # Every kind of state the communication adds, in one run: one_round with
  # a warm-started low rank and its residuals on the level slots (lookahead
  # on the first, the subspace shared by each module's users on the
  # second), eager with int4 on the shared embedding.
  config = _config(delay="one_round", compression="lowrank",
                   compression_rank_max=4, error_feedback=True,
                   per_slot="shared=delay:eager+compression:int4;"
                   "layers_00_01=delay:lookahead;"
                   "layers_02_03=compression:lowrank_shared")
  runtime = testing.tiny_runtime(config)
  assert {"anchor", "residual", "codec_state", "prev_sent", "eager_opt",
          "sent_bytes_W"} <= set(runtime.abstract_state["inner"])
  assert runtime.comms["layers_00_01"].delay == "lookahead"
  assert runtime.comms["layers_02_03"].spec.name == "lowrank_shared"
  # Killed after step 5: the checkpoint of step 4 holds round 1 in flight.
  state = testing.assert_resume_is_exact(functools.partial(_train, config),
                                         tmp_path, die_after=5,
                                         resumed_from=4)
  # The flush ended on the global modules: every worker restarts there.
  assert int(state["outer"]["has_pending"]) == 0
  restarted = outer_lib.gather_workers(state["outer"]["params"],
                                       runtime.topology.assignment_WxS,
                                       runtime.slot_names)
  for a, b in zip(jax.tree.leaves(restarted),
                  jax.tree.leaves(state["inner"]["params"]), strict=True):
    np.testing.assert_array_equal(a, b)


def test_islands_refuse_communication_settings_they_do_not_apply(tmp_path):
  from dipaco_jax import pipeline  # pylint: disable=g-import-not-at-top
  from dipaco_jax.errors import UserError  # pylint: disable=g-import-not-at-top
  from dipaco_jax.islands import launcher  # pylint: disable=g-import-not-at-top
  # eager runs on islands (islands/eager.py), but not beside compressed
  # downloads, which its workers never read.
  for config in (_config(delay="eager", download_compression="int4"),
                 _config(delay="lookahead"), _config(delay="naive"),
                 _config(per_slot="level=delay:one_round"),
                 _config(compression="lowrank_shared")):
    with pytest.raises(UserError, match="config.diloco.delay|"
                       "config.diloco.compression: lowrank_shared|"
                       "download_compression: eager"):
      pipeline.run(config, str(tmp_path),
                   islands=launcher.IslandOptions(num_workers=1))
    assert not any(tmp_path.iterdir())  # Refused before anything is written.


def test_per_slot_overrides_and_their_errors():
  config = _config(compression="int4",
                   per_slot="level=compression:none+delay:one_round")
  runtime = testing.tiny_runtime(config)
  assert runtime.comms["embed_head"] == comm_lib.SlotComm(
      "none", runtime.comms["embed_head"].spec)
  assert runtime.comms["embed_head"].spec.name == "int4"
  assert runtime.comms["layers_00_01"].delay == "one_round"
  assert runtime.comms["layers_00_01"].spec.name == "none"
  from dipaco_jax import paths as paths_lib  # pylint: disable=g-import-not-at-top
  from dipaco_jax.errors import UserError  # pylint: disable=g-import-not-at-top
  slots = paths_lib.topology_from_config(config).slots
  for text, message in [("nowhere=delay:none", "no slot or kind"),
                        ("level=delay:late", "delay 'late'"),
                        ("level=rank:3", "unknown key 'rank'"),
                        ("level=compression:zip", "compression 'zip'"),
                        ("level", "is not SELECTOR")]:
    config.diloco.per_slot = text
    with pytest.raises(UserError, match=message):
      comm_lib.comm_by_slot(config, slots)


def test_bad_compression_bounds_are_one_line_config_errors():
  from dipaco_jax import config_base  # pylint: disable=g-import-not-at-top
  from dipaco_jax.errors import UserError  # pylint: disable=g-import-not-at-top
  config = _config(compression_rank_min=9, compression_rank_max=4)
  with pytest.raises(UserError, match=r"diloco.compression_rank_min: 9 must"
                     r" be <= diloco.compression_rank_max \(4\)"):
    config_base.validate(config, 8)
  config = _config(compression="lowrank", compression_factor_bits=2)
  with pytest.raises(UserError, match=r"diloco.compression_factor_bits: 2 "
                     r"must be 0 \(float32 factors\), 8 or 4"):
    config_base.validate(config, 8)
  config = _config(per_slot="level=compression:lowrank+factor_bits:3")
  with pytest.raises(UserError, match=r"per_slot: slot layers_00_01: "
                     r"factor_bits must be 0"):
    config_base.validate(config, 8)
  config = _config(per_slot="level=compression:lowrank+energy:2")
  with pytest.raises(UserError, match=r"per_slot: slot layers_00_01: energy "
                     r"\(2.0\)"):
    config_base.validate(config, 8)
