r"""DiLoCo x2 where each replica is a 2-stage GPipe pipeline, on CPU.

Commands (2-core CPU, 8 fake devices: path 2 x stage 2 x data 2):
  python -m dipaco_jax.main --config=experiments/pipeline.py \
      --workdir=/tmp/dipaco_pipeline --fake_devices=8
  python -m dipaco_jax.main --config=experiments/pipeline.py:plain \
      --workdir=/tmp/dipaco_pipeline_plain --fake_devices=8

Each replica's 4 layers run as 2 stages of 2 layers (`config.pipeline`,
model/pipelined.py), 4 microbatches of 2 rows each: the bubble is 1/5 of
a step (shown on every progress line). Each stage's devices hold only its
layers' parameters, AdamW moments and outer momentum; the outer step runs
on each stage's devices without moving bytes between stages. The `plain`
arm is the same run without the pipeline (stages 1): the two must agree.

Expected result (recorded on a 2-core CPU, 2026-11-27, 53-86 s each, the
data stage included): both arms end at validation loss 4.6356, perplexity
103.09, and their logged losses (means over 25 steps) differ by at most
9.1e-5 over the 200 steps (the pipeline sums each step's gradient over
microbatches: the same numbers up to float rounding). The pipelined arm
runs slower on CPU; a pipeline pays only for a model whose layers and
optimizer state do not fit one accelerator (bench/pipeline_throughput.py).
"""

from dipaco_jax import config_base

_ARMS = ("pipelined", "plain")


def get_config(arm: str = "pipelined"):
  """`arm`: 'pipelined' (2 stages x 4 microbatches) or 'plain'."""
  if arm not in _ARMS:
    raise ValueError(f"experiments/pipeline.py:{arm}: the arm must be one "
                     f"of {', '.join(_ARMS)}.")
  # The quickstart's corpus and CPU-sized model, as DiLoCo x2 from scratch.
  c = config_base.load_experiment("quickstart.py", relative_to=__file__)
  c.paths.shape = "1"
  c.paths.num_replicas = 2
  c.routing.features = "token_embedding"  # No router: iid replica shards.
  c.base.num_steps = 0
  c.train.num_steps = 200
  c.ckpt.every = 100
  if arm == "pipelined":
    c.pipeline.stages = 2
    c.pipeline.microbatches = 4
  return c
