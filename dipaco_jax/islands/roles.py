"""The local launcher's processes: one OS process per role (coordinator,
workers, executors) whose command line names it, each with its own
environment and GPU, started, restarted when it dies, and stopped.
"""

import os
import subprocess
import sys
import tempfile
import time

from etils import epath

from dipaco_jax.errors import UserError
from dipaco_jax.islands import layout
from dipaco_jax.store import object_store


class IslandError(RuntimeError):
  """The island run cannot finish (a role failed for good)."""


def role_command(role: str, run, *args: str) -> list[str]:
  return [sys.executable, "-m", f"dipaco_jax.islands.{role}",
          f"--store={run}", *args]


class Role:
  """One role process and how to start it again."""

  def __init__(self, name: str, command: list[str], log_path, env):
    self.name, self.command, self.env = name, command, env
    self.log_path = epath.Path(log_path)
    self.restarts = 0
    self.process = None

  def start(self) -> None:
    self.log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(self.log_path, "a") as log:
      self.process = subprocess.Popen(
          self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env,
          start_new_session=True)

  def running(self) -> bool:
    return self.process is not None and self.process.poll() is None

  def stop(self, timeout_s: float = 10.0) -> None:
    """SIGTERM (the role's one line and exit), SIGKILL after `timeout_s`."""
    if self.running():
      self.process.terminate()
    self.wait(timeout_s)

  def wait(self, timeout_s: float = 10.0) -> None:
    if self.process is None:
      return
    try:
      self.process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
      self.process.kill()
      self.process.wait(timeout=timeout_s)


def _role_env() -> dict:
  env = dict(os.environ)
  # Roles share this machine's accelerators: none grabs most of the memory.
  env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  env["PYTHONUNBUFFERED"] = "1"
  return env


def worker_gpu(i: int, gpus_per_machine: int, visible) -> str:
  """Worker i's GPU: i % n, or the (i % n)-th entry of `visible` (the
  launcher's CUDA_VISIBLE_DEVICES, a comma-separated list), so two runs
  on disjoint GPUs of one machine keep to their own."""
  index = i % gpus_per_machine
  ids = [x for x in (visible or "").split(",") if x.strip()]
  if not ids:
    return str(index)
  if len(ids) < gpus_per_machine:
    raise UserError(
        f"--gpus_per_worker_machine={gpus_per_machine} but "
        f"CUDA_VISIBLE_DEVICES={visible} lists {len(ids)} GPU(s); list at "
        "least that many or lower the flag")
  return ids[index].strip()


def log_dir(run, options) -> epath.Path:
  """Where the launcher's roles write their output: `options.log_dir`, else
  `{run}/logs` for a local store, else a directory of this machine's named
  after the store (a process's output is appended to as it runs, which an
  object can not be)."""
  if options.log_dir:
    return epath.Path(options.log_dir)
  if not object_store.is_object_store(run):
    return epath.Path(run) / "logs"
  scheme, _, rest = str(run).partition("://")
  return epath.Path(tempfile.gettempdir(), "dipaco_jax_island_logs",
                    scheme, rest)


def make_roles(run, options, num_modules: int) -> list[Role]:
  """The roles of a run with `options` (launcher.IslandOptions).
  `num_modules`: the run's units (`islands/units.py`), the most
  executors that have work."""
  env = _role_env()
  cpu_env = {**env, "JAX_PLATFORMS": "cpu"}  # Executors: elementwise work.
  logs = log_dir(run, options)
  roles = [Role("coordinator", role_command("coordinator", run),
                logs / "coordinator.log", cpu_env)]
  for i in range(options.num_workers):
    worker_id = f"w{i}"
    args = [f"--worker_id={worker_id}"]
    if options.fake_devices:
      args.append(f"--fake_devices={options.fake_devices}")
    if options.slowdown_s.get(worker_id):
      args.append(f"--slowdown_s={options.slowdown_s[worker_id]}")
    if options.download_cache_mb is not None:
      args.append(f"--download_cache_mb={options.download_cache_mb}")
    worker_env = env
    if options.gpus_per_machine:
      worker_env = {**env, "CUDA_VISIBLE_DEVICES": worker_gpu(
          i, options.gpus_per_machine, env.get("CUDA_VISIBLE_DEVICES"))}
    roles.append(Role(f"worker {worker_id}", role_command("worker", run,
                                                          *args),
                      logs / f"worker_{worker_id}.log", worker_env))
  num_executors = options.num_executors or min(num_modules, 8)
  for i in range(num_executors):
    roles.append(Role(f"executor {i}", role_command(
        "executor", run, f"--shard={i}", f"--num_shards={num_executors}"),
                      logs / f"executor_{i}.log", cpu_env))
  return roles


def supervise(run, roles: list[Role], options, log,
              poll_s: float = 0.2) -> None:
  """Starts the roles and keeps them running until DONE.json appears."""
  for role in roles:
    role.start()
  try:
    while not layout.is_done(run):
      for role in roles:
        code = role.process.poll()
        if code is None or code == 0:
          continue  # Running, or its part is finished (an executor).
        failed = layout.control_files(layout.control(run, "failed"))
        if failed:
          reasons = [layout.read_json(p) for p in failed]
          raise IslandError("; ".join(r["error"] for r in reasons if r))
        if role.restarts >= options.max_restarts:
          raise IslandError(
              f"{role.name} exited {options.max_restarts + 1} times (last "
              f"status {code}); see {role.log_path}")
        role.restarts += 1
        log(f"{role.name} exited (status {code}); restarting it "
            f"({role.restarts}/{options.max_restarts})")
        role.start()
      time.sleep(poll_s)
  finally:
    # Signalled all at once, then awaited: each exits in its own time.
    for role in roles:
      if role.running():
        role.process.terminate()
    for role in roles:
      role.wait()
