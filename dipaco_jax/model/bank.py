"""Converting parameters between topologies: fork a dense base into a bank.

DiPaCo starts every path from one dense model (the paper pretrains a dense
150M model, then copies it into every module). The dense model's layers are
re-cut into the target topology's slots and each slot is broadcast to its K
experts, so every path starts as exactly the base model.
"""

import jax
import jax.numpy as jnp


def _layer_stack(path_params, topology):
  """All transformer layers of a path, stacked on axis 0 in depth order."""
  stacks = []
  for slot in topology.layer_slots:
    blocks = path_params[slot.name].get("blocks")
    if blocks is None:
      raise ValueError("Forking a base model needs config.model.scan_layers="
                       "True (stacked layer parameters).")
    stacks.append(blocks)
  return jax.tree.map(lambda *xs: jnp.concatenate(xs), *stacks)


def path_params_to_bank(path_params, source_topology, target_topology):
  """A bank for `target_topology` whose every path equals `path_params`.

  `path_params` is one path of `source_topology` (e.g. the dense base).
  """
  layers = _layer_stack(path_params, source_topology)
  bank = {}
  for slot in target_topology.slots:
    if slot.layers:
      first, last = slot.layers[0], slot.layers[-1] + 1
      tree = {"blocks": jax.tree.map(lambda x, a=first, b=last: x[a:b],
                                     layers)}
    else:
      tree = path_params[slot.name]
    bank[slot.name] = jax.tree.map(
        lambda x, k=slot.num_experts: jnp.broadcast_to(x, (k,) + x.shape),
        tree)
  return bank


def bank_path(bank, topology, path: int):
  """One path's parameters from a bank (host or device arrays)."""
  row = topology.path_assignment_PxS()[path]
  return {s.name: jax.tree.map(lambda x, e=int(row[i]): x[e], bank[s.name])
          for i, s in enumerate(topology.slots)}
