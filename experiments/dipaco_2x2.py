r"""DiPaCo 2x2 (4 paths of ~33M parameters) on the stdlib corpus, one GPU.

Command (one H100/H200):
  python -m dipaco_jax.main --config=experiments/dipaco_2x2.py \
      --workdir=/tmp/dipaco_2x2

Same model, base and schedule as dipaco_4x4, with 2 experts per level.
Expected result (H100, on the site-packages corpus of docs/quality.md):
validation perplexity routed once about 39.3, re-routed every 64 tokens by
the learned window router about 38.4, dense baseline about 44.8;
docs/quality.md ("DiPaCo vs dense") has the table.
"""

from dipaco_jax import config_base


def get_config():
  c = config_base.load_experiment("dipaco_4x4.py", relative_to=__file__)
  c.paths.shape = "2x2"
  return c
