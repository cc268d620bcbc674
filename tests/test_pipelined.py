"""Pipeline stages inside a worker (model/pipelined.py) on 8 fake devices.

A pipelined step computes what the plain step computes, in another order:
each row's forward pass is the same, and the gradient is summed over
microbatches instead of over the whole batch at once. In float32 (the tiny
config's compute dtype) on CPU the losses come out equal to ~1e-6 and every
leaf of the state (parameters, AdamW moments, bank, outer momentum) to
~3e-7 after 4-6 AdamW steps and 2-3 outer steps; the tests allow rtol 1e-5
/ atol 2e-6 on losses and atol 1e-5 on the state. A resumed pipelined run
equals the uninterrupted one exactly.
"""

import jax
import numpy as np
import pytest

from dipaco_jax import config_base
from dipaco_jax import testing
from dipaco_jax.stages import run_configs
from dipaco_jax.train import loop
from dipaco_jax.train import metrics as metrics_lib

_LOSS_TOL = {"rtol": 1e-5, "atol": 2e-6}
_STATE_ATOL = 1e-5


def _config(shape, stages, microbatches, inner_steps, num_steps):
  c = testing.tiny_config(shape, inner_steps=inner_steps,
                          num_steps=num_steps)
  c.pipeline.stages = stages
  c.pipeline.microbatches = microbatches
  return c


def _start_like(runtime, host_state):
  """`runtime` (a fresh one: this changes it) starts from `host_state` (a
  plain runtime's init, the same numbers: pipelining changes only the
  shardings), placed by its own shardings; this also spares the pipelined
  runtime an init compile."""
  runtime.init_state = lambda key: jax.device_put(host_state,
                                                  runtime.state_shardings)


def _run_steps(runtime, num_steps):
  """Inner steps with an outer step every H; the state on device and the
  losses [T, W]."""
  state = runtime.init_state(jax.random.key(0))
  h = runtime.config.diloco.inner_steps
  data = testing.RandomBatches(runtime.topology.num_workers, 8,
                               runtime.config.data.seq_len)
  losses = []
  for step in range(num_steps):
    state, metrics = runtime.inner_step(state,
                                        runtime.worker_rows(data.batch(step)))
    if h and (step + 1) % h == 0:
      state = runtime.outer_step(state, runtime.outer_weights_W)
    losses.append(np.asarray(metrics["loss"]))
  return state, np.stack(losses)


def _assert_states_close(want, got):
  want, got = jax.device_get((want, got))
  assert jax.tree.structure(want) == jax.tree.structure(got)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(want),
                          jax.tree.leaves(got)):
    np.testing.assert_allclose(b, a, rtol=0, atol=_STATE_ATOL,
                               err_msg=jax.tree_util.keystr(path))


def test_four_stage_path_equals_the_plain_path():
  # One path of one 4-layer segment, data-parallel over 2 devices in both
  # runs; the pipelined run puts 4 stages on top (8 devices), one layer
  # each. (2 stages: the next test, on two paths; each stage count costs a
  # compile of its own, so the tests share them out.)
  steps, stages, micro = 4, 4, 4  # Two rounds of H = 2: two outer steps.
  plain = testing.tiny_runtime(_config("1", 1, 1, 2, steps),
                               devices=jax.devices()[:2])
  start = jax.device_get(plain.init_state(jax.random.key(0)))
  want_state, want_losses = _run_steps(plain, steps)
  runtime = testing.tiny_runtime(_config("1", stages, micro, 2, steps),
                                 devices=jax.devices()[:2 * stages],
                                 fresh=True)
  assert dict(runtime.mesh.shape) == {"path": 1, "stage": stages,
                                      "data": 2, "fsdp": 1, "tensor": 1}
  assert runtime.bubble_fraction == pytest.approx(3 / 7)  # (S-1)/(M+S-1)
  _start_like(runtime, start)
  got_state, got_losses = _run_steps(runtime, steps)
  np.testing.assert_allclose(got_losses, want_losses, **_LOSS_TOL)
  _assert_states_close(want_state, got_state)
  # Each stage's devices hold only their layer, and so their own AdamW
  # moments and outer momentum (the dual optimizer policy): the worker's
  # params, mu and nu, the bank and its Nesterov trace, as the steps
  # left them.
  gate_ups = [(jax.tree_util.keystr(path), leaf) for path, leaf in
              jax.tree_util.tree_leaves_with_path(got_state)
              if "gate_up" in jax.tree_util.keystr(path)]
  assert len(gate_ups) == 5, [k for k, _ in gate_ups]
  for key, leaf in gate_ups:
    assert leaf.sharding.spec[1] == "stage", (key, leaf.sharding)
    assert leaf.addressable_shards[0].data.shape[1] == 1, key


@pytest.mark.parametrize("layers,stages,micro,bubble", [
    (4, 2, 4, 1 / 9),  # M > S: microbatches wait M - S ticks between laps.
    # M = S: each goes round again at once.
    (8, 4, 4, 3 / 11),
])
def test_circular_schedule_equals_the_plain_path(layers, stages, micro,
                                                 bubble):
  # One path of two equal segments (shape 1x1): the circular schedule runs
  # both in one pipeline, each microbatch going round the stages twice;
  # the bubble is (S-1)/(G M + S-1) against GPipe's (S-1)/(M + S-1).
  def config(stages, micro):
    c = _config("1x1", stages, micro, inner_steps=2, num_steps=4)
    c.model.num_layers = layers
    c.pipeline.schedule = "circular"
    return c
  plain = testing.tiny_runtime(config(1, 1), devices=jax.devices()[:2])
  start = jax.device_get(plain.init_state(jax.random.key(0)))
  want_state, want_losses = _run_steps(plain, 4)
  runtime = testing.tiny_runtime(config(stages, micro),
                                 devices=jax.devices()[:2 * stages],
                                 fresh=True)
  assert runtime.pipeline.segments == 2
  assert runtime.bubble_fraction == pytest.approx(bubble)
  assert "circular over 2 segments" in runtime.pipeline.describe()
  _start_like(runtime, start)
  got_state, got_losses = _run_steps(runtime, 4)
  np.testing.assert_allclose(got_losses, want_losses, **_LOSS_TOL)
  _assert_states_close(want_state, got_state)


def _step_temp_bytes(runtime):
  """XLA's temporary memory per device for the compiled inner step, as
  XLA:CPU compiles it by default (with its fusion emitters, which the
  tests' flags turn off for compile time, tests/conftest.py: the older
  emitter's buffers say less about what a run needs)."""
  state = runtime.init_state(jax.random.key(0))
  batch = runtime.worker_rows(testing.RandomBatches(
      runtime.topology.num_workers, 8, runtime.config.data.seq_len).batch(0))
  compiled = runtime.inner_step.jitted.lower(state, batch).compile(
      compiler_options={"xla_cpu_use_fusion_emitters": True})
  return compiled.memory_analysis().temp_size_in_bytes


def test_circular_schedule_keeps_no_parameter_copy_per_tick():
  # Each tick indexes its lap's segment out of the stacked parameters; a
  # backward pass that kept those slices held G M + S - 1 copies of a
  # stage's layers (the 3.8B model asked for 124 GiB a GPU). Rematerialized
  # per tick, the circular step needs about GPipe's temporary memory (on
  # this shape 41.0 MB against GPipe's 40.7 MB; 148 MB when it kept them).
  def config(schedule):
    c = _config("1x1", 2, 8, inner_steps=2, num_steps=4)
    c.model.num_layers, c.model.d_model, c.model.mlp_dim = 8, 256, 1024
    c.model.remat = "full"
    c.pipeline.schedule = schedule
    return c
  devices = jax.devices()[:2]
  gpipe, circular = (_step_temp_bytes(testing.tiny_runtime(
      config(s), devices=devices)) for s in ("gpipe", "circular"))
  assert circular < 1.25 * gpipe, (circular, gpipe)


def _logged_losses(run_dir):
  rows = metrics_lib.read_jsonl(run_dir / "logs" / "train" / "metrics.jsonl")
  return {r["step"]: r["last_loss"] for r in rows}  # The last row wins.


def test_two_stage_paths_match_plain_and_resume_mid_round(tmp_path):
  # Two DiPaCo paths (shape 2x1: two segments; level 0 has 2 experts,
  # level 1 one module both paths share and the outer step mixes), vmapped
  # over `path`, each a 2-stage pipeline: mesh path 2 x stage 2 x data 2.
  def config(stages):
    c = _config("2x1", stages, 4, inner_steps=2, num_steps=6)
    c.train.log_every = 1
    c.ckpt.every = 3  # Mid-round: rounds end at 2, 4, 6.
    return c
  data = testing.RandomBatches(2, 8, config(1).data.seq_len)
  plain_runtime = testing.tiny_runtime(config(1))
  start = jax.device_get(plain_runtime.init_state(jax.random.key(0)))
  plain = loop.train(plain_runtime, data, str(tmp_path / "plain"),
                     {"h": "1"}, "plain")
  runtime = testing.tiny_runtime(config(2), fresh=True)
  assert dict(runtime.mesh.shape)["stage"] == 2
  _start_like(runtime, start)
  straight = loop.train(runtime, data, str(tmp_path / "straight"),
                        {"h": "1"}, "straight")
  want, got = _logged_losses(tmp_path / "plain"), _logged_losses(
      tmp_path / "straight")
  assert sorted(got) == list(range(1, 7))
  np.testing.assert_allclose([got[s] for s in sorted(got)],
                             [want[s] for s in sorted(got)], **_LOSS_TOL)
  _assert_states_close(plain.state, straight.state)

  class Preempted(Exception):
    pass

  def die_at_4(step, state, losses):
    del state, losses
    if step == 4:
      raise Preempted()
  with pytest.raises(Preempted):
    loop.train(runtime, data, str(tmp_path / "resumed"), {"h": "1"}, "r",
               hooks=[die_at_4])
  resumed = loop.train(runtime, data, str(tmp_path / "resumed"), {"h": "1"},
                       "r")
  assert resumed.resumed_from == 3
  for a, b in zip(jax.tree.leaves(jax.device_get(straight.state)),
                  jax.tree.leaves(jax.device_get(resumed.state))):
    np.testing.assert_array_equal(a, b)
  again = _logged_losses(tmp_path / "resumed")
  for step in range(4, 7):
    assert again[step] == got[step], step


@pytest.mark.parametrize("overrides,field", [
    ({"pipeline.stages": 3}, "pipeline.stages"),  # 4 layers / 3 stages
    ({"pipeline.microbatches": 1}, "pipeline.microbatches"),  # < stages
    ({"pipeline.microbatches": 3}, "pipeline.microbatches"),  # 8 rows / 3
    ({"pipeline.microbatches": 8}, "pipeline.microbatches"),  # 1 row / data
    ({"mesh.stage": 4}, "mesh.stage"),  # neither 1 nor the stages
    ({"pipeline.stages": 1, "mesh.stage": 2}, "mesh.stage"),  # no pipeline
    ({"model.scan_layers": False}, "model.scan_layers"),
    ({"pipeline.stages": 0}, "pipeline.stages"),
    ({"pipeline.schedule": "1f1b"}, "pipeline.schedule"),
    # Circular laps need segments of one length (here 2 and 4 layers).
    ({"pipeline.schedule": "circular", "paths.shape": "1x1",
      "model.num_layers": 6, "paths.layers_per_level": "2,4"},
     "pipeline.schedule"),
])
def test_pipeline_config_errors_name_the_field(overrides, field):
  config = run_configs.derive_config(_config("1", 2, 2, 0, 8), **overrides)
  with pytest.raises(config_base.ConfigError, match=f"config.{field}"):
    config_base.validate(config, num_devices=8)


def test_pipeline_fields_enter_the_hash_only_when_used():
  config = testing.tiny_config("1")
  plain = run_configs.training_hash(config)
  unused = run_configs.derive_config(config, **{
      "pipeline.microbatches": 4, "mesh.stage": 1})
  assert run_configs.training_hash(unused) == plain
  two_stages = run_configs.derive_config(config, **{"pipeline.stages": 2})
  assert run_configs.training_hash(two_stages) != plain
  # The schedule field came later: a GPipe run keeps its earlier hash.
  gpipe = dict(run_configs.training_fields(two_stages)["pipeline"])
  assert "schedule" not in gpipe
  assert run_configs.training_hash(run_configs.derive_config(
      two_stages, **{"pipeline.schedule": "circular"})) != (
          run_configs.training_hash(two_stages))
