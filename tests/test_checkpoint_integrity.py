"""Checkpoints verified on read: damaged ones are reported, set aside, and
an older intact one is used; resume from it is still exact."""

import errno
import json
import shutil

import jax
import numpy as np
import pytest

from dipaco_jax import testing
from dipaco_jax.testing import damage as damage_lib
from dipaco_jax.train import checkpoint as ckpt_lib
from dipaco_jax.train import loop

HASHES = {"h": "1"}
NUM_STEPS = 8


class Preempted(Exception):
  pass


def _config():
  config = testing.tiny_config(num_steps=NUM_STEPS)
  config.train.log_every = 1
  config.ckpt.every = 2
  config.ckpt.keep = 3
  return config


def _data(config):
  return testing.RandomBatches(1, 8, config.data.seq_len)


def _host_leaves(state):
  return jax.tree.leaves(jax.device_get(state))


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """The final state of an uninterrupted run."""
  config = _config()
  result = loop.train(testing.tiny_runtime(config), _data(config),
                      str(tmp_path_factory.mktemp("straight")), HASHES, "s")
  return _host_leaves(result.state)


@pytest.fixture(scope="module")
def preempted(tmp_path_factory):
  """A run killed after step 7: it kept the checkpoints of steps 2, 4, 6."""
  config = _config()
  run_dir = tmp_path_factory.mktemp("preempted")

  def die(step, state, losses):
    del state, losses
    if step == 7:
      raise Preempted(step)

  with pytest.raises(Preempted):
    loop.train(testing.tiny_runtime(config), _data(config), str(run_dir),
               HASHES, "p", hooks=[die])
  return run_dir


@pytest.fixture
def run_dir(preempted, tmp_path):
  """A private copy of the preempted run, to damage."""
  copy = tmp_path / "run"
  shutil.copytree(preempted, copy)
  return copy


def _resume(run_dir):
  config = _config()
  return loop.train(testing.tiny_runtime(config), _data(config),
                    str(run_dir), HASHES, "r")


def _assert_same_training_state(state, restored):
  """The parts a checkpoint holds (`inner`, `outer`), leaf by leaf."""
  for a, b in zip(_host_leaves({k: state[k] for k in ("inner", "outer")}),
                  _host_leaves({k: restored[k] for k in ("inner", "outer")}),
                  strict=True):
    np.testing.assert_array_equal(a, b)


def _restore_latest(run_dir, hashes=None):
  """`restore_latest` alone: no training, for the damage kinds whose resume
  is the same as a bit flip's."""
  config = _config()
  ckpt = ckpt_lib.Checkpointer(str(run_dir / "checkpoints"), 2, 3)
  try:
    return ckpt.restore_latest(testing.tiny_runtime(config).abstract_state,
                               hashes or HASHES)
  finally:
    ckpt.close()


# Damage, placed where it changes a stored value (see
# dipaco_jax/testing/damage.py).


def _damage(run_dir, step, item, kind=damage_lib.flip_bit):
  return damage_lib.damage_that_matters(
      run_dir / "checkpoints" / str(step) / item, kind)


def _lines(capsys):
  return [l for l in capsys.readouterr().out.splitlines()
          if l.startswith("[ckpt]")]


def test_async_saves_write_one_checksums_file_per_kept_step(preempted):
  ckpt_dir = preempted / "checkpoints"
  steps = sorted(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit())
  sums = sorted(int(p.stem) for p in (ckpt_dir / "checksums").glob("*.json"))
  assert steps == sums == [2, 4, 6]


def test_bit_flip_in_latest_falls_back_and_resume_is_exact(
    run_dir, straight, capsys):
  _damage(run_dir, 6, "inner")
  result = _resume(run_dir)
  lines = _lines(capsys)
  assert result.resumed_from == 4
  assert lines[0].startswith("[ckpt] checkpoint step 6 is damaged (inner:")
  assert lines[0].endswith("falling back")
  assert lines[1] == "[ckpt] restored step 4 (newest intact; step 6 damaged)"
  for a, b in zip(straight, _host_leaves(result.state), strict=True):
    np.testing.assert_array_equal(a, b)
  # Set aside, so step 6 could be saved again; every kept step is verified.
  ckpt_dir = run_dir / "checkpoints"
  assert (ckpt_dir / "damaged" / "6").is_dir()
  assert sorted(int(p.stem) for p in (ckpt_dir / "checksums").glob("*.json")
               ) == [4, 6, 8]
  assert _restore_latest(run_dir)[2] == 8


def test_damaged_earlier_checkpoint_is_not_used_when_the_latest_is_intact(
    run_dir, straight, capsys):
  _damage(run_dir, 4, "outer")
  result = _resume(run_dir)
  assert result.resumed_from == 6
  assert not _lines(capsys)
  for a, b in zip(straight, _host_leaves(result.state), strict=True):
    np.testing.assert_array_equal(a, b)


def test_truncated_latest_and_flipped_earlier_fall_back_to_the_oldest(
    run_dir, straight, capsys):
  _damage(run_dir, 6, "inner", damage_lib.truncate)
  _damage(run_dir, 4, "inner")
  result = _resume(run_dir)
  lines = _lines(capsys)
  assert result.resumed_from == 2
  assert [l.split(" is ")[0] for l in lines[:2]] == [
      "[ckpt] checkpoint step 6", "[ckpt] checkpoint step 4"]
  assert lines[2] == (
      "[ckpt] restored step 2 (newest intact; step 6 damaged, step 4 damaged)")
  for a, b in zip(straight, _host_leaves(result.state), strict=True):
    np.testing.assert_array_equal(a, b)


def test_every_checkpoint_damaged_is_one_clear_error(run_dir, capsys):
  for step in (2, 4, 6):
    _damage(run_dir, step, "outer")
  with pytest.raises(ckpt_lib.CheckpointDamagedError) as error:
    _restore_latest(run_dir)
  message = str(error.value)
  assert "\n" not in message
  assert str(run_dir / "checkpoints") in message
  assert "fresh --workdir" in message
  assert len(_lines(capsys)) == 3
  assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
      "checksums", "damaged"]


@pytest.mark.parametrize("damage", [
    "truncate", "overwrite_64k", "item_metadata_deleted",
    "meta_metadata_deleted", "checksums_deleted", "checksums_garbled",
    "meta_edited", "array_changed"])
def test_damaged_latest_falls_back(run_dir, damage, capsys):
  step_dir = run_dir / "checkpoints" / "6"
  sums = run_dir / "checkpoints" / "checksums" / "6.json"
  if damage == "truncate":
    _damage(run_dir, 6, "inner", damage_lib.truncate)
  elif damage == "overwrite_64k":
    _damage(run_dir, 6, "outer", damage_lib.overwrite_64k)
  elif damage == "item_metadata_deleted":
    (step_dir / "inner" / "_METADATA").unlink()
  elif damage == "meta_metadata_deleted":
    (step_dir / "meta" / "metadata").unlink()
  elif damage == "checksums_deleted":  # Deleted, or from before checksums.
    sums.unlink()
  elif damage == "checksums_garbled":
    sums.write_text(sums.read_text()[:-10])
  elif damage == "meta_edited":  # Still valid JSON, with another step.
    meta = step_dir / "meta" / "metadata"
    meta.write_text(meta.read_text().replace('"step": 6', '"step": 7'))
  elif damage == "array_changed":  # What a flip orbax reads silently does.
    digests = json.loads(sums.read_text())
    key = sorted(digests["outer"])[0]
    digests["outer"][key] = "0" * 64
    sums.write_text(json.dumps(digests))
  _, meta, step = _restore_latest(run_dir)
  lines = _lines(capsys)
  assert (step, meta["step"]) == (4, 4)
  assert len(lines) == 2, lines
  word = "incomplete" if damage == "checksums_deleted" else "damaged"
  assert lines[0].startswith(f"[ckpt] checkpoint step 6 is {word}")
  assert not (run_dir / "checkpoints" / "6").exists()
  if damage == "array_changed":
    assert f"(outer: digest mismatch in {key}; file " in lines[0]


def test_checkpoints_from_before_checksums_load_unverified(run_dir,
                                                           capsys):
  # A workdir made by an older dipaco_jax has no checksums/ at all.
  shutil.rmtree(run_dir / "checkpoints" / "checksums")
  _, meta, step = _restore_latest(run_dir)
  assert (step, meta["step"]) == (6, 6)
  assert "predates checksums" in _lines(capsys)[0]


def test_a_save_cut_short_is_removed_and_resume_is_exact(run_dir, straight,
                                                        capsys):
  # A kill past the preemption grace (or a full disk) leaves the step's
  # temporary directory, as large as a checkpoint: each restart kept one
  # more until a 126M run filled its disk. Step 7's (a preemption save;
  # not a periodic step, so no later save of it replaces the directory).
  ckpt_dir = run_dir / "checkpoints"
  shutil.copytree(ckpt_dir / "6", ckpt_dir / "7.orbax-checkpoint-tmp")
  result = _resume(run_dir)
  assert result.resumed_from == 6
  assert _lines(capsys)[0] == (
      "[ckpt] removing unfinished checkpoint(s) of step 7 (saves cut "
      f"short) in {ckpt_dir}")
  assert sorted(p.name for p in ckpt_dir.iterdir()) == [
      "4", "6", "8", "checksums"]
  for a, b in zip(straight, _host_leaves(result.state), strict=True):
    np.testing.assert_array_equal(a, b)


def test_a_failed_background_save_stops_the_run_at_once(tmp_path,
                                                       monkeypatch):
  # A 126M run's save at step 1500 of 2250 hit a full disk; the error came
  # at the final save, 750 steps of device time later.
  failed_after = []
  def save_then_fail(self, step, state, meta):
    failed_after.append(step)
  def check_for_errors(self):
    if failed_after:
      raise OSError(errno.ENOSPC, "No space left on device")
  monkeypatch.setattr(ckpt_lib.Checkpointer, "save", save_then_fail)
  monkeypatch.setattr(ckpt_lib.Checkpointer, "check_for_errors",
                      check_for_errors)
  steps = []
  config = _config()
  with pytest.raises(OSError, match="No space left"):
    loop.train(testing.tiny_runtime(config), _data(config),
               str(tmp_path / "run"), HASHES, "f",
               hooks=[lambda step, state, losses: steps.append(step)])
  assert failed_after == [2]  # The first periodic save, and no other.
  assert max(steps) <= 3 < NUM_STEPS


def test_other_run_is_an_error_not_a_fallback(run_dir):
  with pytest.raises(ckpt_lib.CheckpointMismatchError, match="h: checkpoint"):
    _restore_latest(run_dir, hashes={"h": "2"})
  assert not (run_dir / "checkpoints" / "damaged").exists()


def test_sync_saves_are_verified_too(tmp_path):
  config = _config()
  runtime = testing.tiny_runtime(config)
  state = runtime.init_state(jax.random.key(0))
  ckpt_dir = tmp_path / "checkpoints"
  ckpt = ckpt_lib.Checkpointer(str(ckpt_dir), 1, 2, async_save=False)
  for step in (1, 2, 3):
    ckpt.save(step, state, {"hashes": HASHES})
  ckpt.close()
  assert sorted(p.name for p in (ckpt_dir / "checksums").iterdir()) == [
      "2.json", "3.json"]
  _damage(tmp_path, 3, "inner")
  ckpt = ckpt_lib.Checkpointer(str(ckpt_dir), 1, 2, async_save=False)
  restored, _, step = ckpt.restore_latest(runtime.abstract_state, HASHES)
  ckpt.close()
  assert step == 2
  _assert_same_training_state(state, restored)


def test_a_relative_checkpoint_directory_saves_and_resumes(tmp_path,
                                                          monkeypatch):
  # orbax refuses a relative path mid-save ("Checkpoint path should be
  # absolute"); `--workdir=runs/x` must work as an absolute one does.
  monkeypatch.chdir(tmp_path)
  config = _config()
  runtime = testing.tiny_runtime(config)
  state = runtime.init_state(jax.random.key(0))
  ckpt = ckpt_lib.Checkpointer("runs/x/checkpoints", 1, 2)
  ckpt.save(1, state, {"hashes": HASHES})
  ckpt.close()
  assert (tmp_path / "runs/x/checkpoints/checksums/1.json").is_file()
  ckpt = ckpt_lib.Checkpointer("runs/x/checkpoints", 1, 2)
  restored, _, step = ckpt.restore_latest(runtime.abstract_state, HASHES)
  ckpt.close()
  assert step == 1
  _assert_same_training_state(state, restored)
