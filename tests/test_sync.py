"""The sync seam: worker weights without recompiling, frozen modules, the
order of start/finish in the loop."""

import jax
import numpy as np
import optax

from dipaco_jax import testing
from dipaco_jax.diloco import outer as outer_lib
from dipaco_jax.train import loop
from dipaco_jax.train import sync as sync_lib

LEVEL0 = "layers_00_01"  # Expert e of level 0 is used by workers 2e, 2e+1.
LR, MOMENTUM = 0.7, 0.9  # The default outer Nesterov.


class _TraceCounter:
  """Counts traces of the outer chain: a new compilation traces it again."""

  def __init__(self, monkeypatch):
    self.count = 0
    real = outer_lib.outer_update

    def counted(*args, **kwargs):
      self.count += 1
      return real(*args, **kwargs)
    monkeypatch.setattr(outer_lib, "outer_update", counted)


def _round(runtime, sync, state, data, round_index, h=2):
  for s in range(h):
    state, _ = runtime.inner_step(
        state, runtime.worker_rows(data.batch(round_index * h + s)))
  before = jax.device_get(state)
  state = sync.finish(round_index, sync.start(round_index, state))
  return state, before, jax.device_get(state)


def _leaves(tree):
  return jax.tree.leaves(tree)


def _momentum(outer_state, slot):
  return optax.tree_utils.tree_get(outer_state["opt_state"][slot], "trace")


def _setup(monkeypatch):
  config = testing.tiny_config("2x2", inner_steps=2, num_steps=6)
  runtime = testing.tiny_runtime(config)
  counter = _TraceCounter(monkeypatch)
  sync = sync_lib.InProcessSync(runtime)
  data = testing.RandomBatches(4, 8, config.data.seq_len)
  state = runtime.init_state(jax.random.key(0))
  state, _, _ = _round(runtime, sync, state, data, 0)  # Momentum != 0 now.
  return runtime, counter, sync, data, state


def test_a_missing_worker_gets_weight_0_without_recompiling(monkeypatch):
  runtime, counter, sync, data, state = _setup(monkeypatch)
  sync.set_weights([1.0, 1.0, 1.0, 0.0])
  state, before, after = _round(runtime, sync, state, data, 1)
  sync.set_weights([1.0, 1.0, 1.0, 1.0])
  _, _, _ = _round(runtime, sync, state, data, 2)
  assert counter.count == 1, "changing the weights recompiled the step"

  # Level-0 expert 1 is used by workers 2 and 3; worker 3 is left out, so
  # its pseudo-gradient is worker 2's alone, then Nesterov (by hand).
  outer_before = before["outer"]["params"][LEVEL0]
  inner_w2 = jax.tree.map(lambda x: x[2], before["inner"]["params"][LEVEL0])
  for p, i, m, got in zip(
      _leaves(jax.tree.map(lambda x: x[1], outer_before)), _leaves(inner_w2),
      _leaves(jax.tree.map(lambda x: x[1], _momentum(before["outer"],
                                                     LEVEL0))),
      _leaves(jax.tree.map(lambda x: x[1], after["outer"]["params"][LEVEL0]))):
    g = p - i
    m1 = g + MOMENTUM * m
    np.testing.assert_allclose(got, p - LR * (g + MOMENTUM * m1), rtol=1e-5,
                               atol=1e-6)
    assert not np.array_equal(got, p)  # The other user carried on.


def test_a_left_out_worker_has_no_influence(monkeypatch):
  runtime, _, sync, data, state = _setup(monkeypatch)
  sync.set_weights([1.0, 1.0, 1.0, 0.0])
  for s in range(2):
    state, _ = runtime.inner_step(
        state, runtime.worker_rows(data.batch(2 + s)))
  host = jax.device_get(state)
  garbage = jax.tree.map(lambda x: x.copy(), host)
  garbage["inner"]["params"] = jax.tree.map(_bump,
                                            garbage["inner"]["params"])
  shardings = runtime.state_shardings
  put = lambda tree: jax.device_put(tree, shardings)
  want = jax.device_get(sync.finish(1, sync.start(1, put(host))))
  got = jax.device_get(sync.finish(1, sync.start(1, put(garbage))))
  for a, b in zip(_leaves(want["outer"]), _leaves(got["outer"])):
    np.testing.assert_array_equal(a, b)


def _bump(x):
  """Worker 3's copy moved far away."""
  x = np.array(x)
  x[3] += 100.0
  return x


def test_a_module_whose_users_all_have_weight_0_is_unchanged(monkeypatch):
  runtime, _, sync, data, state = _setup(monkeypatch)
  sync.set_weights([1.0, 1.0, 0.0, 0.0])  # Level-0 expert 1: no users.
  _, before, after = _round(runtime, sync, state, data, 1)
  frozen = lambda tree: jax.tree.map(lambda x: x[1], tree)
  moving = lambda tree: jax.tree.map(lambda x: x[0], tree)
  assert any(np.any(m != 0) for m in _leaves(frozen(_momentum(
      before["outer"], LEVEL0)))), "momentum alone would have moved it"
  for a, b in zip(_leaves(frozen(before["outer"]["params"][LEVEL0])),
                  _leaves(frozen(after["outer"]["params"][LEVEL0]))):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(_leaves(frozen(_momentum(before["outer"], LEVEL0))),
                  _leaves(frozen(_momentum(after["outer"], LEVEL0)))):
    np.testing.assert_array_equal(a, b)
  # Its users restart from it; expert 0 of the same slot did move.
  for w in (2, 3):
    for a, b in zip(_leaves(frozen(after["outer"]["params"][LEVEL0])),
                    _leaves(jax.tree.map(lambda x, w=w: x[w],
                                         after["inner"]["params"][LEVEL0]))):
      np.testing.assert_array_equal(a, b)
  assert not all(np.array_equal(a, b) for a, b in zip(
      _leaves(moving(before["outer"]["params"][LEVEL0])),
      _leaves(moving(after["outer"]["params"][LEVEL0]))))


def test_all_weights_zero_is_a_clear_error():
  config = testing.tiny_config("2x2", inner_steps=2, num_steps=2)
  sync = sync_lib.InProcessSync(testing.tiny_runtime(config))
  try:
    sync.set_weights([0.0, 0.0, 0.0, 0.0])
  except ValueError as e:
    assert "not all 0" in str(e)
  else:
    raise AssertionError("all-zero weights were accepted")


class _OneRoundLate:
  """Applies round r's outer step at the end of round r + 1 (the order a
  DiLoCoX synchronizer needs from the loop); records every call."""

  delay = 1

  def __init__(self, runtime):
    self.inner = sync_lib.InProcessSync(runtime)
    self.calls = []

  def start(self, round_index, state):
    self.calls.append(("start", round_index, int(state["step"])))
    return self.inner.start(round_index, state)

  def finish(self, round_index, state):
    self.calls.append(("finish", round_index, int(state["step"])))
    return self.inner.finish(round_index, state)


def test_the_loop_finishes_a_delayed_round_one_round_late(tmp_path):
  config = testing.tiny_config("2x2", inner_steps=2, num_steps=6)
  runtime = testing.tiny_runtime(config)
  sync = _OneRoundLate(runtime)
  data = testing.RandomBatches(4, 8, config.data.seq_len)
  result = loop.train(runtime, data, str(tmp_path), {}, "late",
                      synchronizer=sync)
  assert sync.calls == [("start", 0, 2), ("start", 1, 4), ("finish", 0, 4),
                        ("start", 2, 6), ("finish", 1, 6), ("finish", 2, 6)]
  # The last round is applied before the final checkpoint: right after an
  # outer step every worker holds its modules' outer copy.
  host = jax.device_get(result.state)
  for w, e in enumerate([0, 0, 1, 1]):
    for a, b in zip(_leaves(jax.tree.map(lambda x, w=w: x[w],
                                         host["inner"]["params"][LEVEL0])),
                    _leaves(jax.tree.map(lambda x, e=e: x[e],
                                         host["outer"]["params"][LEVEL0]))):
      np.testing.assert_array_equal(a, b)
