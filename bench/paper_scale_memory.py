r"""What one island worker of the paper's 16x16 needs, from its config alone.

  python bench/paper_scale_memory.py [--paths_per_task=1,4,16]

For each group size K (paths a task trains), the lower bound of
`train/memory_estimate.py` (parameters, AdamW, gradients, activations,
logits; XLA's temporaries left out) of one task's step, with the config's
loss in one piece and in chunks of 128 tokens (`model.loss_chunk`), per
device of a few TPU slices, and a path's contribution and AdamW state, the
bytes of a round (`docs/paper_scale.md` has the formulas). Prints a Markdown
table: per chip, the bound spread over the slice's chips, over or under
its HBM (over: surely does not fit, refused; under: may fit).
Nothing runs on an accelerator: these are estimates, not measurements.
"""

import importlib.util
import pathlib

from absl import app
from absl import flags

from dipaco_jax import errors
from dipaco_jax.train import memory_estimate

_PATHS_PER_TASK = flags.DEFINE_list("paths_per_task", ["1", "4", "16"],
                                    "group sizes K to estimate")
_CONFIG = (pathlib.Path(__file__).resolve().parents[1] / "experiments" /
           "paper_dipaco_16x16_c4.py")
# (slice, chips, HBM a chip in GiB): Cloud TPU's published figures.
_SLICES = (("v4-8", 4, 32), ("v5p-8", 4, 95), ("v5litepod-8", 8, 16),
           ("v6e-8", 8, 32))


def _paper_config():
  spec = importlib.util.spec_from_file_location("paper", _CONFIG)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def main(argv):
  del argv
  config = _paper_config()
  params = memory_estimate.path_parameters(config.model,
                                           config.data.vocab_size)
  print(f"path parameters: {params:,}")
  header = ["K", "loss", "step (lower bound)"] + [
      f"a chip of {name} ({chips} x {hbm} GiB)" for name, chips, hbm in
      _SLICES]
  print("| " + " | ".join(header) + " |")
  print("|" + " --- |" * len(header))
  for k in map(int, _PATHS_PER_TASK.value):
    for chunk in (0, 128):
      config.model.loss_chunk = chunk
      step = memory_estimate.estimate(config, "cudnn", cpu=False, workers=k)
      cells = []
      for _, chips, hbm in _SLICES:
        need = step.device_total / chips
        # Over: surely does not fit (refused); under: may fit.
        verdict = "under" if need <= hbm * 2**30 else "over"
        cells.append(f"{errors.format_bytes(int(need))} ({verdict})")
      print(f"| {k} | {'chunks of 128' if chunk else 'whole'} | "
            f"{errors.format_bytes(step.device_total)} | "
            + " | ".join(cells) + " |")
  contribution = params * 4
  print(f"\na path's float32 contribution C = "
        f"{errors.format_bytes(contribution)}; its AdamW state 2C = "
        f"{errors.format_bytes(2 * contribution)}")


if __name__ == "__main__":
  app.run(main)
