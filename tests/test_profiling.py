"""`train.profile_steps`: which dispatches are traced, the trace files of a
training run, and that tracing changes no number."""

import jax
import numpy as np
import pytest

from dipaco_jax import config_base
from dipaco_jax import config_fields
from dipaco_jax import testing
from dipaco_jax.stages import run_configs
from dipaco_jax.train import loop
from dipaco_jax.train import profiling


def test_the_window_is_parsed_or_refused_naming_the_field():
  assert profiling.parse_window("") is None
  assert profiling.parse_window("3:2") == (3, 5)
  assert profiling.parse_window("1:1") == (1, 2)
  for bad in ("3", "0:2", "3:0", "a:b", "3:2:1", "-1:4"):
    with pytest.raises(config_fields.ConfigError,
                       match=r"config\.train\.profile_steps: .*START:COUNT"):
      profiling.parse_window(bad)
  config = testing.tiny_config()
  config.train.profile_steps = "5"
  with pytest.raises(config_fields.ConfigError, match="profile_steps"):
    config_base.validate(config, num_devices=1)


class _Recorder:
  """Stands in for jax.profiler's start/stop."""

  def __init__(self, monkeypatch):
    self.calls = []
    monkeypatch.setattr(jax.profiler, "start_trace",
                        lambda *a, **k: self.calls.append("start"))
    monkeypatch.setattr(jax.profiler, "stop_trace",
                        lambda: self.calls.append("stop"))


def _dispatch_calls(tmp_path, window, dispatches, monkeypatch):
  """The start/stop calls around each (done, n) dispatch, in order."""
  rec = _Recorder(monkeypatch)
  with profiling.StepTracer(window, tmp_path) as tracer:
    for done, n in dispatches:
      tracer.before(done, n)
      rec.calls.append(f"run {done + 1}-{done + n}")
      tracer.after(done, n, None)
  return rec.calls


def test_the_traced_dispatches_are_those_holding_the_window(tmp_path,
                                                           monkeypatch):
  # Steps numbered from 1 as the progress lines: a dispatch (done, n) runs
  # steps done + 1 .. done + n.
  one_step = [(i, 1) for i in range(6)]
  assert _dispatch_calls(tmp_path, "3:2", one_step, monkeypatch) == [
      "run 1-1", "run 2-2", "start", "run 3-3", "run 4-4", "stop",
      "run 5-5", "run 6-6"]
  four_steps = [(0, 4), (4, 4), (8, 4)]
  # Steps 6-9 span two dispatches: both are traced whole.
  assert _dispatch_calls(tmp_path, "6:4", four_steps, monkeypatch) == [
      "run 1-4", "start", "run 5-8", "run 9-12", "stop"]
  # A window inside one dispatch; a window after the run: no trace.
  assert _dispatch_calls(tmp_path, "2:1", four_steps, monkeypatch) == [
      "start", "run 1-4", "stop", "run 5-8", "run 9-12"]
  assert _dispatch_calls(tmp_path, "20:5", four_steps, monkeypatch) == [
      "run 1-4", "run 5-8", "run 9-12"]
  # A loop that ends (or fails) inside the window still stops the trace.
  assert _dispatch_calls(tmp_path, "5:10", four_steps, monkeypatch) == [
      "run 1-4", "start", "run 5-8", "run 9-12", "stop"]


def test_a_run_writes_its_trace_and_the_same_numbers(tmp_path):
  states = {}
  for window in ("", "3:2"):
    config = testing.tiny_config("1", replicas=2, inner_steps=2, num_steps=6)
    config.train.profile_steps = window
    result = loop.train(
        testing.tiny_runtime(config),
        testing.RandomBatches(2, 8, config.data.seq_len),
        str(tmp_path / (window or "off")), {}, "profiled")
    states[window] = jax.device_get(result.state)
  for a, b in zip(jax.tree.leaves(states[""]), jax.tree.leaves(states["3:2"])):
    np.testing.assert_array_equal(a, b)
  profile = tmp_path / "3:2" / "logs" / "profile"
  assert list(profile.rglob("*.xplane.pb")), list(profile.rglob("*"))
  assert list(profile.rglob("perfetto_trace.json.gz"))
  assert not (tmp_path / "off" / "logs" / "profile").exists()
  # A trace is not a training setting: a run resumes under another window.
  config = testing.tiny_config()
  before = run_configs.training_hash(config)
  config.train.profile_steps = "3:2"
  assert run_configs.training_hash(config) == before


def _python_frames(trace_dir) -> int:
  """Events of the host's Python calls ('$file.py:line name') in a trace."""
  import gzip  # pylint: disable=g-import-not-at-top
  import json  # pylint: disable=g-import-not-at-top
  (path,) = trace_dir.rglob("perfetto_trace.json.gz")
  with gzip.open(path, "rt") as f:
    events = json.load(f)
  events = events.get("traceEvents", events)
  return sum(str(e.get("name", "")).startswith("$") for e in events)


def test_profile_python_false_leaves_the_hosts_python_calls_out(tmp_path):
  """`train.profile_python`: traced Python calls slow the host, so a user
  timing host gaps turns them off; XLA's own events stay."""
  frames = {}
  for python in (True, False):
    with profiling.StepTracer("1:1", tmp_path / str(python),
                              python) as tracer:
      tracer.before(0, 1)
      out = jax.jit(lambda x: x * 2)(np.arange(4.0))
      np.asarray(out).sum()  # Some Python for the tracer to see.
      tracer.after(0, 1, out)
    frames[python] = _python_frames(tmp_path / str(python))
  assert frames[True] > 0
  assert frames[False] == 0
  # Not a training setting either.
  config = testing.tiny_config()
  before = run_configs.training_hash(config)
  config.train.profile_python = False
  assert run_configs.training_hash(config) == before
