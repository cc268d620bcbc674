"""Training loop: resume exactness, non-finite stop, hash checks,
preemption."""

import os
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from dipaco_jax import testing
from dipaco_jax.train import checkpoint as ckpt_lib
from dipaco_jax.train import loop
from dipaco_jax.train import metrics as metrics_lib
from dipaco_jax.train import preemption


class Preempted(Exception):
  pass


def _preempt_after(step_to_die):
  def hook(step, state, losses):
    del state, losses
    if step == step_to_die:
      raise Preempted(step)
  return hook


def _losses(run_dir):
  rows = metrics_lib.read_jsonl(run_dir / "logs" / "train" / "metrics.jsonl")
  by_step = {}
  for r in rows:  # A resumed run logs its steps again; the last one wins.
    by_step[r["step"]] = r["last_loss"]
  return by_step


@pytest.mark.parametrize("shape,replicas", [("2x2", 1), ("1", 2)])
def test_resume_in_the_middle_of_a_round_is_exact(tmp_path, shape, replicas):
  config = testing.tiny_config(shape, replicas=replicas, inner_steps=4,
                               num_steps=12)
  config.train.log_every = 1
  config.ckpt.every = 6  # Mid-round: rounds end at 4, 8, 12.
  workers = 4 if shape == "2x2" else 2
  data = testing.RandomBatches(workers, 8, config.data.seq_len)

  runtime = testing.tiny_runtime(config)
  straight = loop.train(runtime, data, str(tmp_path / "straight"), {"h": "1"},
                        "straight")

  runtime = testing.tiny_runtime(config)
  with pytest.raises(Preempted):
    loop.train(runtime, data, str(tmp_path / "resumed"), {"h": "1"}, "r",
               hooks=[_preempt_after(8)])
  runtime = testing.tiny_runtime(config)
  resumed = loop.train(runtime, data, str(tmp_path / "resumed"), {"h": "1"},
                       "r")
  assert resumed.resumed_from == 6
  for a, b in zip(jax.tree.leaves(jax.device_get(straight.state)),
                  jax.tree.leaves(jax.device_get(resumed.state))):
    np.testing.assert_array_equal(a, b)
  want, got = _losses(tmp_path / "straight"), _losses(tmp_path / "resumed")
  assert sorted(want) == list(range(1, 13))
  for step in range(7, 13):
    assert got[step] == want[step], step


def test_resume_with_other_hashes_is_a_clear_error(tmp_path):
  config = testing.tiny_config(num_steps=2)
  data = testing.RandomBatches(1, 8, config.data.seq_len)
  config.train.num_steps = 2
  loop.train(testing.tiny_runtime(config), data, str(tmp_path), {"corpus": "a"},
             "x")
  config.train.num_steps = 4
  with pytest.raises(ckpt_lib.CheckpointMismatchError, match="corpus"):
    loop.train(testing.tiny_runtime(config), data, str(tmp_path),
               {"corpus": "b"}, "x")


def test_non_finite_loss_stops_with_the_step(tmp_path):
  config = testing.tiny_config(num_steps=6)
  config.inner_opt.learning_rate = 1e30
  config.inner_opt.warmup_steps = 0
  config.inner_opt.grad_clip = 0.0
  data = testing.RandomBatches(1, 8, config.data.seq_len)
  with pytest.raises(FloatingPointError, match="Non-finite loss at step"):
    loop.train(testing.tiny_runtime(config), data, str(tmp_path), {}, "x")


def test_losses_decrease_on_learnable_data(tmp_path):
  config = testing.tiny_config(num_steps=30)
  config.inner_opt.learning_rate = 1e-2

  class Repeating:  # Every row is the same short cycle: easy to learn.
    def batch(self, step, streams=(0,)):
      del step, streams  # one worker
      row = np.tile(np.arange(4, 14), 5)[:config.data.seq_len + 1]
      return np.broadcast_to(row, (1, 8, row.size)).astype(np.int32)

  result = loop.train(testing.tiny_runtime(config), Repeating(),
                      str(tmp_path), {}, "x")
  assert result.final_losses_W[0] < 0.5


def test_reading_metrics_later_changes_no_number(tmp_path):
  """`train.metrics_lag` only moves when the host reads each step's
  metrics: the same losses logged for every step, hooks called for every
  step in order, the same final state."""
  results, seen = {}, {}
  for lag in (1, 3):
    config = testing.tiny_config("1", replicas=2, inner_steps=4, num_steps=8)
    config.train.log_every = 1
    config.train.metrics_lag = lag
    seen[lag] = []
    results[lag] = loop.train(
        testing.tiny_runtime(config), testing.RandomBatches(
            2, 8, config.data.seq_len), str(tmp_path / str(lag)), {}, "lag",
        hooks=[lambda step, state, losses, lag=lag: seen[lag].append(step)])
  assert seen[1] == seen[3] == list(range(1, 9))
  assert _losses(tmp_path / "1") == _losses(tmp_path / "3")
  for a, b in zip(jax.tree.leaves(jax.device_get(results[1].state)),
                  jax.tree.leaves(jax.device_get(results[3].state))):
    np.testing.assert_array_equal(a, b)


def test_each_round_logs_the_bytes_each_worker_sent_once(tmp_path):
  """The compressed contributions' measured bytes, one row per round
  (logged when the round's dispatch drains), none lost or repeated by a
  resume: int4 sends 7-8x fewer bytes than float32."""
  config = testing.tiny_config("1", replicas=2, inner_steps=2, num_steps=8)
  config.diloco.compression = "int4"
  config.train.metrics_lag = 2
  config.ckpt.every = 3  # Mid-round.
  data = testing.RandomBatches(2, 8, config.data.seq_len)
  with pytest.raises(Preempted):
    loop.train(testing.tiny_runtime(config), data, str(tmp_path), {}, "c",
               hooks=[_preempt_after(5)])
  runtime = testing.tiny_runtime(config)
  loop.train(runtime, data, str(tmp_path), {}, "c")
  rows = metrics_lib.read_jsonl(tmp_path / "logs" / "train" /
                                metrics_lib.COMM_LOG)
  assert [r["step"] for r in rows] == [2, 4, 6, 8]
  float32_bytes = 4 * sum(x.size for x in jax.tree.leaves(
      runtime.abstract_state["outer"]["params"]))
  for r in rows:
    assert len(r["sent_bytes_W"]) == 2
    for sent in r["sent_bytes_W"]:
      assert 7 < float32_bytes / sent < 8, (float32_bytes, sent)


def test_callbacks_flush_before_every_checkpoint(tmp_path, monkeypatch):
  """An after-outer-step callback that writes in the background (early
  stopping) is flushed before each checkpoint and at the end, so no
  checkpoint is ahead of what it wrote."""
  events = []

  class Writer:

    def __call__(self, step, state):
      events.append(("outer step", step))

    def flush(self):
      events.append(("flush",))

  save = ckpt_lib.Checkpointer.save
  monkeypatch.setattr(ckpt_lib.Checkpointer, "save", lambda self, step, *a: (
      events.append(("save", step)), save(self, step, *a))[1])
  config = testing.tiny_config("1", replicas=2, inner_steps=2, num_steps=6)
  config.ckpt.every = 4
  loop.train(testing.tiny_runtime(config), testing.RandomBatches(
      2, 8, config.data.seq_len), str(tmp_path), {}, "f",
             after_outer_step=[Writer()])
  assert events == [("outer step", 2), ("outer step", 4), ("flush",),
                    ("save", 4), ("outer step", 6), ("flush",), ("save", 6),
                    ("flush",)]


def _signal_at(step_to_signal):
  """A hook that sends this process a real SIGTERM at that step."""
  def hook(step, state, losses):
    del state, losses
    if step == step_to_signal:
      os.kill(os.getpid(), signal.SIGTERM)
  return hook


_SIGNAL_ITSELF = """
import os, signal, time
from dipaco_jax.train import preemption
with preemption.handle_signals():
  if FINISHED:
    preemption.finished()
  os.kill(os.getpid(), signal.SIGTERM)
  time.sleep(30)
print("not reached")
"""


@pytest.mark.parametrize("finished", [True, False])
def test_a_signal_after_the_work_is_finished_ends_it_quietly(finished):
  # An islands role that saw the run end is stopped by the launcher's
  # SIGTERM wherever it is as it winds down (a garbage collector's
  # callback prints what it raises, a traceback in the role's log): once
  # `finished`, the signal ends it at once, with status 0 and no output;
  # before, it raises `Preempted` as everywhere else.
  script = _SIGNAL_ITSELF.replace("FINISHED", str(finished))
  done = subprocess.run([sys.executable, "-c", script], capture_output=True,
                        text=True, timeout=120, check=False)
  if finished:
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
  else:
    assert done.returncode == 1 and "Preempted" in done.stderr
    assert "not reached" not in done.stdout


def test_sigterm_saves_where_it_lands_and_resumes_exactly(tmp_path):
  # SIGTERM at random steps (mid-round and at a round's end; none is a
  # checkpoint step): the loop saves at the end of that dispatch, stops
  # with `Preempted`, and the resumed run is the uninterrupted one, bit for
  # bit, whatever the signal interrupted.
  config = testing.tiny_config("2x2", inner_steps=4, num_steps=12)
  config.ckpt.every = 0  # Only the last step: each save is the signal's.
  data = testing.RandomBatches(4, 8, config.data.seq_len)
  straight = loop.train(testing.tiny_runtime(config), data,
                        str(tmp_path / "straight"), {"h": "1"}, "straight")
  rng = np.random.default_rng(41)
  run = str(tmp_path / "preempted")
  saved = []
  with preemption.handle_signals():
    for at in sorted(rng.choice(np.arange(2, 11), 2, replace=False)):
      with pytest.raises(preemption.Preempted) as e:
        loop.train(testing.tiny_runtime(config), data, run, {"h": "1"}, "p",
                   hooks=[_signal_at(int(at))])
      assert e.value.signal_name == "SIGTERM" and e.value.step >= at
      assert "run the same command again" in str(e.value)
      saved.append(e.value.step)
      preemption.reset()
  resumed = loop.train(testing.tiny_runtime(config), data, run, {"h": "1"},
                       "p")
  assert resumed.resumed_from == saved[-1] and len(set(saved)) == 2
  for a, b in zip(jax.tree.leaves(jax.device_get(straight.state)),
                  jax.tree.leaves(jax.device_get(resumed.state))):
    np.testing.assert_array_equal(a, b)
