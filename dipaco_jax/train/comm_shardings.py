"""Shardings of what DiLoCoX's communication adds to the training state
(`diloco.comm_step`), beside the Runtime's own (`train/state.py`)."""

import jax
import optax


def add(state_shardings, abstract, inner_param_shardings, bank_shardings,
        outer_tx, worker_vector, replicated):
  """Fills `state_shardings` in, for the keys `abstract` (the state's
  shapes) has: per-worker trees like the workers' parameters, the pending
  pseudo-gradients like the bank, scalars replicated."""
  inner, outer = abstract["inner"], abstract["outer"]
  inner_sh, outer_sh = (state_shardings[k] for k in ("inner", "outer"))
  for key in ("anchor", "residual", "prev_sent", "handover"):
    if key in inner:
      inner_sh[key] = {n: inner_param_shardings[n]
                       for n in inner[key]}
  if "eager_opt" in inner:  # Each worker's own outer optimizer state.
    inner_sh["eager_opt"] = {n: optax.tree_map_params(
        outer_tx, lambda _, sh: sh, inner["eager_opt"][n],
        inner_param_shardings[n],
        transform_non_params=lambda leaf: (
            worker_vector if leaf.ndim else replicated))
                             for n in inner["eager_opt"]}
  if "codec_state" in inner:
    inner_sh["codec_state"] = jax.tree.map(
        lambda _: worker_vector, inner["codec_state"])
  for key in ("sent_bytes_W", "recv_bytes_W"):
    if key in inner:
      inner_sh[key] = worker_vector
  if "published" in outer:  # The workers' copy of the bank.
    outer_sh["published"] = {n: bank_shardings[n]
                             for n in outer["published"]}
  if "published_state" in outer:  # Scalars (strided's round) per module.
    outer_sh["published_state"] = jax.tree.map(lambda _: replicated,
                                               outer["published_state"])
  if "pending" in outer:
    outer_sh["pending"] = {n: bank_shardings[n]
                           for n in outer["pending"]}
    outer_sh["pending_users"] = {n: replicated
                                 for n in outer["pending_users"]}
    outer_sh["has_pending"] = replicated
