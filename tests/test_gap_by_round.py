"""bench/gap_by_round.py on hand-made arms: each arm's training-loss gap to
the baseline at the end of chosen rounds, from a folder or an arms.tgz."""

import importlib.util
import json
import os
import subprocess
import sys
import tarfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "bench", "gap_by_round.py")
_spec = importlib.util.spec_from_file_location("gap_by_round", SCRIPT)
gap_by_round = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gap_by_round)


def _write(arms, name, loss_by_step):
  rows = [{"step": s, "loss": l} for s, l in loss_by_step.items()]
  rows.insert(0, {"step": 0, "sent_bytes_W": [1.0]})  # not a loss row
  (arms / f"{name}.metrics.jsonl").write_text(
      "".join(json.dumps(r) + "\n" for r in rows))


def test_gaps_are_window_means_at_each_rounds_end(tmp_path):
  arms = tmp_path / "arms"
  arms.mkdir()
  steps = range(10, 101, 10)
  _write(arms, "diloco_x8", {s: 2.0 for s in steps})
  # Behind by 0.5 until step 50, then by 0.1.
  _write(arms, "topk", {s: 2.5 if s <= 50 else 2.1 for s in steps})
  table = gap_by_round.table(arms, "diloco_x8", inner_steps=10,
                             rounds=[3, 5, 10], window=20)
  lines = table.splitlines()
  assert lines[0] == "| arm | round 3 | round 5 | round 10 |"
  # Round 3 ends at step 30: steps 20 and 30 (+0.5); round 5: steps 40, 50;
  # round 10: steps 90, 100 (+0.1). The baseline has no row of its own.
  assert lines[2] == "| topk | +0.500 | +0.500 | +0.100 |"
  assert len(lines) == 3
  # Past the logged steps a cell is empty.
  assert gap_by_round.table(arms, "diloco_x8", 10, [20], 20).splitlines()[
      2] == "| topk |  |"


def test_reads_an_arms_archive_and_names_a_missing_baseline(tmp_path):
  arms = tmp_path / "arms"
  arms.mkdir()
  _write(arms, "diloco_x8", {15: 3.0, 30: 2.0})
  _write(arms, "senders", {15: 3.25, 30: 2.25})
  archive = tmp_path / "arms.tgz"
  with tarfile.open(archive, "w:gz") as tar:
    tar.add(arms, arcname=".")
  run = subprocess.run([sys.executable, SCRIPT, str(archive),
                        "--inner_steps=15", "--rounds=2", "--window=15"],
                       capture_output=True, text=True, check=True)
  assert "| senders | +0.250 |" in run.stdout
  missing = subprocess.run([sys.executable, SCRIPT, str(arms),
                            "--inner_steps=15", "--baseline=none"],
                           capture_output=True, text=True, check=False)
  assert missing.returncode != 0
  assert missing.stderr.strip().splitlines() == [
      f"{arms}: no none.metrics.jsonl nor its progress log (--baseline "
      "names the arm to compare against)"]


def test_a_larger_batchs_arms_meet_their_own_baseline(tmp_path):
  # b128_<arm> (bench/comm_arms_lib.sh: <arm> at 128 sequences per replica
  # step) is compared with b128_diloco_x8, not with diloco_x8; an arm
  # whose batch has no baseline gets no row.
  arms = tmp_path / "arms"
  arms.mkdir()
  _write(arms, "diloco_x8", {15: 3.0})
  _write(arms, "senders", {15: 3.5})
  _write(arms, "b128_diloco_x8", {15: 2.0})
  _write(arms, "b128_senders", {15: 2.25})
  _write(arms, "b64_senders", {15: 2.5})
  lines = gap_by_round.table(arms, "diloco_x8", inner_steps=15, rounds=[1],
                             window=15).splitlines()
  assert lines[2:] == ["| b128_senders | +0.250 |", "| senders | +0.500 |"]


def test_an_arm_cut_short_is_read_from_its_progress_log(tmp_path):
  # A device call's timeout stopped the baseline in its final validation:
  # no metrics.jsonl, only the log main.py wrote (train/metrics.py's
  # progress lines; a dense base's `[base]` lines are another run's).
  arms = tmp_path / "arms"
  arms.mkdir()
  (arms / "b128_none_m08.log").write_text(
      "[data] reusing /tmp/x/data: train 75,086 docs\n"
      "[base] step     10/10  loss 9.0000     1,000 tokens/s  ETA 0:00\n"
      "[main] step     30/60  loss 2.0000   697,360 tokens/s  ETA 0:10\n"
      "[main] step     60/60  loss 1.5000   697,360 tokens/s  ETA 0:00\n"
      "error: preempted by SIGTERM: nothing to save\n")
  _write(arms, "b128_eager", {30: 2.25, 60: 1.625})
  (arms / "b128_eager.log").write_text("[main] step 60/60  loss 1.6250\n")
  assert gap_by_round.logged_losses(
      (arms / "b128_none_m08.log").read_text()) == {30: 2.0, 60: 1.5}
  run = subprocess.run([sys.executable, SCRIPT, str(arms),
                        "--inner_steps=30", "--rounds=1,2", "--window=30",
                        "--baseline=none_m08"],
                       capture_output=True, text=True, check=True)
  assert run.stdout.splitlines()[2:] == ["| b128_eager | +0.250 | +0.125 |"]
