"""The island runtime: paths trained as separate jobs that share only a store.

Roles (each its own OS process, possibly on its own machine):

  worker       runs tasks: H inner steps of a group of paths for one round,
               then writes their contributions and inner states (worker.py
               takes them, task_runner.py runs one)
  executor     applies the outer step of its modules once every user's
               contribution of a round is committed (executor.py)
  coordinator  turns the run into tasks (round x group of paths), leases
               them to live workers, re-queues those of dead ones
               (coordinator.py)

They know each other only through the store (`layout.py`): a directory,
local or `gs://`, where every key carries its round or version, every write
is idempotent and ends with a commit marker, and nothing uncommitted is
read. `launcher.py` starts the roles on this machine for each multi-worker
run of the main job (`python -m dipaco_jax.islands`).
"""
