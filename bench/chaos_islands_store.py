r"""Island chaos cases of docs/reliability.md: damaged keys, preemption,
a role of other code (the island failures a new user met, rerun).

Called by bench/chaos_islands_store.sh (its header: usage, runtime). Runs
the cases below one at a time, bounds every wait with a timeout, kills what
it started (the launchers, the roles they started in their own sessions,
found by their --store; on a timeout, an error and SIGTERM/SIGINT), prints
one table row per case and exits 1 if any case FAILs.

  python3 bench/chaos_islands_store.py [--work DIR] [--out TABLE.md] \
      [--seed N] [--deadline S] [--no_jax_cache]

The run (`RUN` below): experiments/quickstart.py:small through islands,
1M corpus characters, base 20 steps, DiPaCo 2x2 (4 paths) 40 steps in 4
rounds of H = 10 on 2 local workers and 5 executors, no learned re-routing:

  python -m dipaco_jax.islands --config=experiments/quickstart.py:small \
      --fake_devices=8 --config.data.max_corpus_chars=1000000 \
      --config.base.num_steps=20 --config.train.num_steps=40 \
      --config.diloco.inner_steps=10 --config.eval.learned_reroute=False \
      --num_workers=2 --workdir=W

The store is W/islands/dipaco (STORE). Cases:

  1 reference: the run, uninterrupted.
  2 three bytes flipped in a chunk file of the final module version
    (STORE/modules/layers_00_01/00000/v000004) of a copy of the finished
    reference, results.json deleted, the same command rerun: the damage
    named (`damaged key ...`), the version rebuilt (`rebuilt modules/...`,
    its digests the reference's), exit 0, perplexities equal.
  3 a data file (the largest chunk) of module version v000001 deleted as
    soon as its commit marker appears, during the run: it finishes, a
    role's log (STORE/logs/*.log) names the damaged key, the key is
    rebuilt, no role given up (`exited 21 times`), perplexities equal.
  4 SIGTERM to worker w0 during one of its tasks, once the first outer
    step has committed (some module at v000001): its log says `SIGTERM:
    stopped; committed keys stay ...`, it exits 75 and the launcher
    restarts it, the coordinator says `worker w0 left (preempted)`, the
    run finishes, perplexities equal.
  5 SIGTERM to the launcher 0-4 s after the first outer step has
    committed: exit 75, one error line, `error: preempted by SIGTERM
    ...`, no traceback, no role process left; the same command rerun
    finishes with perplexities equal.
  6 a worker of other code: `python -m dipaco_jax.islands.worker
    --store=STORE --worker_id=x` on a copy of the reference's store whose
    spec.json's code.sha256 is another hash: exit 2, one line (`... was
    written by dipaco_jax ... join it with the same code ...`), no
    traceback.

Cases 3-5 start from a copy of the reference's workdir without its island
store and DiPaCo run (data, tokenizer, base, router, shards and the dense
run reused), so they train DiPaCo only. "Perplexities equal" means the
`models` block of results.json (every model's loss and perplexity, floats
written with repr) is equal to the reference's as parsed JSON.

The runs' code hash (`code_version`) pins the sources: editing a
number-shaping file of dipaco_jax while this runs makes a restarted role or
a rerun refuse the store (case 6's line). Run it from a copy of the tree
when others edit it.
"""

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RUN = ["--config=experiments/quickstart.py:small", "--fake_devices=8",
       "--config.data.max_corpus_chars=1000000",
       "--config.base.num_steps=20", "--config.train.num_steps=40",
       "--config.diloco.inner_steps=10",
       "--config.eval.learned_reroute=False", "--num_workers=2"]
ROUNDS = 4  # 40 steps / H = 10.
MODULE = "modules/layers_00_01/00000"  # The damaged module's key prefix.
ROLES = ("coordinator", "worker", "executor")
ROUTED = "dipaco routed once per document"

# The process, table and text helpers are the main-job script's: one
# registry of live processes (`_LIVE`) and one deadline for both.
sys.path.insert(0, str(REPO / "bench"))
import chaos_local  # pylint: disable=g-import-not-at-top,wrong-import-position
from chaos_local import (  # pylint: disable=g-import-not-at-top,wrong-import-position
    Proc, _kill, lines, load_results, short, table, wait_for)
from dipaco_jax.store import items  # pylint: disable=g-import-not-at-top,wrong-import-position

_LIVE = chaos_local._LIVE  # pylint: disable=protected-access
_STORES = set()  # Stores whose roles (own sessions) this script started
_T0 = time.time()
_DEADLINE = chaos_local._DEADLINE  # pylint: disable=protected-access


# --- Processes -------------------------------------------------------------


def role_pids(store: Path, role: str | None = None,
              worker_id: str | None = None) -> list[int]:
  """Pids of the island roles running on `store` (their argv: python -m
  dipaco_jax.islands.ROLE --store=STORE ...), from /proc."""
  want = f"--store={store}"
  found = []
  for proc in Path("/proc").iterdir():
    if not proc.name.isdigit():
      continue
    try:
      argv = (proc / "cmdline").read_bytes().decode(errors="replace"
                                                    ).split("\0")
    except OSError:
      continue
    if want not in argv or "-m" not in argv:
      continue
    module = argv[argv.index("-m") + 1] if argv.index("-m") + 1 < len(
        argv) else ""
    if not any(module == f"dipaco_jax.islands.{r}" for r in ROLES):
      continue
    if role is not None and module != f"dipaco_jax.islands.{role}":
      continue
    if worker_id is not None and f"--worker_id={worker_id}" not in argv:
      continue
    found.append(int(proc.name))
  return found


def kill_roles(store: Path) -> int:
  """SIGKILL to every role still running on `store` (each in its own
  session, started by a launcher of this script); returns how many."""
  pids = role_pids(store)
  for pid in pids:
    try:
      os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
  return len(pids)


def kill_all() -> None:
  for p in list(_LIVE.values()):
    _kill(p)
  for store in list(_STORES):
    kill_roles(store)


def _on_signal(signum, _frame):
  kill_all()
  sys.exit(128 + signum)


# --- Workdirs, stores, damage ------------------------------------------------


def store_of(workdir: Path) -> Path:
  return workdir / "islands" / "dipaco"


BASE_PARTS = ("config.json", "data", "tokenizer", "router", "shards",
              "splits.json", "runs/base", "runs/dense")


def clone(src: Path, dst: Path, parts=None) -> Path:
  """Copies `parts` of workdir `src` (all but its lock when None) to a
  fresh `dst`."""
  if parts is None:
    parts = [p.name for p in src.iterdir() if p.name != ".lock"]
  dst.mkdir(parents=True)
  for part in parts:
    s = src / part
    if s.is_dir():
      shutil.copytree(s, dst / part, symlinks=True)
    elif s.exists():
      (dst / part).parent.mkdir(parents=True, exist_ok=True)
      shutil.copy2(s, dst / part)
  return dst


def committed(key: Path) -> bool:
  return (key / "COMMITTED.json").exists()


def chunk_files(key: Path) -> list[Path]:
  """A key's array data files (zarr chunks under item/ARRAY/), largest
  first."""
  item = items.item_dir(key)
  files = [p for p in item.rglob("*") if p.is_file()
           and not p.name.startswith(".") and p.parent != item]
  return sorted(files, key=lambda p: (-p.stat().st_size, str(p)))


def flip_bytes(path: Path, n: int = 3) -> str:
  """XORs n bytes (at 1/4, 1/2, 3/4 of the file) with 0xff."""
  data = bytearray(path.read_bytes())
  at = [len(data) * (i + 1) // (n + 1) for i in range(n)]
  for i in at:
    data[i] ^= 0xFF
  path.write_bytes(bytes(data))
  return f"bytes {', '.join(f'{i:,}' for i in at)} of {path.name} flipped"


def versions(store: Path, module: str = MODULE) -> list[int]:
  """The committed versions of one module."""
  d = store / module
  if not d.is_dir():
    return []
  return sorted(int(p.name[1:]) for p in d.iterdir()
                if p.name.startswith("v") and committed(p))


def digests(key: Path) -> dict | None:
  try:
    return json.loads((key / "COMMITTED.json").read_text())["digests"]
  except (OSError, ValueError, KeyError):
    return None


def round1_started(store: Path) -> bool:
  """Round 0's outer step committed (some module at v000001): the workers
  are on round 1."""
  return any(committed(p) for p in store.glob("modules/*/*/v000001"))


def read_json(path: Path) -> dict | None:
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError):
    return None


def role_logs(store: Path) -> dict[str, str]:
  d = store / "logs"
  return {p.name: p.read_text(errors="replace")
          for p in sorted(d.glob("*.log"))} if d.is_dir() else {}


def log_lines(store: Path, pattern: str) -> list[str]:
  """`name: line` for every line of the role logs matching `pattern`."""
  return [f"{name}: {l.strip()}" for name, text in role_logs(store).items()
          for l in lines(text, pattern)]


def routed(results: dict | None):
  ppl = (results or {}).get("models", {}).get(ROUTED, {}).get("perplexity")
  return f"{ppl:.2f}" if isinstance(ppl, float) else str(ppl)


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
    self.ref = self.work / "ref"
    self.ref_results = None

  # Helpers.

  def start(self, name, workdir) -> Proc:
    print(f"  [{time.time() - _T0:6.0f}s] {name}: islands run in "
          f"{Path(workdir).name}", flush=True)
    _STORES.add(store_of(workdir))
    return Proc(self.logs, name, [sys.executable, "-m", "dipaco_jax.islands",
                                  *RUN, f"--workdir={workdir}"], self.env)

  def run(self, name, workdir, timeout=900) -> Proc:
    p = self.start(name, workdir).wait(timeout)
    kill_roles(store_of(workdir))  # None should be left; a timeout's are.
    return p

  def row(self, case, expected, observed, ok, t0=None):
    verdict = "PASS" if ok else "FAIL"
    if t0 is not None:
      self.timings.append((case.split()[0], time.time() - t0))
    self.rows.append((case, expected, observed, verdict))
    print(f"  -> {case.split()[0]}: {verdict}: {short(observed, 500)}",
          flush=True)

  def fail_not_run(self, case, expected, why):
    self.row(case, expected, f"not run: {why}", False)

  def equal(self, workdir: Path) -> tuple[bool, str]:
    got = load_results(workdir)
    if got is None:
      return False, "no results.json"
    if got.get("models") == self.ref_results.get("models"):
      return True, f"perplexities equal (routed {routed(got)})"
    diff = [m for m in self.ref_results["models"]
            if got.get("models", {}).get(m) != self.ref_results["models"][m]]
    return False, (f"perplexities DIFFER: routed {routed(got)} against "
                   f"{routed(self.ref_results)} ({len(diff)} models differ)")

  def fresh(self, name: str) -> Path:
    """A copy of the reference workdir without its DiPaCo run."""
    return clone(self.ref, self.work / name, BASE_PARTS)

  # 1: the reference.

  def reference(self) -> bool:
    t0 = time.time()
    p = self.run("c1_ref", self.ref, timeout=1500)
    self.ref_results = load_results(self.ref)
    store = store_of(self.ref)
    final = store / MODULE / f"v{ROUNDS:06d}"
    ok = p.rc == 0 and self.ref_results is not None and committed(final)
    damaged = log_lines(store, r"damaged key") + lines(p.out, "damaged key")
    ok &= not damaged
    self.row("1 reference (uninterrupted)",
             "exit 0, results.json; no key reported damaged",
             f"{p.status()} in {p.seconds:.0f} s; routed ppl "
             f"{routed(self.ref_results)}; {MODULE} versions "
             f"{versions(store)} kept; {len(damaged)} damage lines; log "
             "logs/c1_ref.out", ok, t0)
    return ok

  # 2: bytes flipped in the finished run's final version, results deleted.

  def flipped_final(self):
    case = "2 3 bytes flipped in the final module version, results.json deleted, rerun"
    expected = ("`damaged key` and `rebuilt modules/...` printed; exit 0; "
                "perplexities equal (before: `reusing`, routed 254.01 -> "
                "577.97, no word)")
    t0 = time.time()
    w = clone(self.ref, self.work / "c2_flip")
    (w / "results.json").unlink()
    store = store_of(w)
    key = store / MODULE / f"v{ROUNDS:06d}"
    rel = str(key.relative_to(store))
    what = flip_bytes(chunk_files(key)[0])
    p = self.run("c2_flip", w, timeout=900)
    damaged = lines(p.out, rf"damaged key {re.escape(rel)}\b")
    rebuilt = lines(p.out, rf"rebuilt {re.escape(rel)}\b")
    reused = lines(p.out, r"already trained .*reusing")
    same, note = self.equal(w)
    bits = digests(key) == digests(store_of(self.ref) / rel)
    ok = (p.rc == 0 and len(damaged) == 1 and len(rebuilt) == 1 and same
          and bits)
    self.row(case, expected,
             f"{rel}: {what}; {p.status()}; "
             f"{short(damaged[0], 190) if damaged else 'NO damaged-key line'}"
             f"; {short(rebuilt[0], 90) if rebuilt else 'NO rebuilt line'}; "
             f"rebuilt digests {'equal' if bits else 'DIFFER from'} the "
             f"reference's; {'training reused' if reused else 'retrained'}"
             f"; {note}", ok, t0)

  # 6: a worker of other code.

  def other_code(self):
    case = "6 a worker of other code joins (spec.json code.sha256 edited)"
    expected = ("exit 2; one line `... was written by dipaco_jax ... join "
                "it with the same code ...`; no traceback")
    t0 = time.time()
    w = clone(self.ref, self.work / "c6_code", ["islands"])
    store = store_of(w)
    spec_path = store / "spec.json"
    spec = json.loads(spec_path.read_text())
    old = spec["code"]["sha256"]
    spec["code"]["sha256"] = hashlib.sha256(b"other code").hexdigest()[:16]
    spec_path.write_text(json.dumps(spec, indent=1))
    _STORES.add(store)
    print(f"  [{time.time() - _T0:6.0f}s] c6_worker: worker x on "
          f"{store.parent.parent.name}", flush=True)
    p = Proc(self.logs, "c6_worker", [
        sys.executable, "-m", "dipaco_jax.islands.worker",
        f"--store={store}", "--worker_id=x"], self.env).wait(300)
    out = [l for l in (p.out + p.err).splitlines() if l.strip()]
    said = [l for l in out if "was written by dipaco_jax" in l
            and "join it with the same code" in l]
    trace = any("Traceback" in l for l in out)
    ok = p.rc == 2 and len(out) == 1 and len(said) == 1 and not trace
    self.row(case, expected,
             f"code {old} -> {spec['code']['sha256']}; {p.status()} in "
             f"{p.seconds:.0f} s; {len(out)} output line(s)"
             f"{', a traceback' if trace else ''}: "
             f"{short(out[0] if out else '', 330)!r}", ok, t0)

  # 3: a data file of a committed version deleted during the run.

  def deleted_midrun(self):
    case = "3 a data file of committed v000001 deleted mid-run"
    expected = ("the run finishes (exit 0); a role's log names the damaged "
                "key; it is rebuilt; no `exited 21 times`; perplexities "
                "equal")
    t0 = time.time()
    w = self.fresh("c3_delete")
    store = store_of(w)
    p = self.start("c3_delete", w)
    first = store / MODULE / "v000001"
    # Tight polling: the chunk goes before the version's readers (round 1's
    # tasks, leased once every module they use is at v1) open it.
    seen = wait_for(lambda: committed(first), 900, p, poll=0.01)
    key, what = None, None
    if seen and committed(first):
      key = first
    elif p.p.poll() is None:
      # Collected already: the newest committed version below the newest.
      older = versions(store)[:-1]
      key = store / MODULE / f"v{older[-1]:06d}" if older else None
    if key is not None:
      try:
        victim = chunk_files(key)[0]
        victim.unlink()
        what = (f"deleted {victim.relative_to(store)} "
                f"({time.time() - p.t0:.0f} s into the run)")
      except (OSError, IndexError) as e:
        key, what = None, f"could not delete: {e}"
    p.wait(900)
    kill_roles(store)
    if key is None:
      self.fail_not_run(case, expected, what or f"{first.relative_to(store)} "
                        f"never seen committed ({p.status()})")
      return
    rel = str(key.relative_to(store))
    damaged = (log_lines(store, rf"damaged key {re.escape(rel)}\b")
               + lines(p.out, rf"damaged key {re.escape(rel)}\b"))
    rebuilt = (log_lines(store, rf"rebuilt {re.escape(rel)}\b|rebuilding "
                         rf"{re.escape(rel)}\b")
               + lines(p.out, rf"rebuilt {re.escape(rel)}\b"))
    gave_up = lines(p.out + p.err, r"exited \d+ times")
    restarts = lines(p.out, r"exited \(status")
    same, note = self.equal(w)
    ok = p.rc == 0 and damaged and rebuilt and not gave_up and same
    self.row(case, expected,
             f"{what}; {p.status()} in {p.seconds:.0f} s; "
             f"{short(damaged[0], 200) if damaged else 'NO damaged-key line'}"
             f"; {short(rebuilt[0], 120) if rebuilt else 'NOT rebuilt'}; "
             f"{len(restarts)} role restarts"
             f"{'; GAVE UP: ' + short(gave_up[0], 120) if gave_up else ''}"
             f"; {note}", bool(ok), t0)

  # 4: SIGTERM to a worker.

  def sigterm_worker(self):
    case = "4 SIGTERM to worker w0 mid-run"
    expected = ("w0 logs `SIGTERM: stopped; committed keys stay ...`, exits "
                "75, restarted; coordinator: `worker w0 left (preempted)`; "
                "exit 0; perplexities equal")
    t0 = time.time()
    w = self.fresh("c4_worker")
    store = store_of(w)
    p = self.start("c4_worker", w)
    if not wait_for(lambda: round1_started(store), 900, p):
      p.wait(1)
      self.fail_not_run(case, expected, f"round 1 never started "
                        f"({p.status()})")
      return
    # In a task: once w0's heartbeat names one, a moment later.
    beat = store / "control" / "heartbeat" / "w0.json"
    wait_for(lambda: (read_json(beat) or {}).get("task") is not None, 120,
             p, poll=0.05)
    delay = self.rng.uniform(0.2, 1.0)
    time.sleep(delay)
    pids = role_pids(store, "worker", "w0")
    done_before = (store / "DONE.json").exists()
    sent = None
    if pids and not done_before:
      task = (read_json(beat) or {}).get("task")
      os.kill(pids[0], signal.SIGTERM)
      sent = (f"SIGTERM to w0 (pid {pids[0]}) "
              + (f"{delay:.1f} s into its task round {task['round']} "
                 f"workers {task['group']}" if task else
                 "between tasks (in round 1 or later)"))
    p.wait(900)
    kill_roles(store)
    if sent is None:
      self.fail_not_run(case, expected, "no w0 process or the run was done "
                        f"before the signal ({p.status()})")
      return
    logs = role_logs(store)
    stopped = lines(logs.get("worker_w0.log", ""),
                    r"SIGTERM: stopped; committed keys stay")
    status = lines(p.out, r"worker w0 exited \(status 75\); restarting")
    left = lines(logs.get("coordinator.log", ""),
                 r"worker w0 left \(preempted\)")
    other = [l for l in lines(p.out, r"exited \(status") if l not in status]
    same, note = self.equal(w)
    ok = (p.rc == 0 and len(stopped) == 1 and len(status) == 1 and left
          and not other and same)
    self.row(case, expected,
             f"{sent}; w0: {short(stopped[0], 110) if stopped else 'NO SIGTERM line'}"
             f"; launcher: {short(status[0], 90) if status else 'NO status-75 restart'}"
             f"; coordinator: {short(left[0], 100) if left else 'NO left (preempted) line'}"
             f"{'; other restarts: ' + short(' / '.join(other), 120) if other else ''}"
             f"; {p.status()} in {p.seconds:.0f} s; {note}", bool(ok), t0)

  # 5: SIGTERM to the launcher, then the same command.

  def sigterm_launcher(self):
    case = "5 SIGTERM to the launcher mid-run, same command rerun"
    expected = ("exit 75, one error line `error: preempted by SIGTERM "
                "...`, no traceback, no role left running; the rerun: exit "
                "0, perplexities equal")
    t0 = time.time()
    w = self.fresh("c5_launcher")
    store = store_of(w)
    p = self.start("c5_launcher", w)
    if not wait_for(lambda: round1_started(store), 900, p):
      p.wait(1)
      self.fail_not_run(case, expected, f"round 1 never started "
                        f"({p.status()})")
      return
    delay = self.rng.uniform(0.0, 4.0)
    time.sleep(delay)
    if p.p.poll() is not None or (store / "DONE.json").exists():
      p.wait(1)
      self.fail_not_run(case, expected, f"the run ended ({p.status()}) "
                        "before the signal")
      return
    roles_before = len(role_pids(store))
    os.kill(p.pid, signal.SIGTERM)
    p.wait(300)
    time.sleep(1.0)
    left = role_pids(store)
    kill_roles(store)
    newest = versions(store)
    err = p.err_lines()
    errors = [l for l in err if re.search(r"\berror\b", l, re.I)]
    orbax = [l for l in err if "Skipping merge of OCDBT" in l]
    others = [l for l in err if l not in errors and l not in orbax]
    said = [l for l in err if l.startswith("error: preempted by SIGTERM")]
    trace = any("Traceback" in l for l in err)
    first_ok = (p.rc == 75 and len(said) == 1 and len(errors) == 1
                and not trace and not left)
    obs = (f"SIGTERM {delay:.1f} s after round 1 began ({roles_before} "
           f"roles running); {p.status()} in {p.seconds:.0f} s; "
           f"{len(errors)} error line(s): "
           f"{short(said[0] if said else (errors[0] if errors else ''), 170)!r}"
           f"{', a traceback' if trace else ''} (stderr's other lines: "
           f"{len(orbax)} orbax `Skipping merge of OCDBT` warnings from the "
           f"start's version 0, {len(others)} more); {len(left)} role(s) "
           f"left running; {MODULE} at v{max(newest, default=0)} of {ROUNDS}"
           f", DONE.json {'present' if (store / 'DONE.json').exists() else 'absent'}")
    rerun = self.run("c5_rerun", w, timeout=900)
    restarted = lines(rerun.out, r"islands: \d+ tasks per round")
    same, note = self.equal(w)
    ok = first_ok and rerun.rc == 0 and same
    self.row(case, expected,
             f"{obs}; rerun {rerun.status()} in {rerun.seconds:.0f} s"
             f"{' (roles started again)' if restarted else ''}; {note}",
             ok, t0)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--work", default="/tmp/chaos_islands_store")
  ap.add_argument("--out", default=None, help="also write the table here")
  ap.add_argument("--seed", type=int,
                  default=int(os.environ.get("CHAOS_SEED", time.time_ns()
                                             % 100_000)))
  ap.add_argument("--deadline", type=float, default=5400.0,
                  help="seconds; every wait ends by then")
  ap.add_argument("--no_jax_cache", action="store_true")
  args = ap.parse_args()
  _DEADLINE[0] = _T0 + args.deadline
  signal.signal(signal.SIGTERM, _on_signal)
  signal.signal(signal.SIGINT, _on_signal)

  c = Chaos(args)
  if c.work.exists():
    shutil.rmtree(c.work)
  c.logs.mkdir(parents=True)
  print(f"chaos_islands_store: work {c.work}, seed {c.seed}; logs in "
        f"{c.logs}; code {REPO}", flush=True)
  try:
    if c.reference():
      c.flipped_final()
      c.other_code()
      c.deleted_midrun()
      c.sigterm_worker()
      c.sigterm_launcher()
    else:
      for case in ("2", "3", "4", "5", "6"):
        c.fail_not_run(case, "-", "the reference run failed (logs/c1_ref.*)")
  finally:
    kill_all()
  total = time.time() - _T0
  c.rows.sort(key=lambda r: int(r[0].split()[0]))  # Run as 1, 2, 6, 3-5.
  fails = sum(r[3] == "FAIL" for r in c.rows)
  header = (
      f"chaos_islands_store: {len(c.rows)} cases, {fails} FAIL, "
      f"{total / 60:.1f} min on {os.cpu_count()} cores; seed {c.seed}; run: "
      f"python -m dipaco_jax.islands {' '.join(RUN)} --workdir=W (store "
      "W/islands/dipaco); 'perplexities equal' = the models block of "
      "results.json equal to the reference's")
  timings = "seconds per case: " + ", ".join(
      f"{k} {v:.0f}" for k, v in c.timings)
  text = "\n".join([header, "", table(c.rows), "", timings])
  print("\n" + text, flush=True)
  if args.out:
    Path(args.out).write_text(text + "\n")
  sys.exit(1 if fails else 0)


if __name__ == "__main__":
  main()
