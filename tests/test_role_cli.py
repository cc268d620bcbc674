"""The island roles' command lines (`islands/role_cli.py`): absl flags of
each role's own, and a mistake as one line, status 2."""

import pytest

from dipaco_jax.islands import coordinator
from dipaco_jax.islands import executor
from dipaco_jax.islands import role_cli
from dipaco_jax.islands import worker


def _fails(capsys, role, module, *args) -> str:
  with pytest.raises(SystemExit) as e:
    role_cli.parse(role, module.__doc__, module._define_flags,  # pylint: disable=protected-access
                   [role, *args])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1, err
  return err.strip()


def test_a_mistake_on_a_role_command_line_is_one_line(capsys):
  assert _fails(capsys, "coordinator", coordinator) == (
      "[coordinator] error: --store is required (see --help)")
  assert _fails(capsys, "worker", worker, "--store=/s", "--bogus=1") == (
      "[worker] error: Unknown command line flag 'bogus' (see --help)")
  assert _fails(capsys, "executor", executor, "--store=/s",
                "--num_shards=0") == (
      "[executor] error: flag --num_shards=0: 0 is not a positive integer "
      "(see --help)")
  # Each role's flags are its own: all three parse in one process.
  args = role_cli.parse("executor", executor.__doc__,
                        executor._define_flags,  # pylint: disable=protected-access
                        ["executor", "--store=/s", "--shard=1",
                         "--num_shards=2"])
  assert (args.store, args.shard, args.num_shards) == ("/s", 1, 2)


def test_help_lists_the_role_flags(capsys):
  with pytest.raises(SystemExit) as e:
    role_cli.parse("worker", worker.__doc__, worker._define_flags,  # pylint: disable=protected-access
                   ["worker", "--help"])
  assert e.value.code == 0
  out = capsys.readouterr().out
  assert out.startswith(worker.__doc__.split()[0])
  assert "  --store: the run's directory (required)\n" in out
  assert "  --max_idle_s: give up after waiting" in out


def test_a_store_without_a_run_is_one_line(tmp_path, capsys):
  with pytest.raises(SystemExit) as e:
    worker.main(["worker", f"--store={tmp_path}", "--max_idle_s=0",
                 "--worker_id=w"])
  assert e.value.code == 2
  assert capsys.readouterr().err == (
      f"[worker w] error: {tmp_path}/spec.json did not appear in 0 s: is "
      "--store the run's directory (RUN/islands/NAME), and is its launcher "
      "running?\n")
