"""The store's keys of modules and of workers' inner states, and their
committed versions: `ROOT/modules/{slot}/{expert:05d}/v{version:06d}/` and
`ROOT/inner/{worker:05d}/s{step:08d}/`, each a `store.items` tree behind its
commit marker.
"""

import re

from etils import epath

from dipaco_jax.store import atomic
from dipaco_jax.store import items
from dipaco_jax.store import link


def _committed_keys(parent: epath.Path, prefix: str) -> list[int]:
  """The numbers n of the committed `{prefix}{n}` directories, ascending."""
  link.operation("list")
  if not parent.exists():
    return []
  pattern = re.compile(rf"{prefix}(\d+)")
  keys = [int(m.group(1)) for d in parent.iterdir()
          if (m := pattern.fullmatch(d.name)) and atomic.is_committed(d)]
  return sorted(keys)


# Modules.


def module_dir(root, slot: str, expert: int, version: int) -> epath.Path:
  return (epath.Path(root) / "modules" / slot / f"{expert:05d}"
          / f"v{version:06d}")


def save_module(root, slot: str, expert: int, version: int, params, opt_state,
                meta: dict | None = None, *, collective: bool = False) -> bool:
  """Saves module (slot, expert) at `version`; see `save_tree`."""
  return items.save_tree(module_dir(root, slot, expert, version),
                   {"params": params, "opt_state": opt_state}, meta,
                   collective=collective)


def load_module(root, slot: str, expert: int, version: int, abstract_params,
                abstract_opt_state):
  """`(params, opt_state, meta)` of a committed module version."""
  tree, meta = items.load_tree(module_dir(root, slot, expert, version),
                         {"params": abstract_params,
                          "opt_state": abstract_opt_state})
  return tree["params"], tree["opt_state"], meta


def committed_versions(root, slot: str, expert: int) -> list[int]:
  return _committed_keys(
      epath.Path(root) / "modules" / slot / f"{expert:05d}", "v")


def latest_version(root, slot: str, expert: int) -> int | None:
  versions = committed_versions(root, slot, expert)
  return versions[-1] if versions else None


# Inner (per-worker) states.


def inner_dir(root, worker: int, step: int) -> epath.Path:
  return epath.Path(root) / "inner" / f"{worker:05d}" / f"s{step:08d}"


def save_inner(root, worker: int, step: int, inner_tree,
               meta: dict | None = None, *, collective: bool = False) -> bool:
  """Saves worker `worker`'s inner state at `step`; see `save_tree`."""
  return items.save_tree(inner_dir(root, worker, step), inner_tree, meta,
                   collective=collective)


def load_inner(root, worker: int, step: int, abstract_inner):
  """`(inner_tree, meta)` of a committed worker state."""
  return items.load_tree(inner_dir(root, worker, step), abstract_inner)


def committed_inner_steps(root, worker: int) -> list[int]:
  return _committed_keys(epath.Path(root) / "inner" / f"{worker:05d}", "s")


def latest_inner_step(root, worker: int) -> int | None:
  steps = committed_inner_steps(root, worker)
  return steps[-1] if steps else None
