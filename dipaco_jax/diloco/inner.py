"""The inner optimizer: AdamW with warmup + cosine decay and clipping."""

import jax
import optax


def learning_rate_schedule(inner_config, num_steps: int) -> optax.Schedule:
  warmup = min(inner_config.warmup_steps, max(num_steps - 1, 0))
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0,
      peak_value=inner_config.learning_rate,
      warmup_steps=warmup,
      decay_steps=max(num_steps, warmup + 1),
      end_value=inner_config.learning_rate * inner_config.final_lr_fraction)


def _decay_mask(params):
  """Weight decay on matrices only: not on RMSNorm scales."""
  def decays(path, _):
    return not any(getattr(k, "key", None) == "scale" for k in path)
  return jax.tree_util.tree_map_with_path(decays, params)


def inner_optimizer(inner_config, num_steps: int
                    ) -> optax.GradientTransformation:
  """AdamW (the papers' inner optimizer), or plain SGD for equivalence
  tests, after optional global-norm clipping per worker."""
  schedule = learning_rate_schedule(inner_config, num_steps)
  if inner_config.name == "sgd":
    tx = optax.sgd(schedule)
  else:
    tx = optax.adamw(schedule, b1=inner_config.b1, b2=inner_config.b2,
                     weight_decay=inner_config.weight_decay, mask=_decay_mask)
  if inner_config.grad_clip > 0:
    return optax.chain(optax.clip_by_global_norm(inner_config.grad_clip), tx)
  return tx
