"""bench/device_call.sh on a stand-in sweep: at its deadline the sweep's
runs get SIGTERM (and later ones too), its lanes still record their arms,
runs that ignore the signal are killed after the grace, and nothing is
left running (checked after every call)."""

import os
import pathlib
import subprocess
import tarfile
import textwrap
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bench" / "device_call.sh"

# A stand-in for `python -m dipaco_jax.main --workdir=W`: its command line
# names the module and the workdir as bench/comm_arms_lib.sh's runs do.
# On SIGTERM it takes 3 s to "save", then exits 1, as main.py does on a
# preemption; a second SIGTERM meanwhile drops the save (exit 2), as
# main.py's does. IGNORE_TERM=1 makes one that ignores the signal.
_FAKE_MAIN = textwrap.dedent("""\
    import os, signal, sys, time
    workdir = sys.argv[-1].split("=", 1)[1]
    def again(*_):
      open(workdir + ".save_dropped", "w").close()
      sys.exit(2)
    def stop(*_):
      signal.signal(signal.SIGTERM, again)
      time.sleep(3)
      open(workdir + ".saved", "w").close()
      sys.exit(1)
    signal.signal(signal.SIGTERM,
                  signal.SIG_IGN if os.environ.get("IGNORE_TERM") else stop)
    time.sleep(300)
    """)

# Two arms in one lane, as bench/comm_arms_lib.sh's run(): each a "main.py"
# run; after it exits the lane writes the arm's log line into arms/ and
# goes on to the next arm. The sweep's own log goes to OUT_DIR.
_SWEEP = textwrap.dedent("""\
    out=$1; work=$2
    mkdir -p "$work/arms" "$out"
    echo "=== sweep started" > "$out/fake_sweep.log"
    (
      for arm in a1 a2; do
        python3 -c "$FAKE_MAIN" dipaco_jax.main --workdir="$work/$arm"
        echo "$arm exited $?" > "$work/arms/$arm.log"
      done
    ) &
    wait
    echo "| arm |" > "$out/summary.md"
    """)


def _call(tmp_path, secs, grace, **env):
  sweep = tmp_path / "fake_sweep.sh"
  sweep.write_text(_SWEEP)
  out, work = tmp_path / "out", tmp_path / "work"
  started = time.monotonic()
  try:
    run = subprocess.run(
        ["bash", str(SCRIPT), str(secs), str(sweep), str(out), str(work)],
        capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "FAKE_MAIN": _FAKE_MAIN, "WHEELS": "",
             "GRACE": str(grace), **env})
    left_running = _still_running(work)
  finally:  # Whatever the script left (a failed test), stopped here.
    subprocess.run(["pkill", "-KILL", "-f", f"--workdir={work}/"],
                   check=False)
  assert not left_running
  return run, time.monotonic() - started, out, work


def _arms_in(archive: pathlib.Path) -> dict[str, str]:
  with tarfile.open(archive) as tar:
    return {pathlib.Path(m.name).name: tar.extractfile(m).read().decode()
            for m in tar.getmembers() if m.isfile()}


def _still_running(work: pathlib.Path) -> bool:
  return subprocess.run(["pgrep", "-f", f"--workdir={work}/"],
                        capture_output=True, check=False).returncode == 0


def test_the_deadline_stops_every_arm_and_the_lanes_record_them(tmp_path):
  run, seconds, out, work = _call(tmp_path, secs=2, grace=30)
  assert run.returncode == 0, run.stderr
  assert "2 s reached; stopping the arms (SIGTERM)" in run.stdout
  assert "killed" not in run.stdout
  # The first arm was stopped by one SIGTERM and "saved"; the lane
  # recorded its exit and started the second, stopped as soon as seen
  # (exit 1 after its save, or 143 if the signal came before its handler
  # was set, as for a main.py still importing: nothing to save yet).
  assert (work / "a1.saved").exists()
  assert not list(work.glob("*.save_dropped"))
  arms = _arms_in(out / "arms.tgz")
  assert arms.pop("a1.log") == "a1 exited 1\n"
  assert arms in ({"a2.log": "a2 exited 1\n"}, {"a2.log": "a2 exited 143\n"})
  # The sweep finished on its own: its log and summary come back.
  assert (out / "fake_sweep.log").read_text() == "=== sweep started\n"
  assert (out / "summary.md").exists()
  assert seconds < 30


def test_runs_that_ignore_sigterm_are_killed_after_the_grace(tmp_path):
  run, seconds, out, work = _call(tmp_path, secs=1, grace=3, IGNORE_TERM="1")
  assert run.returncode == 0, run.stderr
  assert "still running after 3 s; killed" in run.stdout
  assert not (work / "a1.saved").exists()
  # The lane was killed with its run: no arm recorded, but the sweep's log
  # and the arms folder still come back.
  assert (out / "fake_sweep.log").exists()
  assert _arms_in(out / "arms.tgz") == {}
  assert seconds < 30


def test_a_bad_argument_is_one_line_naming_it(tmp_path):
  no_op = tmp_path / "no_op_sweep.sh"  # what would run were a check lost
  no_op.write_text("exit 0\n")
  for args, says in (
      (["ten", str(no_op), str(tmp_path / "out"), str(tmp_path / "work")],
       "device_call: SECS must be whole seconds, got 'ten'; usage: "),
      (["5", "bench/no_such_sweep.sh", str(tmp_path / "out"),
        str(tmp_path / "work")],
       "device_call: no sweep script 'bench/no_such_sweep.sh' (a path from "
       "the repository root, e.g. bench/delay_table.sh)")):
    run = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True,
                         text=True, timeout=30, check=False,
                         env={**os.environ, "WHEELS": ""})
    assert run.returncode == 2
    assert len(run.stderr.splitlines()) == 1 and says in run.stderr
    assert not (tmp_path / "out").exists()  # stopped before anything
