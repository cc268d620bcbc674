r"""Chaos cases (docs/reliability.md) on a small local quickstart.

Called by bench/chaos_local.sh (its header: usage, runtime). Runs every
case below one process at a time, bounds every wait with a timeout, kills
what it started (on a timeout, on an error and on SIGTERM/SIGINT), prints
one table row per case and exits 1 if any case FAILs.

  python3 bench/chaos_local.py [--work DIR] [--out TABLE.md] [--seed N]

The run: experiments/quickstart.py:small made smaller (`SMALL` below: base 20
steps, DiPaCo 2x2 and the dense baseline 40 steps, an outer step and a
checkpoint every 10 steps, 3 kept, no re-routing evaluation), on a corpus of
text files (a copy of ~1.3 MB of the standard library's top-level .py
files, so that case 6 can edit it). The uninterrupted reference is run
once; the other cases start from copies of its workdir (its data/ and
runs/base, or all of it with the checkpoints then damaged).

The cases (one table row each, numbered as in the table): 0 the reference;
1 kill -9 mid-training, rerun; 2-5 damaged checkpoints (a bit flipped,
truncated, 64 KiB overwritten, _METADATA deleted, every kept one damaged);
6 the corpus unchanged / edited, rerun; 7 a second job in the workdir;
8 bad config values; 9 divergence; 10 rerun of a finished workdir;
11 corpora with nothing to read; 12 --workdir a file; 13 SIGTERM
mid-training (exit 75, a checkpoint at the step it stopped), rerun; 14 a
full disk during a checkpoint (a 40 MiB tmpfs: needs `mount`, else NOT
RUN, counted apart from FAIL), then more space, rerun; 15 a step too big
for memory (refused before the data stage); 16 --config files missing or
not Python; 17 exports: generate from a truncated one, --out not empty,
--overwrite; 18 a corpus file with undecodable bytes and a dangling link
(the data stage only).

"Equal" means: the `models` block of results.json (every model's loss and
perplexity) is equal as parsed JSON floats (bit for bit: the floats are
written with repr), AND every array of the final checkpoint (step 40) of
runs/dipaco and runs/dense, both orbax items (`inner`, `outer`), loaded
with orbax as numpy, has the reference's dtype, shape and bytes.

A persistent JAX compilation cache (under the work dir, fresh each time)
is shared by the runs to save compile time; --no_jax_cache turns it off.
The reference compiles cold, so "equal" also holds between fresh and
cached executables.
"""

import argparse
import glob
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from dipaco_jax.testing import damage as damage_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
STEPS, EVERY, KEEP = 40, 10, 3
STEP_DIRS = [STEPS - EVERY * i for i in range(KEEP)]  # kept: 40, 30, 20
SMALL = ["--fake_devices=8", "--config.base.num_steps=20",
         f"--config.train.num_steps={STEPS}", "--config.diloco.inner_steps=10",
         f"--config.ckpt.every={EVERY}", f"--config.ckpt.keep={KEEP}",
         "--config.eval.reroute_every=0",
         "--config.data.max_corpus_chars=1000000",
         "--config.data.corpus=text_files"]
CORPUS_BYTES, MAX_FILE = 1_300_000, 120_000

_LIVE = {}  # pid -> Popen of every process started and not yet reaped
_MOUNTS = []  # tmpfs mount points made (case 14), unmounted at the end
_T0 = time.time()
_DEADLINE = [float("inf")]


# --- Processes -------------------------------------------------------------


def _kill(p: subprocess.Popen) -> None:
  """SIGKILL to the process group of `p` (its own session), then reap."""
  if p.poll() is None:
    try:
      os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
  try:
    p.wait(timeout=30)
  except subprocess.TimeoutExpired:
    pass
  _LIVE.pop(p.pid, None)


def kill_all() -> None:
  for p in list(_LIVE.values()):
    _kill(p)


def unmount(mnt: Path) -> None:
  """Unmounts a tmpfs this script mounted (lazily if still busy)."""
  for cmd in (["umount", str(mnt)], ["umount", "-l", str(mnt)]):
    if subprocess.run(cmd, capture_output=True, timeout=60).returncode == 0:
      break
  if mnt in _MOUNTS:
    _MOUNTS.remove(mnt)


def unmount_all(under: Path | None = None) -> None:
  """Unmounts what this script mounted, or (`under`) anything mounted below
  a work dir a killed earlier run left behind."""
  if under is None:
    for mnt in list(_MOUNTS):
      unmount(mnt)
    return
  try:
    mounts = [l.split()[1] for l in Path("/proc/mounts").read_text()
              .splitlines()]
  except OSError:
    return
  for m in sorted(mounts, reverse=True):
    if m.startswith(str(under) + "/"):
      unmount(Path(m))


def _on_signal(signum, _frame):
  kill_all()
  unmount_all()
  sys.exit(128 + signum)


class Proc:
  """A main.py (or other) process, its stdout/stderr in LOGS/name.out/.err."""

  def __init__(self, logs: Path, name: str, cmd: list[str], env: dict):
    self.name = name
    self.out_path, self.err_path = logs / f"{name}.out", logs / f"{name}.err"
    self.t0 = time.time()
    with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
      self.p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out,
                                stderr=err, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    _LIVE[self.p.pid] = self.p
    self.pid = self.p.pid
    self.rc, self.timed_out, self.seconds = None, False, None

  def wait(self, timeout: float):
    """Waits at most `timeout` (and the global deadline), then kills."""
    timeout = max(1.0, min(timeout, _DEADLINE[0] - time.time()))
    try:
      self.rc = self.p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      self.timed_out = True
      _kill(self.p)
      self.rc = self.p.returncode
    _LIVE.pop(self.pid, None)
    self.seconds = time.time() - self.t0
    return self

  def kill9(self):
    os.kill(self.pid, signal.SIGKILL)
    return self.wait(30)

  @property
  def out(self) -> str:
    return self.out_path.read_text(errors="replace")

  @property
  def err(self) -> str:
    return self.err_path.read_text(errors="replace")

  def err_lines(self) -> list[str]:
    return [l for l in self.err.splitlines() if l.strip()]

  def status(self) -> str:
    return "TIMEOUT" if self.timed_out else f"rc {self.rc}"


def wait_for(predicate, timeout: float, proc: Proc | None = None,
             poll: float = 0.2) -> bool:
  """Polls `predicate` for at most `timeout` s; False early if `proc` ends."""
  end = min(time.time() + timeout, _DEADLINE[0])
  while time.time() < end:
    if predicate():
      return True
    if proc is not None and proc.p.poll() is not None:
      return bool(predicate())
    time.sleep(poll)
  return False


# --- Workdirs, corpus, damage ------------------------------------------------


def make_corpus(dst: Path) -> list[Path]:
  """~1.3 MB of the stdlib's top-level .py files (by name, each < 120 KB)
  copied to `dst`; returns the stdlib files left out (spares for case 6)."""
  root = Path(sysconfig.get_paths()["stdlib"])
  files = sorted(p for p in root.glob("*.py")
                 if p.is_file() and p.stat().st_size < MAX_FILE)
  dst.mkdir(parents=True)
  total, spares = 0, []
  for f in files:
    if total + f.stat().st_size <= CORPUS_BYTES:
      shutil.copyfile(f, dst / f.name)
      total += f.stat().st_size
    else:
      spares.append(f)
  return spares


CLONE_ALL = ("data", "runs", "router", "shards", "splits.json", "config.json")
CLONE_BASE = ("data", "runs/base", "shards/base", "router", "splits.json",
              "config.json")


def clone(src: Path, dst: Path, parts=CLONE_ALL) -> Path:
  """Copies `parts` of workdir `src` (never its lock) to a fresh `dst`."""
  dst.mkdir(parents=True)
  for part in parts:
    s = src / part
    if s.is_dir():
      shutil.copytree(s, dst / part, symlinks=True)
    elif s.exists():
      (dst / part).parent.mkdir(parents=True, exist_ok=True)
      shutil.copy2(s, dst / part)
  return dst


def ckpt_dir(workdir: Path, run="dipaco") -> Path:
  return workdir / "runs" / run / "checkpoints"


def committed_steps(workdir: Path, run="dipaco") -> list[int]:
  d = ckpt_dir(workdir, run)
  return sorted(int(p.name) for p in d.iterdir()
                if p.name.isdigit()) if d.is_dir() else []


def flip_bit(step_dir: Path, item="inner") -> str:
  """One bit flipped where it changes a stored value (see
  dipaco_jax/testing/damage.py: OCDBT data files also hold superseded
  b-tree nodes no restore reads)."""
  return _damage(step_dir, item, damage_lib.flip_bit)


def truncate(step_dir: Path, item="inner") -> str:
  return _damage(step_dir, item, damage_lib.truncate)


def overwrite_64k(step_dir: Path, seed: int, item="inner") -> str:
  return _damage(step_dir, item, lambda path, attempt:
                 damage_lib.overwrite_64k(path, attempt, seed))


def _damage(step_dir: Path, item: str, kind) -> str:
  what = damage_lib.damage_that_matters(step_dir / item, kind)
  return f"{_rel(step_dir / item)}: {what}"


def _rel(path: Path) -> str:
  parts = path.parts
  i = parts.index("checkpoints") if "checkpoints" in parts else 0
  return "/".join(parts[i + 1:])


# --- Comparisons -------------------------------------------------------------


def load_results(workdir: Path) -> dict | None:
  try:
    return json.loads((workdir / "results.json").read_text())
  except (OSError, ValueError):
    return None


def _load_item(path: Path) -> dict:
  """{tree path: numpy array} of one orbax item, restored as numpy."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  ckptr = ocp.PyTreeCheckpointer()
  meta = ckptr.metadata(path)
  tree = getattr(meta, "item_metadata", meta)
  tree = getattr(tree, "tree", tree)
  args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray),
                      tree)
  restored = ckptr.restore(path, restore_args=args)
  return {jax.tree_util.keystr(k): np.asarray(v) for k, v in
          jax.tree_util.tree_flatten_with_path(restored)[0]}


def arrays_equal(ref: Path, other: Path, run: str, step: int = STEPS
                 ) -> tuple[bool, str]:
  """Whether step `step` of `run` holds the same arrays, byte for byte."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  n, bad = 0, []
  for item in ("inner", "outer"):
    a_dir = ckpt_dir(ref, run) / str(step) / item
    b_dir = ckpt_dir(other, run) / str(step) / item
    if not b_dir.is_dir():
      return False, f"{run}: no step {step} ({item})"
    try:
      a, b = _load_item(a_dir), _load_item(b_dir)
    except Exception as e:  # pylint: disable=broad-except
      return False, f"{run}/{step}/{item} unreadable: {type(e).__name__}"
    for k in sorted(a.keys() | b.keys()):
      x, y = a.get(k), b.get(k)
      n += 1
      if (x is None or y is None or x.dtype != y.dtype or x.shape != y.shape
          or np.ascontiguousarray(x).tobytes()
          != np.ascontiguousarray(y).tobytes()):
        bad.append(f"{item}{k}")
  if bad:
    return False, f"{run}: {len(bad)}/{n} arrays differ (e.g. {bad[0]})"
  return True, f"{run}: {n} arrays equal"


def equal_to_ref(ref: Path, other: Path, ref_results: dict
                 ) -> tuple[bool, str]:
  """results.json models equal and final checkpoints' arrays equal."""
  got = load_results(other)
  if got is None:
    return False, "no results.json"
  notes, ok = [], True
  if got.get("models") != ref_results.get("models"):
    ok = False
    diff = [m for m in ref_results["models"]
            if got.get("models", {}).get(m) != ref_results["models"][m]]
    notes.append(f"perplexities differ ({', '.join(diff[:2])})")
  else:
    ppl = got["models"].get("dipaco routed once per document", {}).get(
        "perplexity")
    notes.append(f"results.json models equal (routed ppl {ppl!r})")
  for run in ("dipaco", "dense"):
    same, note = arrays_equal(ref, other, run)
    ok &= same
    notes.append(note)
  return ok, "; ".join(notes)


def lines(text: str, pattern: str) -> list[str]:
  return [l for l in text.splitlines() if re.search(pattern, l)]


def short(text: str, limit: int = 220) -> str:
  text = " ".join(text.split())
  return text if len(text) <= limit else text[:limit - 3] + "..."


# --- The cases ----------------------------------------------------------------


class Chaos:

  def __init__(self, args):
    self.work = Path(args.work).absolute()
    self.logs = self.work / "logs"
    self.rows = []  # (case, expected, observed, verdict)
    self.timings = []
    self.seed = args.seed
    self.rng = random.Random(args.seed)
    self.env = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")
    if not args.no_jax_cache:
      self.env.update(
          JAX_COMPILATION_CACHE_DIR=str(self.work / "jax_cache"),
          JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
          JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
    self.corpus = self.work / "corpus"
    self.ref = self.work / "ref"
    self.ref_results = None

  # Helpers.

  def cmd(self, workdir, *extra, corpus=None,
          config="experiments/quickstart.py:small"):
    corpus = corpus or self.corpus
    return [sys.executable, "-m", "dipaco_jax.main", f"--config={config}",
            f"--workdir={workdir}", *SMALL,
            f"--config.data.text_glob={corpus}/*.py", *extra]

  def start(self, name, workdir, *extra, corpus=None, config=None) -> Proc:
    print(f"  [{time.time() - _T0:6.0f}s] {name}: main.py in "
          f"{Path(workdir).name}{' ' + ' '.join(extra) if extra else ''}"
          f"{' --config=' + str(config) if config else ''}", flush=True)
    kw = {"config": config} if config else {}
    return Proc(self.logs, name, self.cmd(workdir, *extra, corpus=corpus,
                                          **kw), self.env)

  def main(self, name, workdir, *extra, timeout=600, corpus=None,
           config=None) -> Proc:
    return self.start(name, workdir, *extra, corpus=corpus,
                      config=config).wait(timeout)

  def tool(self, name, module, *args, timeout=300) -> Proc:
    """`python -m module args` (export, generate), waited for."""
    print(f"  [{time.time() - _T0:6.0f}s] {name}: {module} "
          f"{' '.join(str(a) for a in args)}", flush=True)
    return Proc(self.logs, name, [sys.executable, "-m", module, *map(
        str, args)], self.env).wait(timeout)

  def row(self, case, expected, observed, ok, t0=None):
    """`ok` None: the case could not run on this machine (NOT RUN)."""
    verdict = "NOT RUN" if ok is None else "PASS" if ok else "FAIL"
    if t0 is not None:
      self.timings.append((case.split()[0], time.time() - t0))
    self.rows.append((case, expected, observed, verdict))
    print(f"  -> {case.split()[0]}: {verdict}: {short(observed, 400)}",
          flush=True)

  def fail_not_run(self, case, expected, why):
    self.row(case, expected, f"not run: {why}", False)

  # The uninterrupted reference.

  def reference(self) -> bool:
    t0 = time.time()
    p = self.main("ref", self.ref, timeout=900)
    self.ref_results = load_results(self.ref)
    ok = p.rc == 0 and self.ref_results is not None and committed_steps(
        self.ref) == STEP_DIRS[::-1]
    ppl = (self.ref_results or {}).get("models", {}).get(
        "dipaco routed once per document", {}).get("perplexity")
    self.row("0 reference (uninterrupted)", "rc 0, results.json, dipaco "
             f"checkpoints {STEP_DIRS[::-1]}",
             f"{p.status()} in {p.seconds:.0f} s; routed ppl {ppl}; dipaco "
             f"steps {committed_steps(self.ref)}; log logs/ref.out", ok, t0)
    return ok

  # 1 + 7: kill -9, then a rerun with a second job started beside it.

  def kill_and_lock(self):
    case1 = "1 kill -9 during training, rerun"
    exp1 = ("rerun resumes; results.json perplexities and final checkpoint "
            "arrays equal the uninterrupted run's")
    case7 = "7 second job in the same workdir"
    exp7 = ("exit 2, one stderr line naming the running pid; the first "
            "finishes fine")
    t0 = time.time()
    w = clone(self.ref, self.work / "c1_kill", CLONE_BASE)
    p = self.start("c1_killed", w)
    first = ckpt_dir(w) / str(EVERY)
    if not wait_for(first.is_dir, 600, p):
      p.wait(1)
      self.fail_not_run(case1, exp1, f"no first checkpoint ({p.status()})")
      self.fail_not_run(case7, exp7, "case 1 did not run")
      return
    # Steps 10-40 of dipaco, then the dense run and the evaluation, take
    # 20 s or more after this checkpoint: the kill lands in training.
    delay = self.rng.uniform(0.0, 10.0)
    time.sleep(delay)
    if p.p.poll() is not None:
      self.fail_not_run(case1, exp1, f"run ended ({p.status()}) before the "
                        f"kill {delay:.1f} s after the first checkpoint")
      self.fail_not_run(case7, exp7, "case 1 did not run")
      return
    # Where it was: the last progress line and the committed steps.
    progress = lines(p.out, r"^\[\w+\] (step|already|resuming)")
    dense_started = (w / "runs" / "dense").exists()
    steps_at_kill = committed_steps(w)
    p.kill9()
    where = (f"killed {delay:.1f} s after dipaco's step-{EVERY} checkpoint "
             f"(dipaco steps saved {steps_at_kill}; "
             f"{'in the dense run' if dense_started else 'in dipaco'}; last "
             f"line {short(progress[-1], 60) if progress else '-'!r})")

    # The rerun; once it holds the lock, a second job in the same workdir.
    rerun = self.start("c1_rerun", w)
    lock = w / ".lock"

    def locked_by_rerun():
      try:
        return json.loads(lock.read_text()).get("pid") == rerun.pid
      except (OSError, ValueError):
        return False

    t7 = time.time()
    if wait_for(locked_by_rerun, 300, rerun):
      second = self.main("c7_second", w, timeout=300)
      err = second.err_lines()
      second_ok = (second.rc == 2 and len(err) == 1
                   and f"pid {rerun.pid}" in err[0] and rerun.p.poll() is None)
      second_obs = (f"second job {second.status()}, {len(err)} stderr "
                    f"line(s): {short(err[0] if err else '', 200)!r} "
                    f"(first job pid {rerun.pid}, "
                    f"{'still running' if rerun.p.poll() is None else 'ended'})")
    else:
      second_ok, second_obs = False, "the rerun never held the lock"
    rerun.wait(600)
    resumed = lines(rerun.out, r"^\[(dipaco|dense)\] (resuming|already)|"
                    r"^\[lock\]|^\[ckpt\]")
    same, note = equal_to_ref(self.ref, w, self.ref_results)
    ok1 = rerun.rc == 0 and same and bool(lines(
        rerun.out, r"^\[dipaco\] (resuming from step|already trained)"))
    self.row(case1, exp1,
             f"{where}; rerun {rerun.status()}: "
             f"{short(' / '.join(resumed), 330)}; {note}", ok1, t0)
    ok7 = second_ok and rerun.rc == 0 and load_results(w) is not None
    self.row(case7, exp7, f"{second_obs}; first job {rerun.status()}"
             f"{', results.json written' if load_results(w) else ''}", ok7,
             t7)

  # 2-5: damaged checkpoints.

  def damaged(self, case, expected, name, damage, bad_steps, fallback):
    """Damages a copy of the finished reference by `damage(workdir)` (->
    description), reruns it and checks the fallback to `fallback` (None:
    a one-line refusal)."""
    t0 = time.time()
    w = clone(self.ref, self.work / name)
    what = damage(w)
    p = self.main(name, w, timeout=600)
    reported = {s: lines(p.out, rf"^\[ckpt\] checkpoint step {s} is "
                         r"(damaged|incomplete)") for s in bad_steps}
    one_each = all(len(v) == 1 for v in reported.values())
    said = " / ".join(short(l, 170) for v in reported.values() for l in v)
    trained = lines(p.out, r"^\[dipaco\] step ")
    if fallback is None:
      err = p.err_lines()
      ok = p.rc == 2 and one_each and len(err) == 1 and not trained
      obs = (f"{what}; {p.status()}; {said}; stderr {len(err)} line(s): "
             f"{short(err[0] if err else '', 160)!r}; dipaco trained "
             f"{'no' if not trained else 'SOME'} steps; committed steps "
             f"left {committed_steps(w)}")
    else:
      restored = lines(p.out, rf"^\[ckpt\] restored step {fallback}\b")
      resumed = lines(p.out, rf"^\[dipaco\] resuming from step {fallback}\b")
      same, note = (equal_to_ref(self.ref, w, self.ref_results)
                    if p.rc == 0 else (False, "no results"))
      ok = (p.rc == 0 and one_each and len(restored) == 1
            and len(resumed) == 1 and same)
      obs = (f"{what}; {p.status()}; {said}; "
             f"{'resumed from step %d' % fallback if resumed else 'NOT resumed from the fallback'}"
             f"; {note}")
    self.row(case, expected, obs, ok, t0)

  def damage_cases(self):
    seed = self.seed
    step = lambda w, s: ckpt_dir(w) / str(s)
    s40, s30, s20 = STEP_DIRS
    self.damaged(
        "2 one bit flipped in the latest checkpoint",
        f"one line names step {s40}; falls back to step {s30}; results equal "
        "the uninterrupted run", "c2_bitflip",
        lambda w: flip_bit(step(w, s40)), [s40], s30)

    def bitflip_earlier_truncate_latest(w):
      return (flip_bit(step(w, s30)) + "; "
              + truncate(step(w, s40)))
    self.damaged(
        "3 bit flipped in an earlier checkpoint + the latest truncated",
        f"one line each for steps {s40}, {s30}; falls back to the oldest "
        f"intact ({s20}); results equal", "c3_earlier",
        bitflip_earlier_truncate_latest, [s40, s30], s20)
    self.damaged(
        "3b every kept checkpoint damaged (bit flips)",
        "one line per step, then refuses: exit 2, one stderr line; never "
        "trains on a damaged one", "c3b_all_damaged",
        lambda w: "; ".join(flip_bit(step(w, s))
                            for s in STEP_DIRS), STEP_DIRS, None)

    def overwrite_and_truncate(w):
      return (overwrite_64k(step(w, s40), seed) + "; "
              + truncate(step(w, s30), "outer"))
    self.damaged(
        "4 64 KiB overwritten (latest) + a file truncated (previous)",
        f"one line each for steps {s40}, {s30}; falls back to {s20}; results "
        "equal", "c4_overwrite", overwrite_and_truncate, [s40, s30], s20)

    def delete_metadata(w):
      path = step(w, s40) / "inner" / "_METADATA"
      path.unlink()
      return f"deleted {_rel(path)}"
    self.damaged(
        "5 _METADATA of an item deleted (latest)",
        f"one line names step {s40}; falls back to {s30}; results equal",
        "c5_metadata", delete_metadata, [s40], s30)

  # 8, 11, 12: one-line refusals.

  def refusal(self, case, expected, name, extra, must_name, corpus=None,
              workdir=None, created_ok=False, config=None):
    t0 = time.time()
    w = workdir or self.work / name
    p = self.main(name, w, *extra, timeout=300, corpus=corpus, config=config)
    err = p.err_lines()
    created = Path(w).is_dir() if workdir is None else False
    ok = (p.rc == 2 and len(err) == 1 and all(s in err[0] for s in must_name)
          and (created_ok or not created))
    obs = (f"{p.status()}; {len(err)} stderr line(s): "
           f"{short(err[0] if err else '', 260)!r}")
    if workdir is None and not created_ok:
      obs += "; workdir created" if created else "; nothing created"
    self.row(case, expected, obs, ok, t0)

  def bad_values(self):
    for i, (flag, field) in enumerate([
        ("--config.inner_opt.learning_rate=-1", "inner_opt.learning_rate"),
        ("--config.ckpt.keep=0", "ckpt.keep"),
        ("--config.train.eval_batch_size=0", "train.eval_batch_size"),
        ("--config.ckpt.every=-5", "ckpt.every"),
        ("--fake_devices=-1", "--fake_devices"),
        ("--config.data.prefetch=-1", "data.prefetch"),
        ("--config.train.num_stepz=100", "train.num_stepz")]):
      self.refusal(f"8{'abcdefg'[i]} bad value {flag.lstrip('-')}",
                   f"exit 2, one stderr line naming {field}; nothing created",
                   f"c8{'abcdefg'[i]}", [flag], [field])

  def bad_corpus_and_workdir(self):
    empty = self.work / "corpus_none"
    empty.mkdir()
    blank = self.work / "corpus_blank"
    blank.mkdir()
    for n in range(3):
      (blank / f"empty_{n}.py").write_text("" if n else "\n  \n")
    binary = self.work / "corpus_binary"
    binary.mkdir()
    rng = random.Random(self.seed)
    for n in range(3):
      (binary / f"blob_{n}.py").write_bytes(rng.randbytes(4000) + b"\0")
    self.refusal("11a corpus: no file matches the glob",
                 "exit 2, one line: what was found and the fix "
                 "(config.data.text_glob)", "c11a", [], ["text_glob"],
                 corpus=empty, created_ok=True)
    self.refusal("11b corpus: only empty files",
                 "exit 2, one line: what was found and the fix",
                 "c11b", [], ["empty", "config.data.text_glob"], corpus=blank,
                 created_ok=True)
    self.refusal("11c corpus: only binary files",
                 "exit 2, one line: what was found (binary) and the fix",
                 "c11c", [], ["binary", "config.data.text_glob"],
                 corpus=binary, created_ok=True)
    afile = self.work / "a_file"
    afile.write_text("not a directory\n")
    self.refusal("12 --workdir is a file", "exit 2, one line naming "
                 "--workdir", "c12", [], ["--workdir"], workdir=afile)

  # 9: divergence.

  def divergence(self):
    case = "9 diloco.outer_lr=1e30, then rerun"
    expected = ("stopped before a checkpoint of the diverged state is saved; "
                "one line naming outer_lr; the rerun does not resume")
    t0 = time.time()
    w = clone(self.ref, self.work / "c9_diverge", CLONE_BASE)
    obs, ok = [], True
    for i, name in enumerate(("c9_diverge", "c9_rerun")):
      p = self.main(name, w, "--config.diloco.outer_lr=1e30", timeout=600)
      err = p.err_lines()
      steps = committed_steps(w)
      resumed = lines(p.out, r"^\[dipaco\] resuming")
      ok &= (p.rc == 2 and len(err) == 1 and "outer_lr" in err[0]
             and "not saved" in err[0] and not steps and not resumed)
      obs.append(f"{'run' if i == 0 else 'rerun'} {p.status()}, "
                 f"{len(err)} stderr line(s) "
                 f"{short(err[0] if err else '', 200 if i == 0 else 90)!r}; "
                 f"dipaco checkpoints {steps}"
                 f"{'; RESUMED' if resumed else ''}")
    self.row(case, expected, "; ".join(obs), ok, t0)

  # 10 + 6: rerun of a finished workdir, then an edited corpus.

  def rerun_and_corpus(self, spares: list[Path]):
    case10 = "10 rerun of a finished workdir"
    exp10 = ("results.json keeps final_loss and tokens/s (non-null, "
             "non-zero); wall_seconds grows")
    case6a = "6a corpus unchanged, rerun"
    exp6a = "every stage reused"
    case6b = "6b 30% of corpus files replaced + some added, rerun"
    exp6b = ("[data] says the corpus changed; data, base, router, dipaco, "
             "dense all recomputed")
    t0 = time.time()
    w = clone(self.ref, self.work / "c10_rerun",
              CLONE_ALL + ("results.json", "wall_time.json"))
    before = load_results(w)
    p = self.main("c10_rerun", w, timeout=600)
    after = load_results(w)
    ok10, notes = p.rc == 0 and after is not None, []
    if after is not None:
      for r in after["runs"]:
        vals = {k: r.get(k) for k in ("final_loss", "tokens_per_s")}
        good = all(v not in (None, 0, 0.0) for v in vals.values())
        kept = all(r.get(k) == b.get(k) for b in before["runs"]
                   if b["name"] == r["name"] for k in vals)
        ok10 &= good and kept
        notes.append(f"{r['name']}: final_loss {vals['final_loss']:.4f}, "
                     f"{vals['tokens_per_s']:,.0f} tok/s"
                     f"{'' if kept else ' (CHANGED)'}"
                     if good else f"{r['name']}: {vals}")
      grew = after["wall_seconds"] > before["wall_seconds"]
      ok10 &= grew
      notes.append(f"wall_seconds {before['wall_seconds']:.0f} -> "
                   f"{after['wall_seconds']:.0f}")
    self.row(case10, exp10, f"{p.status()}; " + "; ".join(notes), ok10, t0)

    # 6a: the same rerun, read for reuse.
    want = {"data": "reusing", "base": "already trained",
            "router": "reusing", "dipaco": "already trained",
            "dense": "already trained"}
    found = {k: lines(p.out, rf"^\[{k}\] {v}") for k, v in want.items()}
    missing = [k for k, v in found.items() if not v]
    trained = lines(p.out, r"^\[\w+\] step ")
    self.row(case6a, exp6a,
             f"{p.status()}; reused: " + ", ".join(
                 f"{k} ({want[k]})" for k, v in found.items() if v)
             + (f"; NOT reused: {missing}" if missing else "")
             + f"; {len(trained)} training progress lines",
             p.rc == 0 and not missing and not trained)

    # 6b: edit the corpus in place (the other cases are done with it).
    t0 = time.time()
    files = sorted(self.corpus.glob("*.py"))
    replace = files[::3][:max(1, round(0.3 * len(files)))]  # ~every 3rd
    for f, src in zip(replace, spares):
      f.write_bytes(src.read_bytes())
    added = spares[len(replace):len(replace) + 3]
    for src in added:
      shutil.copyfile(src, self.corpus / f"added_{src.name}")
    edit = (f"{len(replace)} of {len(files)} files replaced, "
            f"{len(added)} added")
    p = self.main("c6_changed", w, timeout=600)
    data_line = lines(p.out, r"^\[data\].*corpus changed")
    reused = lines(p.out, r"^\[\w+\] (reusing|already trained|resuming)")
    retrained = [r for r in ("base", "dipaco", "dense")
                 if lines(p.out, rf"^\[{r}\] step +{STEPS if r != 'base' else 20}/")]
    router = lines(p.out, r"^\[router\] product_kmeans")
    ok6b = (p.rc == 0 and bool(data_line) and not reused
            and len(retrained) == 3 and bool(router))
    self.row(case6b, exp6b,
             f"{edit}; {p.status()}; {short(data_line[0], 200) if data_line else 'NO [data] line says the corpus changed'}"
             f"; retrained {retrained}; router refit: {bool(router)}; "
             f"reused lines: {short(' / '.join(reused), 120) or 'none'}",
             ok6b, t0)

  # 13: a preemption notice (SIGTERM) mid-training, then the same command.

  def preemption(self):
    case = "13 SIGTERM mid-training (preemption), rerun"
    expected = ("exit 75, one `error: preempted by SIGTERM: checkpoint saved "
                "at step N; ...` line, no traceback, step N committed; the "
                "rerun resumes from N; results equal")
    t0 = time.time()
    w = clone(self.ref, self.work / "c13_sigterm", CLONE_BASE)
    p = self.start("c13_sigterm", w)
    step_of = lambda l: int(re.search(r"step +(\d+)/", l).group(1))

    def between():  # DiPaCo progress lines at a step between checkpoints.
      return [l for l in lines(p.out, r"^\[dipaco\] step +\d+/")
              if step_of(l) % EVERY]
    if not wait_for(lambda: bool(between()), 600, p):
      p.wait(1)
      self.fail_not_run(case, expected, "no DiPaCo progress line between "
                        f"checkpoints ({p.status()})")
      return
    seen = between()[-1]
    dipaco_steps = committed_steps(w)
    os.kill(p.pid, signal.SIGTERM)
    p.wait(120)
    err = p.err
    said = lines(err, r"^error: preempted by SIGTERM: checkpoint saved at "
                 r"step \d+;")
    n = int(re.search(r"step (\d+);", said[0]).group(1)) if said else None
    dense = (w / "runs" / "dense").exists()
    run = "dense" if dense else "dipaco"
    steps = committed_steps(w, run)
    traceback = "Traceback" in err
    stopped = (p.rc == 75 and len(said) == 1 and not traceback
               and n in steps)
    where = ("between checkpoints" if n is not None and n % EVERY else
             "at a checkpoint step")
    stop_obs = (
        f"SIGTERM after {short(seen, 50)!r} (dipaco steps saved "
        f"{dipaco_steps}): {p.status()}, {len(p.err_lines())} stderr "
        f"line(s), {len(said)} `error: preempted` line: "
        f"{short(said[0], 120) if said else short(err, 120)!r}"
        f"{'; TRACEBACK' if traceback else '; no traceback'}; {run} steps "
        f"committed {steps} (step {n} {where})")
    rerun = self.main("c13_rerun", w, timeout=600)
    resumed = lines(rerun.out, rf"^\[{run}\] resuming from step {n}\b")
    damaged = lines(rerun.out, r"^\[ckpt\] checkpoint step \d+ is")
    same, note = (equal_to_ref(self.ref, w, self.ref_results)
                  if rerun.rc == 0 else (False, "no results"))
    ok = (stopped and rerun.rc == 0 and len(resumed) == 1 and not damaged
          and same)
    self.row(case, expected,
             f"{stop_obs}; rerun {rerun.status()}: "
             f"{short(resumed[0], 70) if resumed else 'NOT resumed from N'}"
             f"{'; ' + short(damaged[0], 80) if damaged else ''}; "
             f"{stderr_note(rerun)}; {note}", ok, t0)

  # 14: a full disk during a checkpoint (a small tmpfs), then more space.

  def disk_full(self):
    case = "14 disk full during a checkpoint (40 MiB tmpfs), more space, rerun"
    expected = ("one `error: disk full ...` line, no traceback, non-zero "
                "exit; no committed checkpoint damaged; remounted at 300 "
                "MiB, the rerun resumes; results equal")
    t0 = time.time()
    mnt = self.work / "c14_tmpfs"
    mnt.mkdir()
    try:
      r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs",
                          str(mnt)], capture_output=True, text=True,
                         timeout=60)
      why = short(r.stderr or f"exit {r.returncode}", 120)
      mounted = r.returncode == 0
    except (OSError, subprocess.TimeoutExpired) as e:
      mounted, why = False, f"{type(e).__name__}: {e}"
    if not mounted:
      self.row(case, expected, f"not run here: mount -t tmpfs refused "
               f"({why})", None, t0)
      return
    _MOUNTS.append(mnt)
    try:
      self._disk_full(case, expected, mnt, t0)
    finally:
      unmount(mnt)

  def _disk_full(self, case, expected, mnt, t0):
    w = clone(self.ref, mnt / "w", CLONE_BASE)
    free = lambda: shutil.disk_usage(mnt).free / 2**20
    free0 = free()
    p = self.main("c14_full", w, timeout=600)
    err = p.err
    said = lines(err, r"^error: disk full")
    traceback = "Traceback" in err
    after = committed_steps(w)
    full_obs = (f"{free0:.0f} MiB free after the copy (data, base run); "
                f"{p.status()}, {len(p.err_lines())} stderr line(s): "
                f"{short(said[0], 200) if said else short(err, 200)!r}"
                f"{'; TRACEBACK' if traceback else '; no traceback'}; dipaco "
                f"steps committed {after}")
    stopped = (p.rc not in (0, None) and not p.timed_out and len(said) == 1
               and len(p.err_lines()) == 1 and not traceback)
    r = subprocess.run(["mount", "-o", "remount,size=300m", str(mnt)],
                       capture_output=True, text=True, timeout=60)
    if r.returncode:
      self.row(case, expected, f"{full_obs}; remount refused "
               f"({short(r.stderr, 100)})", False, t0)
      return
    rerun = self.main("c14_rerun", w, timeout=600)
    last = max(after) if after else None
    resumed = lines(rerun.out, r"^\[dipaco\] resuming from step \d+")
    damaged = lines(rerun.out, r"^\[ckpt\] checkpoint step \d+ is")
    same, note = (equal_to_ref(self.ref, w, self.ref_results)
                  if rerun.rc == 0 else (False, "no results"))
    ok = (stopped and bool(after) and rerun.rc == 0 and not damaged
          and len(resumed) == 1 and f"step {last} " in resumed[0] + " "
          and same)
    self.row(case, expected,
             f"{full_obs}; remounted at 300 MiB, rerun {rerun.status()}: "
             f"{short(resumed[0], 70) if resumed else 'NOT resumed'}; "
             f"{'damaged: ' + short(damaged[0], 80) if damaged else 'no checkpoint reported damaged'}"
             f"; {stderr_note(rerun)}; {note}", ok, t0)

  # 15: a step that cannot fit in memory.

  def memory_estimate(self):
    case = "15 data.seq_len=100000, train.batch_size=100000"
    expected = ("exit 2, one line naming the fields and the memory estimate, "
                "before the data stage; nothing created")
    t0 = time.time()
    w = self.work / "c15_memory"
    p = self.main("c15_memory", w, "--config.data.seq_len=100000",
                  "--config.train.batch_size=100000", timeout=300)
    err = p.err_lines()
    first = err[0] if err else ""
    data = lines(p.out, r"^\[data\]")
    estimate = re.search(r"\d[\d.,]* ?[KMGTPE]i?B", first)
    ok = (p.rc == 2 and len(err) == 1 and "Traceback" not in p.err
          and all(f in first for f in ("train.batch_size", "data.seq_len"))
          and bool(estimate) and not data and not w.exists())
    self.row(case, expected,
             f"{p.status()} in {p.seconds:.0f} s; {len(err)} stderr line(s): "
             f"{short(first, 460)!r}; {len(data)} [data] lines; "
             f"{'workdir created' if w.exists() else 'nothing created'}",
             ok, t0)

  # 16: config files missing or not Python.

  def config_files(self):
    bad = self.work / "bad_syntax.py"
    bad.write_text("def get_config(:\n  return None\n")
    missing = self.work / "missing.py"
    for sub, config, extra, what in [
        ("a", missing, ["--config.seed=1"], "missing, with an override"),
        ("b", bad, [], "a syntax error"),
        ("c", bad, ["--config.seed=1"], "a syntax error, with an override")]:
      self.refusal(f"16{sub} --config file {what}",
                   "exit 2, one stderr line naming the file; nothing created",
                   f"c16{sub}", extra, [str(config)], config=config)

  # 17: exports: a damaged one, a non-empty --out, --overwrite.

  def exports(self):
    case_a = "17a generate from an export whose array file was truncated"
    exp_a = ("exit 2, one line naming the file and the export command to "
             "rerun (--overwrite)")
    case_b = "17b export into a non-empty folder (someone's file)"
    exp_b = ("refused in one line (with --overwrite too); nothing written")
    case_c = ("17c export over the damaged export: without --overwrite, then "
              "the line's command; then --path=0 --overwrite")
    exp_c = ("refused without --overwrite; the command replaces it whole "
             "(same files, arrays equal the first export's), generate works; "
             "--path=0 over --all leaves only the path's files")
    t0 = time.time()
    out = self.work / "c17_export"
    first = self.tool("c17_export", "dipaco_jax.export",
                      f"--workdir={self.ref}", "--all", f"--out={out}")
    if first.rc != 0:
      for case, exp in ((case_a, exp_a), (case_b, exp_b), (case_c, exp_c)):
        self.fail_not_run(case, exp, f"the export failed ({first.status()},"
                          " logs/c17_export.err)")
      return
    files = export_files(out)
    arrays = sorted((f for f in (out / "path_000" / "params").rglob("*")
                     if f.is_file() and f.stat().st_size > 0
                     and not f.name.startswith(("_", "commit", "COMMITTED"))),
                    key=lambda f: (-f.stat().st_size, str(f)))
    target = arrays[0]
    size = target.stat().st_size
    with open(target, "r+b") as f:
      f.truncate(size // 2)
    prompt = ["--prompt=def main(argv):", "--max_new_tokens=8"]
    gen = self.tool("c17a_generate", "dipaco_jax.generate", f"--export={out}",
                    *prompt)
    err = gen.err_lines()
    line = err[0] if err else ""
    fix = re.search(r"export it again: (python -m dipaco_jax\.export \S.*?)"
                    r"\.?$", line)
    ok_a = (gen.rc == 2 and len(err) == 1 and "Traceback" not in gen.err
            and str(target) in line and bool(fix)
            and "--overwrite" in fix.group(1))
    self.row(case_a, exp_a,
             f"{target.relative_to(out)} truncated {size:,} -> "
             f"{size // 2:,} bytes; {gen.status()}, {len(err)} stderr "
             f"line(s): {short(line, 420)!r}", ok_a, t0)

    # 17b: a folder holding someone's file, without and with --overwrite.
    t0 = time.time()
    other = self.work / "c17b_mine"
    other.mkdir()
    (other / "notes.txt").write_text("mine\n")
    obs_b, ok_b = [], True
    for i, extra in enumerate(([], ["--overwrite"])):
      p = self.tool(f"c17b_export{i}", "dipaco_jax.export",
                    f"--workdir={self.ref}", "--path=0", f"--out={other}",
                    *extra)
      e = p.err_lines()
      left = sorted(os.listdir(other))
      partial = sorted(x.name for x in self.work.glob(".c17b_mine*"))
      ok_b &= (p.rc == 2 and len(e) == 1 and "notes.txt" in e[0]
               and left == ["notes.txt"] and not partial
               and (other / "notes.txt").read_text() == "mine\n")
      obs_b.append(f"{' '.join(extra) or 'plain'}: {p.status()}, {len(e)} "
                   f"line(s): {short(e[0] if e else '', 200 - 120 * i)!r}; "
                   f"folder holds {left}"
                   f"{'; ' + str(partial) + ' beside it' if partial else ''}")
    self.row(case_b, exp_b, "; ".join(obs_b), ok_b, t0)

    # 17c: over the export: refused without --overwrite; the fix command.
    t0 = time.time()
    again = self.tool("c17c_export_again", "dipaco_jax.export",
                      f"--workdir={self.ref}", "--all", f"--out={out}")
    e = again.err_lines()
    still = target.stat().st_size
    refused = (again.rc == 2 and len(e) == 1 and "--overwrite" in e[0]
               and still == size // 2)
    obs = [f"plain: {again.status()}, {len(e)} line(s): "
           f"{short(e[0] if e else '', 110)!r}"
           f"{'' if still == size // 2 else '; the export CHANGED'}"]
    ok_c = refused
    if fix:
      args = fix.group(1).split()[3:]  # After "python -m dipaco_jax.export".
      redo = self.tool("c17c_export_fix", "dipaco_jax.export", *args)
      now = export_files(out)
      same_names = sorted(now) == sorted(files)
      differ = [k for k in files if is_array_file(k)
                and now.get(k) != files[k]]
      gen2 = self.tool("c17c_generate", "dipaco_jax.generate",
                       f"--export={out}", *prompt)
      ok_c &= (redo.rc == 0 and same_names and not differ and gen2.rc == 0
               and target.stat().st_size == size)
      obs.append(f"the line's command ({' '.join(args[-2:])}): "
                 f"{redo.status()}; {len(now)} files "
                 f"{'(the same names)' if same_names else '(OTHER names)'}, "
                 f"{sum(map(is_array_file, files)) - len(differ)} of "
                 f"{sum(map(is_array_file, files))} array files equal the "
                 f"first export's; generate {gen2.status()}")
      one = self.tool("c17c_export_path0", "dipaco_jax.export",
                      f"--workdir={self.ref}", "--path=0", f"--out={out}",
                      "--overwrite")
      left = sorted(os.listdir(out))
      beside = sorted(x.name for x in self.work.glob(".c17_export*"))
      ok_c &= (one.rc == 0 and left == ["model.json", "params", "spm.model"]
               and not beside)
      obs.append(f"--path=0 --overwrite: {one.status()}; {out.name} holds "
                 f"{left}{'; ' + str(beside) + ' beside it' if beside else ''}")
    else:
      ok_c = False
      obs.append("no command in 17a's line to run")
    self.row(case_c, exp_c, "; ".join(obs), ok_c, t0)

  # 18: a corpus file with a few undecodable bytes, and a dangling link.

  def corpus_damaged_files(self):
    case = "18 corpus: 3 invalid UTF-8 bytes in a file, a dangling symlink"
    expected = ("the file read with the bytes replaced (`[data] replaced 3 "
                "undecodable bytes` naming it); the link named among the "
                "skipped files, counted against the glob's matches")
    t0 = time.time()
    corpus = self.work / "corpus_bytes"
    corpus.mkdir()
    # 25 files (under data.max_corpus_chars, so that every one is read).
    for f in sorted(self.corpus.glob("*.py"))[:25]:
      shutil.copyfile(f, corpus / f.name)
    victim = max(corpus.glob("*.py"), key=lambda f: (f.stat().st_size,
                                                    f.name))
    data = bytearray(victim.read_bytes())
    for frac in (0.25, 0.5, 0.75):  # One 0xff byte before 3 line ends.
      i = data.index(b"\n", int(len(data) * frac))
      data[i:i] = b"\xff"
    victim.write_bytes(bytes(data))
    link = corpus / "zz_gone.py"
    link.symlink_to(self.work / "nowhere.py")
    matched = len(glob.glob(str(corpus / "*.py")))
    w = self.work / "c18_corpus"
    p = self.start("c18_corpus", w, corpus=corpus)
    # The data stage only: stopped once the next stage starts.
    data_done = lambda: bool(lines(p.out, r"^\[(base|router|dipaco)\]"))
    reached = wait_for(data_done, 600, p)
    if p.p.poll() is None:
      p.kill9()
    else:
      p.wait(1)
    replaced = lines(p.out, r"^\[data\] replaced \d+ undecodable byte")
    skipped = lines(p.out, r"^\[data\] skipped ")
    splits = lines(p.out, r"^\[data\] train: ")
    ok = (reached and len(replaced) == 1 and len(skipped) == 1
          and bool(splits)
          and "replaced 3 undecodable bytes" in replaced[0]
          and f"{victim.name} (3)" in replaced[0]
          and f"skipped 1 of {matched} files" in skipped[0]
          and "zz_gone.py (dangling link)" in skipped[0]
          and f"read {matched - 1} of the {matched}" in skipped[0]
          and victim.name not in skipped[0])
    self.row(case, expected,
             f"glob matches {matched} ({matched - 1} files + the link); "
             f"{short(' / '.join(replaced + skipped), 400) or 'no [data] line about them'}"
             f"; {short(splits[0], 60) if splits else 'NO data stage'}; "
             f"stopped {'after the data stage' if reached else p.status()}",
             ok, t0)


def stderr_note(p: Proc) -> str:
  """A rerun's stderr, which a careful user reads too."""
  err = p.err_lines()
  return (f"rerun stderr: {len(err)} line(s)"
          + (f", e.g. {short(err[0], 150)!r}" if err else ""))


def export_files(out: Path) -> dict:
  """{relative path: sha256} of every file of an export."""
  return {str(f.relative_to(out)): hashlib.sha256(f.read_bytes()).hexdigest()
          for f in sorted(out.rglob("*")) if f.is_file()}


def is_array_file(rel: str) -> bool:
  """An export's array data (the rest holds timestamps and its path)."""
  return "/item/" in rel and Path(rel).name not in (
      "_CHECKPOINT_METADATA", "commit_success.txt")


def table(rows) -> str:
  esc = lambda s: str(s).replace("|", "\\|").replace("\n", " ")
  out = ["| case | expected | observed | verdict |", "|---|---|---|---|"]
  out += [f"| {' | '.join(esc(c) for c in r)} |" for r in rows]
  return "\n".join(out)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--work", default="/tmp/chaos_local")
  ap.add_argument("--out", default=None, help="also write the table here")
  ap.add_argument("--seed", type=int,
                  default=int(os.environ.get("CHAOS_SEED", time.time_ns()
                                             % 100_000)))
  ap.add_argument("--deadline", type=float, default=2700.0,
                  help="seconds; every wait ends by then")
  ap.add_argument("--no_jax_cache", action="store_true")
  args = ap.parse_args()
  _DEADLINE[0] = _T0 + args.deadline
  signal.signal(signal.SIGTERM, _on_signal)
  signal.signal(signal.SIGINT, _on_signal)
  os.environ["JAX_PLATFORMS"] = "cpu"  # This process only loads arrays.
  from absl import logging  # pylint: disable=g-import-not-at-top
  logging.set_verbosity(logging.ERROR)

  c = Chaos(args)
  if c.work.exists():
    unmount_all(under=c.work)  # A killed earlier run's tmpfs (case 14).
    shutil.rmtree(c.work)
  c.logs.mkdir(parents=True)
  print(f"chaos_local: work {c.work}, seed {c.seed}; logs in {c.logs}",
        flush=True)
  try:
    spares = make_corpus(c.corpus)
    if c.reference():
      c.kill_and_lock()
      c.damage_cases()
      c.divergence()
      c.preemption()
      c.disk_full()
      c.exports()
    else:
      for case in ("1", "2", "3", "4", "5", "6", "7", "9", "10", "13", "14",
                   "17"):
        c.fail_not_run(case, "-", "the reference run failed (logs/ref.*)")
    c.bad_values()
    c.config_files()
    c.bad_corpus_and_workdir()
    c.corpus_damaged_files()  # Before case 6b edits the shared corpus.
    if c.ref_results is not None:
      c.rerun_and_corpus(spares)  # Edits the shared corpus.
    c.memory_estimate()  # Last: its check was the newest.
  finally:
    kill_all()
    unmount_all()
  total = time.time() - _T0
  fails = sum(r[3] == "FAIL" for r in c.rows)
  not_run = sum(r[3] == "NOT RUN" for r in c.rows)
  header = (
      f"chaos_local: {len(c.rows)} cases, {fails} FAIL"
      f"{f', {not_run} NOT RUN' if not_run else ''}, "
      f"{total / 60:.1f} min on {os.cpu_count()} cores; seed {c.seed}; "
      f"run: experiments/quickstart.py:small {' '.join(SMALL)} "
      f"--config.data.text_glob=CORPUS/*.py; 'equal' = results.json models "
      f"equal and every array of the final checkpoint (step {STEPS}) of "
      "runs/dipaco and runs/dense equal byte for byte (loaded with orbax)")
  timings = "seconds per case: " + ", ".join(
      f"{k} {v:.0f}" for k, v in c.timings)
  text = "\n".join([header, "", table(c.rows), "", timings])
  print("\n" + text, flush=True)
  if args.out:
    Path(args.out).write_text(text + "\n")
  sys.exit(1 if fails else 0)


if __name__ == "__main__":
  main()
