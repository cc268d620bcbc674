r"""When the accelerator idles in a trace, and what the host was doing then.

  python bench/trace_gaps.py TRACE_DIR [--top=8] [--out=gaps.json]

Reads the newest `perfetto_trace.json.gz` under TRACE_DIR (what
`config.train.profile_steps` or `jax.profiler.trace(...,
create_perfetto_trace=True)` writes) and prints, per device (a process named
`/device:...`): the span from its first to its last op, the time some op
ran (the union of the intervals of the events on any of its lines: streams,
XLA ops, XLA modules; a gap inside one module's run is therefore not
counted, a gap between two dispatches is) and the idle rest; then the longest
idle gaps and, for each, the call stack of every host thread at the gap's
middle (jax's Python tracer records each Python call as an event, so a
thread's stack at time t is the events that contain t, outermost first).
This answers "is the step bound by the host?" for an island worker
against the SPMD loop without opening the trace by hand.
A trace of a CPU run has no device process; the tool then says so.
"""

import argparse
import gzip
import json

import profile_categories  # bench/: find_trace


def load_events(trace_path: str) -> tuple[list[dict], dict, dict]:
  """(complete events, pid -> process name, (pid, tid) -> thread name)."""
  with gzip.open(trace_path, "rt") as f:
    data = json.load(f)
  events = data["traceEvents"] if isinstance(data, dict) else data
  processes, threads = {}, {}
  for e in events:
    if e.get("ph") != "M":
      continue
    name = (e.get("args") or {}).get("name", "")
    if e.get("name") == "process_name":
      processes[e["pid"]] = name
    elif e.get("name") == "thread_name":
      threads[(e["pid"], e.get("tid"))] = name
  complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
  return complete, processes, threads


def busy_intervals(events: list[dict]) -> list[tuple[float, float]]:
  """The union of the events' [ts, ts + dur) intervals, sorted."""
  merged = []
  for start, end in sorted((e["ts"], e["ts"] + e["dur"]) for e in events):
    if merged and start <= merged[-1][1]:
      merged[-1] = (merged[-1][0], max(merged[-1][1], end))
    else:
      merged.append((start, end))
  return merged


def idle_gaps(busy: list[tuple[float, float]]) -> list[tuple[float, float]]:
  """(start, length) of each gap between busy intervals, longest first."""
  gaps = [(a_end, b_start - a_end)
          for (_, a_end), (b_start, _) in zip(busy, busy[1:])]
  return sorted(gaps, key=lambda g: -g[1])


def stacks_at(t: float, host_events: list[dict], threads: dict
              ) -> dict[str, list[str]]:
  """Thread name -> the names of its events containing time t, outermost
  first (threads with none are left out)."""
  out = {}
  for e in host_events:
    if e["ts"] <= t < e["ts"] + e["dur"]:
      key = threads.get((e["pid"], e.get("tid")), f"tid {e.get('tid')}")
      out.setdefault(key, []).append((e["ts"], -e["dur"], e["name"]))
  return {k: [name for _, _, name in sorted(v)] for k, v in out.items()}


def summarize(trace_path: str, top: int = 8, depth: int = 4) -> dict:
  events, processes, threads = load_events(trace_path)
  device_pids = {p for p, n in processes.items() if n.startswith("/device:")}
  host_events = [e for e in events if e["pid"] not in device_pids]
  report = {"trace": trace_path, "devices": []}
  for pid in sorted(device_pids):
    busy = busy_intervals([e for e in events if e["pid"] == pid])
    if not busy:
      continue
    span = busy[-1][1] - busy[0][0]
    ran = sum(end - start for start, end in busy)
    gaps = idle_gaps(busy)
    report["devices"].append({
        "device": processes[pid], "span_ms": span / 1e3,
        "busy_ms": ran / 1e3, "idle_share": 1 - ran / max(span, 1e-9),
        "gaps": [{"at_ms": (start - busy[0][0]) / 1e3, "ms": length / 1e3,
                  "host": {k: v[-depth:] for k, v in stacks_at(
                      start + length / 2, host_events, threads).items()}}
                 for start, length in gaps[:top]]})
  return report


def print_report(report: dict) -> None:
  print(f"trace: {report['trace']}")
  if not report["devices"]:
    print("no device process in this trace (a CPU run): nothing to compare")
  for d in report["devices"]:
    print(f"\n{d['device']}: span {d['span_ms']:.2f} ms, ops running "
          f"{d['busy_ms']:.2f} ms, idle {d['idle_share']:.1%}")
    for g in d["gaps"]:
      print(f"  idle {g['ms']:.3f} ms at +{g['at_ms']:.2f} ms; host then:")
      for thread, stack in sorted(g["host"].items()):
        print(f"    {thread}: {' > '.join(stack)}")


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("trace_dir")
  parser.add_argument("--top", type=int, default=8,
                      help="idle gaps shown per device, longest first")
  parser.add_argument("--depth", type=int, default=4,
                      help="innermost calls shown of each host thread")
  parser.add_argument("--out", default="", help="also write the report here")
  args = parser.parse_args()
  report = summarize(profile_categories.find_trace(args.trace_dir), args.top,
                     args.depth)
  print_report(report)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(report, f, indent=1)


if __name__ == "__main__":
  main()
