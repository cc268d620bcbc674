r"""Sweep: DiLoCo's outer learning rate (and momentum), as a config file.

Command (runs every point one after another, one workdir each):
  python launch/sweep.py --sweep=experiments/sweep_diloco_outer_lr.py \
      --workdir=/tmp/sweep_outer_lr [-- extra --config.* overrides]

`get_config()` is the base experiment; `get_sweep()` lists the overrides of
each point. Expected result: see docs/quality.md ("DiLoCo vs synchronous").
"""

from dipaco_jax import config_base


def get_config():
  return config_base.load_experiment("diloco.py", relative_to=__file__)


def get_sweep():
  return [{"diloco.outer_lr": lr, "diloco.outer_momentum": m}
          for lr, m in ((0.4, 0.9), (1.0, 0.9), (0.7, 0.8))]
