"""The lower bound on a training step's memory (train/memory_estimate.py),
against a hand computation; the refusal before the data stage and the
runtime out-of-memory line."""

import dataclasses
import types

import jax
import pytest

from dipaco_jax import cli_errors
from dipaco_jax import config_base
from dipaco_jax import pipeline
from dipaco_jax import testing
from dipaco_jax.islands import launcher
from dipaco_jax.islands import task_runner
from dipaco_jax.islands import worker
from dipaco_jax.train import memory_estimate


def test_the_estimate_of_a_tiny_config_is_the_hand_computation():
  # testing.tiny_config: 1 worker, B = 8 rows of L = 40 tokens, float32
  # (c = 4 bytes), D = 32, H x Dh = 2 x 16 = 32, F = 64, 4 layers, a
  # vocabulary of 512 (a multiple of 128: Vp = 512), remat none.
  c = testing.tiny_config()
  # Parameters: embedding and head 2 x 512 x 32 + final norm 32 = 32,800;
  # a layer: norms 2 x 32, qkv 32 x 3 x 32, out 32 x 32, gate_up
  # 32 x 2 x 64, down 64 x 32 = 64 + 3,072 + 1,024 + 4,096 + 2,048 =
  # 10,304; 4 layers 41,216; in all 74,016.
  assert memory_estimate.path_parameters(c.model, 512) == 74_016
  step = memory_estimate.estimate(c, "xla")
  assert step.device_parts == {
      # 74,016 x (4 params + 8 AdamW + 4 float32 gradient).
      "parameters and optimizer state": 1_184_256,
      # 320 tokens x 4 layers x (D + 4 H Dh + 2 F = 32 + 128 + 128) x 4.
      "activations": 1_474_560,
      # [8, 2, 40, 40] scores: every layer's probabilities, 4 x 4 bytes.
      "attention scores": 409_600,
      # 8 x 40 x 512 logits x 4 bytes.
      "logits": 655_360,
  }
  assert step.host_batch == 8 * 41 * 4  # int32 tokens and their targets
  # DiPaCo 2x2 synchronizing (4 workers, the outer bank and momentum:
  # 74,016 x 8 more), bfloat16 (c = 2), remat full (the layers' inputs),
  # the loss in chunks of 16, cuDNN's attention (no scores kept).
  c = testing.tiny_config("2x2", inner_steps=2)
  c.model.dtype, c.model.remat, c.model.loss_chunk = "bfloat16", "full", 16
  step = memory_estimate.estimate(c, "cudnn")
  assert step.device_parts == {
      "parameters and optimizer state": 4 * 1_184_256 + 592_128,
      "activations": 4 * 320 * 4 * 32 * 2,  # D per token and layer
      "attention scores": 0,
      "logits": 4 * 8 * 16 * 512 * 2,
  }
  # Off the CPU XLA may rematerialize: remat none counts as full there.
  c = testing.tiny_config()
  assert memory_estimate.estimate(c, "xla", cpu=False).device_parts[
      "activations"] == 320 * 4 * 32 * 4


def _big(config):
  config.train.batch_size = 100_000
  config.data.seq_len = 100_000
  return config


def test_a_step_that_surely_does_not_fit_is_refused_naming_the_fields(
    monkeypatch):
  monkeypatch.setattr(memory_estimate, "_capacity", lambda: (
      "memory of one NVIDIA H200", 139 << 30, False))
  monkeypatch.setattr(memory_estimate, "_host_available", lambda: 1 << 40)
  memory_estimate.check([("", testing.tiny_config())])  # fits
  with pytest.raises(config_base.ConfigError) as e:
    memory_estimate.check([("", testing.tiny_config()),
                           ("dense baseline", _big(testing.tiny_config()))])
  message = str(e.value)
  assert message.startswith(
      "config.train.batch_size=100000, config.data.seq_len=100000, "
      "config.model.num_heads=2, config.model.remat=none: a training step "
      "of the dense baseline run needs at least "), message
  assert message.endswith(
      "; a lower bound), more than the 139.0 GiB of memory of one NVIDIA "
      "H200; lower config.train.batch_size or config.data.seq_len "
      "(config.model.remat=full and config.model.loss_chunk=512 also cut "
      "activations and logits)."), message
  # Off the CPU: the activations as remat full, one layer's float32 scores.
  devices = jax.local_device_count()
  assert (f"per device (of {devices}) (attention scores 7.1 PiB, logits "
          "18.6 TiB, activations 4.7 TiB, parameters and optimizer state "
          "1.1 MiB; a lower bound)") in message, message
  # Unknown capacity: nothing is checked.
  monkeypatch.setattr(memory_estimate, "_capacity", lambda: None)
  memory_estimate.check([("", _big(testing.tiny_config()))])


def test_memory_exhausted_at_run_time_is_one_line_naming_the_fields(
    monkeypatch, capsys):
  monkeypatch.setattr(memory_estimate, "_checked", [testing.tiny_config()])
  oom = RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to "
                     "allocate 37.25GiB.\nBFC allocator state: ...")
  want = ("out of memory (RESOURCE_EXHAUSTED: Out of memory while trying to "
          "allocate 37.25GiB.); a training step's size is set by "
          "config.train.batch_size=8, config.data.seq_len=40, "
          "config.model.d_model=32, config.model.num_layers=4, "
          "config.model.remat=none, config.model.loss_chunk=0: lower "
          "config.train.batch_size or config.data.seq_len, or set "
          "config.model.remat=full or config.model.loss_chunk=512.")
  assert memory_estimate.out_of_memory_message(oom) == want
  # numpy's, for the host's batch, raised by the prefetch thread.
  wrapped = RuntimeError("Raised by the prefetch producer at step 0.")
  wrapped.__cause__ = MemoryError("Unable to allocate 37.3 GiB for an array")
  assert memory_estimate.out_of_memory_message(wrapped).startswith(
      "out of memory (Unable to allocate 37.3 GiB for an array); ")
  # A full disk says RESOURCE_EXHAUSTED too; it is not memory.
  assert memory_estimate.out_of_memory_message(RuntimeError(
      "RESOURCE_EXHAUSTED: No space left on device")) is None
  with pytest.raises(SystemExit) as e, cli_errors.user_errors(verbose=False):
    raise oom
  assert e.value.code == 2
  assert capsys.readouterr().err == f"error: {want}\n"


def test_a_job_is_judged_per_device_of_all_its_processes_and_island_tasks(
    monkeypatch):
  c = testing.tiny_config("2x2", inner_steps=2)  # 4 workers
  total = memory_estimate.estimate(c, "xla", cpu=False).device_total
  one_path = memory_estimate.estimate(c, "xla", cpu=False,
                                      workers=1).device_total
  # An estimate of one worker: its state and a quarter of the rest (the
  # outer bank and momentum are the run's, whatever the group).
  assert one_path < total / 3
  devices = jax.local_device_count()
  # Room on each local device for a quarter of the step, not for all of it.
  monkeypatch.setattr(memory_estimate, "_capacity", lambda: (
      "memory of one H100", total // devices // 2, False))
  monkeypatch.setattr(memory_estimate, "_host_available", lambda: 1 << 40)
  with pytest.raises(config_base.ConfigError, match=(
      rf"per device \(of {devices}\)")):
    pipeline.check_memory(c)
  # Two processes of as many devices each share it: half a step a device.
  monkeypatch.setattr(jax, "device_count", lambda: 2 * devices)
  pipeline.check_memory(c)
  monkeypatch.undo()
  monkeypatch.setattr(memory_estimate, "_capacity", lambda: (
      "memory of one H100", total // devices // 2, False))
  monkeypatch.setattr(memory_estimate, "_host_available", lambda: 1 << 40)
  # On islands a step trains a task's group, in each local worker.
  islands = launcher.IslandOptions(num_workers=1, paths_per_task=1)
  pipeline.check_memory(c, islands)
  with pytest.raises(config_base.ConfigError):
    pipeline.check_memory(c, dataclasses.replace(islands, num_workers=4))
  # No local workers: the workers check their own tasks.
  pipeline.check_memory(c, dataclasses.replace(islands, num_workers=0,
                                               paths_per_task=4))


def test_an_island_worker_refuses_a_task_its_devices_cannot_hold(
    monkeypatch):
  c = testing.tiny_config("2x2", inner_steps=2)
  one_path = memory_estimate.estimate(c, "xla", cpu=False,
                                      workers=1).device_total
  monkeypatch.setattr(memory_estimate, "_capacity", lambda: (
      "memory of one H100", one_path // jax.device_count() * 2, False))
  monkeypatch.setattr(memory_estimate, "_host_available", lambda: 1 << 40)
  spec = types.SimpleNamespace(weights_W=[0.25] * 4, paths_per_task=1,
                               config_dict=lambda: c)
  worker._check_memory(spec)  # One path a task fits.
  spec.paths_per_task = 4
  with pytest.raises(task_runner.TaskFailed, match=(
      r"a training step of the island task run needs at least .* A task "
      r"trains 4 paths here: give the launcher fewer --paths_per_task, or "
      r"this worker more devices\.$")):
    worker._check_memory(spec)
