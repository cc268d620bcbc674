"""Checkpoints saved and verified by their shards: two processes (4 fake CPU
devices each) hold half of a 1 GiB state each (`sharded_checkpoint_probe.py`)
and no process gathers the rest, at a save or a restore; a damaged shard of
one process makes every process fall back alike; restores are bit-exact."""

import json
import os
import shutil
import socket
import subprocess
import sys

from dipaco_jax.testing import damage
from dipaco_jax.train import checkpoint as ckpt_lib

_PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      "sharded_checkpoint_probe.py")
_CWD = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _run(directory, action: str, tmp_path) -> list[dict]:
  """Runs the probe's `action` as 2 processes; their reports, and each
  process's stdout under "stdout"."""
  address = f"localhost:{_free_port()}"
  procs, logs = [], []
  try:
    for i in range(2):
      out = tmp_path / f"{action}.{directory.name}.{i}"
      logs.append(out)
      with open(f"{out}.log", "w") as log:
        procs.append(subprocess.Popen(
            [sys.executable, _PROBE, json.dumps({
                "address": address, "process_id": i,
                "directory": str(directory), "action": action,
                "out": f"{out}.json"})],
            stdout=log, stderr=subprocess.STDOUT, cwd=_CWD,
            env={**os.environ, "PYTHONPATH": _CWD}))
    codes = [p.wait(timeout=300) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait(timeout=30)
  for code, out in zip(codes, logs):
    assert code == 0, open(f"{out}.log").read()[-3000:]
  reports = []
  for out in logs:
    with open(f"{out}.json") as f:
      reports.append({**json.load(f), "stdout": open(f"{out}.log").read()})
  return reports


def test_each_process_saves_verifies_and_restores_only_its_shards(tmp_path):
  saved = tmp_path / "checkpoints"
  for report in _run(saved, "save", tmp_path):
    # What a save adds to what the process already holds (its share, on
    # its CPU devices): far below the whole state, which the gathers of
    # before added twice over (2.5 GB here).
    for step in (1, 2):
      extra = report[f"peak_kib_{step}"] - report[f"rss_before_kib_{step}"]
      assert extra < report["whole_kib"] // 4, (step, report)
  sums = json.loads((saved / ckpt_lib.CHECKSUMS_DIR / "2.json").read_text())
  # Keyed by region: each process's 4 row blocks of each array.
  assert sorted(sums["inner"]) == [
      f"['w']@{rows},0:4096" for rows in sorted(
          f"{i * 4096}:{(i + 1) * 4096}" for i in range(8))]

  def restored(directory):
    reports = _run(directory, "restore", tmp_path)
    for report in reports:
      assert report["exact"], report  # Every shard as saved, bit for bit.
    assert len({r["step"] for r in reports}) == 1
    return reports

  clean = tmp_path / "clean"
  shutil.copytree(saved, clean)
  for report in restored(clean):
    assert report["step"] == 2
    # Its share, and what orbax reads at once (RESTORE_IN_FLIGHT_BYTES);
    # the gathers of before added 2.8 GB.
    extra = report["peak_kib"] - report["rss_before_kib"]
    assert extra < report["share_kib"] + report["whole_kib"] // 4, report

  # A bit flipped in a file process 1 wrote (its shards of step 2), where
  # it changes a stored value (testing/damage.py says why it must).
  flipped = tmp_path / "flipped"
  shutil.copytree(saved, flipped)
  damage.damage_that_matters(
      flipped / "2" / "inner",
      lambda path, attempt: (damage.flip_bit(path, attempt)
                             if path.parent.parent.name == "ocdbt.process_1"
                             else None))
  writer = restored(flipped)[0]
  assert writer["step"] == 1
  assert "checkpoint step 2 is damaged (inner: " in writer["stdout"]
  assert (flipped / ckpt_lib.DAMAGED_DIR / "2").is_dir()

  # A digest only process 1 checks (rows 28672-32767 are on its last
  # device): it alone finds the mismatch, and both fall back.
  wrong = tmp_path / "wrong_digest"
  shutil.copytree(saved, wrong)
  path = wrong / ckpt_lib.CHECKSUMS_DIR / "2.json"
  sums = json.loads(path.read_text())
  sums["outer"]["['bank']@28672:32768,0:4096"] = "0" * 64
  path.write_text(json.dumps(sums))
  writer = restored(wrong)[0]
  assert writer["step"] == 1
  assert ("checkpoint step 2 is damaged (outer: digest mismatch on another "
          "process; file ") in writer["stdout"], writer["stdout"]
