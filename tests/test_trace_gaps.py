"""bench/trace_gaps.py on a hand-made trace: the device's busy time, its
idle gaps and the host threads' stacks in them."""

import gzip
import importlib.util
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "bench", "trace_gaps.py")
sys.path.insert(0, os.path.join(REPO, "bench"))  # its profile_categories
_spec = importlib.util.spec_from_file_location("trace_gaps", SCRIPT)
trace_gaps = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(trace_gaps)


def _meta(pid, name, tid=None):
  e = {"ph": "M", "pid": pid, "name": "thread_name" if tid else
       "process_name", "args": {"name": name}}
  if tid:
    e["tid"] = tid
  return e


def _op(pid, ts, dur, name, tid=1):
  return {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur,
          "name": name}


def _write_trace(tmp_path, with_device=True):
  folder = tmp_path / "plugins" / "profile" / "2026_01_01"
  folder.mkdir(parents=True)
  events = [_meta(1, "/host:CPU"), _meta(1, "python", tid=7),
            _meta(1, "prefetch", tid=8),
            # The main thread's loop, and a save inside it from 13 to 19 us.
            _op(1, 0, 100, "$loop.py:1 train", tid=7),
            _op(1, 13, 6, "$checkpoint.py:9 save", tid=7),
            _op(1, 14, 4, "$items.py:3 to_host", tid=7),
            _op(1, 0, 50, "$prefetch.py:5 run", tid=8)]
  if with_device:
    events += [_meta(2, "/device:GPU:0"),
               # Busy [0, 12) (two overlapping kernels), [20, 30), [31, 40).
               _op(2, 0, 10, "gemm"), _op(2, 5, 7, "fusion.1"),
               _op(2, 20, 10, "fusion.2"), _op(2, 31, 9, "gemm")]
  with gzip.open(folder / "perfetto_trace.json.gz", "wt") as f:
    json.dump({"traceEvents": events}, f)
  return folder / "perfetto_trace.json.gz"


def test_busy_time_gaps_and_the_host_stacks_in_them(tmp_path):
  report = trace_gaps.summarize(str(_write_trace(tmp_path)), top=2, depth=2)
  (gpu,) = report["devices"]
  assert gpu["device"] == "/device:GPU:0"
  assert gpu["span_ms"] == 40 / 1e3 and gpu["busy_ms"] == 31 / 1e3
  assert abs(gpu["idle_share"] - 9 / 40) < 1e-12
  first, second = gpu["gaps"]
  assert (first["at_ms"], first["ms"]) == (12 / 1e3, 8 / 1e3)
  assert (second["at_ms"], second["ms"]) == (30 / 1e3, 1 / 1e3)
  # At the first gap's middle (16 us) the main thread was copying to the
  # host inside the save (its two innermost calls shown, of three); the
  # prefetch thread was in its run loop.
  assert first["host"] == {
      "python": ["$checkpoint.py:9 save", "$items.py:3 to_host"],
      "prefetch": ["$prefetch.py:5 run"]}
  assert second["host"]["python"] == ["$loop.py:1 train"]


def test_the_cli_reports_a_cpu_trace_as_having_no_device(tmp_path):
  _write_trace(tmp_path, with_device=False)
  out = subprocess.run([sys.executable, SCRIPT, str(tmp_path)],
                       capture_output=True, text=True, check=True,
                       timeout=60, cwd=os.path.join(REPO, "bench"))
  assert "no device process in this trace" in out.stdout
