r"""Peak memory of the main job against the corpus's size: is it flat?

  python bench/corpus_memory.py [--sizes_mb=120,600] [--repeats=1]
      [--root=/tmp/corpus_memory] [--out=FILE]

For each size, generated text of about that many MB: the standard library's
`.py` source copied as often as it takes, every copied file opened by a line
that names its copy (so no two documents are the same text, and the
tokenizer and routing see a corpus of that size, not one copy). On it, the
main job (`experiments/quickstart.py`, the quickstart model) with 2 base
steps and 2 steps a path (H = 2), through `--config.data.corpus=text_files`
like any user's text:

  python -m dipaco_jax.main --config=experiments/quickstart.py
      --workdir=ROOT/run_SIZE --config.data.corpus=text_files
      --config.data.text_glob='ROOT/text_SIZE/**/*.py'
      --config.base.num_steps=2 --config.train.num_steps=2
      --config.diloco.inner_steps=2 --config.ckpt.every=2

Measured from outside the job: the peak of the summed RSS of the job's
process tree (the job and its tokenizer workers), sampled every 0.1 s, and
the job process's own peak (`wait4`'s ru_maxrss); the wall time; the
job's last line when the peak was taken, and a timeline of the RSS (a
point each time it moves by 25 MB). Each size runs --repeats times,
interleaved; the growth is between the medians. Prints a JSON line; --out
also writes it.
"""

import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

from absl import app
from absl import flags

from dipaco_jax.data import corpus_files

_SIZES = flags.DEFINE_list("sizes_mb", ["120", "600"],
                           "corpus sizes to run, in MB of text")
_ROOT = flags.DEFINE_string("root", "/tmp/corpus_memory",
                            "where the corpora and runs are written")
_OUT = flags.DEFINE_string("out", "", "also write the JSON line here")
_EXTRA = flags.DEFINE_multi_string("extra", [],
                                   "more --config overrides for the job")
_REPEATS = flags.DEFINE_integer(
    "repeats", 1, "runs of each size, interleaved (the same job's peak moved "
    "by up to 15% between runs)")

_REPO = pathlib.Path(__file__).resolve().parents[1]


def write_corpus(directory: pathlib.Path, target_bytes: int) -> dict:
  """Copies of the stdlib's source under `directory` until `target_bytes`;
  reuses a finished one (its `done.json`)."""
  done = directory / "done.json"
  if done.exists():
    return json.loads(done.read_text())
  _, files = corpus_files.stdlib_files()
  sources = []
  for name, path in sorted(files.items()):
    try:
      sources.append((name, path.read_bytes()))
    except OSError:
      continue
  written, count, copy = 0, 0, 0
  while written < target_bytes:
    for name, data in sources:
      if written >= target_bytes:
        break
      out = directory / f"copy_{copy:03d}" / name
      out.parent.mkdir(parents=True, exist_ok=True)
      text = f"# copy {copy} of the standard library: {name}\n".encode() + data
      out.write_bytes(text)
      written += len(text)
      count += 1
    copy += 1
  info = {"bytes": written, "files": count, "copies": copy}
  done.write_text(json.dumps(info))
  return info


def _tree_rss_bytes(root_pid: int) -> int:
  """Summed RSS of `root_pid` and its descendants, from /proc."""
  children = {}
  rss = {}
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
      ppid, pages = int(fields[1]), int(fields[21])
    except (OSError, IndexError, ValueError):
      continue
    children.setdefault(ppid, []).append(int(entry))
    rss[int(entry)] = pages * os.sysconf("SC_PAGE_SIZE")
  total, todo = 0, [root_pid]
  while todo:
    pid = todo.pop()
    total += rss.get(pid, 0)
    todo.extend(children.get(pid, ()))
  return total


def _last_line(path: pathlib.Path) -> str:
  """The job's last printed line (where it is when the peak is taken)."""
  with open(path, "rb") as f:
    f.seek(max(0, os.path.getsize(path) - 400))
    lines = f.read().decode("utf-8", "replace").strip().splitlines()
  return lines[-1][:120] if lines else ""


def run_job(corpus_dir: pathlib.Path, workdir: pathlib.Path) -> dict:
  """The main job on `corpus_dir`; its peak memory and wall time."""
  command = [
      sys.executable, "-m", "dipaco_jax.main",
      f"--config={_REPO / 'experiments' / 'quickstart.py'}",
      f"--workdir={workdir}", "--config.data.corpus=text_files",
      f"--config.data.text_glob={corpus_dir}/**/*.py",
      "--config.base.num_steps=2", "--config.train.num_steps=2",
      "--config.diloco.inner_steps=2", "--config.ckpt.every=2",
      *_EXTRA.value]
  log_path = workdir.parent / f"{workdir.name}.log"
  start = time.time()
  peak_tree, peak_line = 0, ""
  timeline = []  # [seconds, MB, the job's last line] when RSS moves 25 MB.
  with open(log_path, "w") as log:
    job = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                           cwd=_REPO)
    while True:
      pid, status, usage = os.wait4(job.pid, os.WNOHANG)
      if pid:
        break
      rss = _tree_rss_bytes(job.pid)
      if not timeline or abs(rss / 2**20 - timeline[-1][1]) > 25:
        timeline.append([round(time.time() - start, 1),
                         round(rss / 2**20), _last_line(log_path)])
      if rss > peak_tree:
        peak_tree, peak_line = rss, _last_line(log_path)
      time.sleep(0.1)
  wall = time.time() - start
  code = os.waitstatus_to_exitcode(status)
  if code:
    raise SystemExit(f"the job failed ({code}); see {log_path}")
  info = json.loads((workdir / "data" / "info.json").read_text())
  return {"peak_tree_rss_mb": round(peak_tree / 2**20, 1),
          "peak_job_rss_mb": round(usage.ru_maxrss / 1024, 1),
          "wall_s": round(wall, 1),
          "train_documents": info["train_documents"],
          "train_tokens": info["train_tokens"], "log": str(log_path),
          "peak_after": peak_line, "timeline": timeline}


def main(argv):
  del argv
  root = pathlib.Path(_ROOT.value)
  rows = {f"{size}mb": [] for size in _SIZES.value}
  for repeat in range(_REPEATS.value):
    for size in _SIZES.value:
      corpus = write_corpus(root / f"text_{size}mb", int(float(size) * 1e6))
      workdir = root / f"run_{size}mb"
      subprocess.run(["rm", "-rf", str(workdir)], check=True)
      row = {"corpus": corpus, **run_job(root / f"text_{size}mb", workdir)}
      rows[f"{size}mb"].append(row)
      print(json.dumps({size: {k: v for k, v in row.items()
                               if k != "timeline"}, "repeat": repeat}),
            flush=True)
  medians = {name: {key: statistics.median(r[key] for r in runs)
                    for key in ("peak_tree_rss_mb", "peak_job_rss_mb",
                                "wall_s")}
             for name, runs in rows.items()}
  first, last = (medians[f"{_SIZES.value[0]}mb"],
                 medians[f"{_SIZES.value[-1]}mb"])
  result = {"runs": rows, "medians": medians,
            "growth_tree_rss": round(
                last["peak_tree_rss_mb"] / first["peak_tree_rss_mb"] - 1, 3),
            "growth_job_rss": round(
                last["peak_job_rss_mb"] / first["peak_job_rss_mb"] - 1, 3),
            "date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count()}
  line = json.dumps(result)
  print(line)
  if _OUT.value:
    pathlib.Path(_OUT.value).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(_OUT.value).write_text(line + "\n")


if __name__ == "__main__":
  app.run(main)
