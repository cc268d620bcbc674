r"""Sharded evaluation: wall time of scoring every path on 1 device and on all.

  python bench/eval_throughput.py --config=experiments/dipaco_4x4.py \
      --tokens=1000000 --out=/tmp/eval.json

Scores `--tokens` random validation tokens (documents of ~1,500 tokens,
cut into the config's windows) under every path of the config's model and
topology, with random, different parameters per path, through
`eval.sharded.score_paths` (what the evaluation stage runs): first on one
device, then on every local device, each timed after a warm-up pass that
compiles. On one device it also times groups of 1 and of 4 paths, to show
whether vmapping paths helps when there is nothing to spread them over.
"""

import argparse
import importlib.util
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from dipaco_jax import paths as paths_lib
from dipaco_jax.data import token_store
from dipaco_jax.eval import routed
from dipaco_jax.eval import sharded
from dipaco_jax.model import layers
from dipaco_jax.model import transformer
import timing  # bench/timing.py


def load_config(path):
  """An experiment config file, by its path from here or from the repo
  root (bench/scaling.py names `experiments/...`, whatever the cwd)."""
  if not os.path.exists(path):
    path = os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), path)
  spec = importlib.util.spec_from_file_location("bench_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def apply_overrides(config, settings):
  """`section.field=value` strings (bench flags `--set`) onto `config`,
  each value parsed as the field's type."""
  for key, value in (kv.split("=", 1) for kv in settings if kv):
    section, field = key.split(".")
    kind = type(config[section][field])
    # bool("False") is True: booleans are spelled out.
    config[section][field] = (value.lower() in ("1", "true")
                              if kind is bool else kind(value))
  return config


def random_layout(config, num_tokens, rng):
  lengths = rng.integers(1000, 2000, num_tokens // 1500 + 1)
  tokens = rng.integers(4, config.data.vocab_size, lengths.sum()).astype(
      np.int32)
  docs = token_store.TokenDocs(tokens, np.r_[0, np.cumsum(lengths)])
  return routed.make_layout(docs, config.data.seq_len, config.data.prefix_len)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", default="experiments/dipaco_4x4.py")
  p.add_argument("--tokens", type=int, default=1_000_000)
  p.add_argument("--out", default="")
  args = p.parse_args()
  config = load_config(args.config)
  topology = paths_lib.topology_from_config(config)
  dims = layers.dims_from_config(config.model, config.data.vocab_size)
  model = transformer.build_model(dims, topology)
  init = jax.jit(lambda k: model.init(k, jnp.zeros((1, 8), jnp.int32)))
  unbox = lambda t: jax.tree.map(
      lambda x: x.value if hasattr(x, "value") else x, t,
      is_leaf=lambda x: hasattr(x, "value"))
  params = [jax.device_get(unbox(init(jax.random.key(i))["params"]))
            for i in range(topology.num_paths)]
  layout = random_layout(config, args.tokens, np.random.default_rng(0))
  scored = float(layout.windows["weights"].sum())
  batch = config.train.eval_batch_size
  devices = jax.local_devices()

  def timed(group, devs):
    sums = np.zeros(topology.num_paths)
    def on_path(q, nll_MxL):
      sums[q] = nll_MxL.sum()
    run = lambda: sharded.score_paths(model, lambda q: params[q],
                                      topology.num_paths, layout, batch,
                                      on_path, group, devs)
    run()  # Compiles.
    t0 = time.perf_counter()
    run()
    seconds = time.perf_counter() - t0
    return {"devices": len(devs), "group": sharded.auto_group_size(
        topology.num_paths, len(devs), group), "seconds": seconds,
            "path_tokens_per_s": topology.num_paths * scored / seconds,
            "mean_loss": float(sums.sum() / (topology.num_paths * scored))}

  rows = [timed(1, devices[:1]), timed(4, devices[:1])]
  if len(devices) > 1:
    rows.append(timed(0, devices))
  for r in rows:
    r["speedup_vs_one_device_group_1"] = rows[0]["seconds"] / r["seconds"]
    print(r, flush=True)
  timing.report({"device": devices[0].device_kind, "jax": jax.__version__,
                 "num_devices": len(devices), "paths": topology.num_paths,
                 "windows": len(layout.windows["inputs"]),
                 "scored_tokens": scored, "args": vars(args),
                 "results": rows}, args.out)


if __name__ == "__main__":
  main()
