"""Two processes (4 fake CPU devices each) run the job as one 8-device mesh
and get the numbers a single 8-device process gets."""

import json
import os
import socket
import subprocess
import sys

import numpy as np

import test_pipeline  # pylint: disable=g-bad-import-order  (tests/ is on sys.path)

# No base stage (token-embedding routing): it trains as the dense run does.
_FLAGS = ["--config.base.num_steps=0",
          "--config.routing.features=token_embedding",
          "--config.train.num_steps=8",
          "--config.diloco.inner_steps=4", "--config.eval.early_stopping=True",
          "--config.routing.router_fraction=0.2",
          "--config.eval.reroute_every=16",
          # The learned window router is fit on process 0's host alone (a
          # third of a job's time here); the re-routed scores stay.
          "--config.eval.learned_reroute=False"]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _command(workdir, *extra):
  return [sys.executable, "-m", "dipaco_jax.main",
          "--config=experiments/quickstart.py", f"--workdir={workdir}",
          *test_pipeline.TINY_FLAGS, *_FLAGS, *extra]


_ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}
_CWD = os.path.dirname(os.path.dirname(__file__))


def _run_two_processes(tmp_path, *extra, alongside=()):
  """Runs the job as 2 processes of 4 CPU devices; returns (return codes,
  stdout, stderr) per process. `alongside`: another command started with
  them (its output in tmp_path/alongside.*), whose code comes last: the
  two processes wait on each other at every collective, and it fills the
  cores meanwhile."""
  address = f"localhost:{_free_port()}"
  logs = [(tmp_path / f"process_{i}.out", tmp_path / f"process_{i}.err")
          for i in range(2)]
  commands = [_command(tmp_path / "two", "--fake_devices=4", "--distributed",
                       f"--coordinator_address={address}",
                       "--num_processes=2", f"--process_id={i}", *extra)
              for i in range(2)]
  if alongside:
    logs.append((tmp_path / "alongside.out", tmp_path / "alongside.err"))
    commands.append(list(alongside))
  procs = []
  try:
    for command, (out, err) in zip(commands, logs):  # files, not pipes:
      with out.open("w") as out_f, err.open("w") as err_f:  # none can block
        procs.append(subprocess.Popen(
            command, stdout=out_f, stderr=err_f, text=True, cwd=_CWD,
            env=_ENV))
    codes = [p.wait(timeout=900) for p in procs]
  finally:  # A wait that timed out (or a failed start) leaves none running.
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait(timeout=30)
  return codes, [o.read_text() for o, _ in logs], [
      e.read_text() for _, e in logs]


def test_two_processes_match_one(tmp_path):
  # The single 8-device process runs beside the two.
  codes, outs, errs = _run_two_processes(
      tmp_path, alongside=_command(tmp_path / "one", "--fake_devices=8"))
  for code, err in zip(codes, errs):
    assert code == 0, err[-3000:]
  assert "[dipaco] step" in outs[0]  # process 0 reports progress,
  assert "[dipaco] step" not in outs[1]  # the others stay quiet
  two = json.loads((tmp_path / "two" / "results.json").read_text())
  want = json.loads((tmp_path / "one" / "results.json").read_text())
  assert two["models"].keys() == want["models"].keys()
  for name, model in want["models"].items():
    assert two["models"][name]["tokens"] == model["tokens"]
    np.testing.assert_allclose(two["models"][name]["loss"], model["loss"],
                               rtol=1e-5, err_msg=name)
  assert [p["train_documents"] for p in two["paths"]] == [
      p["train_documents"] for p in want["paths"]]
  assert [p["early_stopping_step"] for p in two["paths"]] == [
      p["early_stopping_step"] for p in want["paths"]]


def test_a_failed_stage_on_process_0_stops_every_process(tmp_path):
  """Process 0 finds the validation split empty in the data stage; the other
  process stops with an error naming the stage instead of waiting."""
  codes, _, errs = _run_two_processes(
      tmp_path, "--config.data.max_corpus_chars=3000",
      "--config.data.validation_fraction=0.01")
  assert codes[0] != 0 and "validation split" in errs[0]
  assert codes[1] != 0 and "Process 0 failed in the stage 'data'" in errs[1]
