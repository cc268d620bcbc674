r"""Decoding tokens/s of one path against the memory-bandwidth bound.

  python bench/decode_throughput.py --batch=1,64 --out=/tmp/decode.json

The model is the DiPaCo paper's path shape (12 layers, d_model 896, 16
heads of 64, MLP 3584, vocab 32000), random weights. For each batch B it
prefills a `--prompt`-token prompt per row, then times `--new` decoding
steps two ways:

  device loop   `inference.decoding.step` + `sample` chained on the device,
                the next token never leaving it: the compiled step's speed.
  generate      `inference.generation.generate`, what the CLI runs: the
                same step plus a host round trip per token (sampled ids
                come back to append to each row's text and check stops).

The bound. Decoding one token per row reads, once per step, every weight
the step uses and the whole key/value cache (the cache is attended over all
of its S = prompt + new positions, masked, so the read does not shrink
with the position):

  bytes/step = weights as stored and read (float32 parameters: 4 bytes each;
               the embedding table counts only its B gathered rows, the
               head all of it)
             + 2 (k, v) x layers x B x S x heads x head_dim x 2 (bfloat16)

  bound tokens/s = B x HBM bandwidth / bytes per step

with the HBM bandwidth from the datasheet of the device (H100 SXM 3.35
TB/s, H200 4.8 TB/s). The weights are read as float32 and cast in the
step: a bfloat16 copy of them would halve that term (`--bf16_weights`
measures it; the numerics then differ from the float32-master forward by
bf16 rounding of the norm scales).
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from dipaco_jax import config_base
from dipaco_jax import paths as paths_lib
from dipaco_jax.inference import decoding
from dipaco_jax.inference import generation
from dipaco_jax.model import kv_cache
from dipaco_jax.model import layers
from dipaco_jax.model import transformer
import step_throughput  # bench/: the model shape flags
import timing  # bench/timing.py

HBM_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12}


def hbm_bandwidth(device_kind: str) -> float:
  for name, bw in HBM_BYTES_PER_S.items():
    if name in device_kind:
      return bw
  return float("nan")


def build(args):
  c = config_base.base_config()
  c.model.num_layers, c.model.d_model = args.layers, args.d_model
  c.model.num_heads, c.model.head_dim = args.heads, args.head_dim
  c.model.mlp_dim, c.data.vocab_size = args.mlp, args.vocab
  c.paths.shape = "1"
  dims = layers.dims_from_config(c.model, args.vocab)
  model = transformer.build_model(dims, paths_lib.topology_from_config(c))
  boxed = jax.jit(lambda k: model.init(k, jnp.zeros((1, 8), jnp.int32)))(
      jax.random.key(0))["params"]
  params = jax.tree.map(lambda x: x.value if hasattr(x, "value") else x,
                        boxed, is_leaf=lambda x: hasattr(x, "value"))
  if args.bf16_weights:
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  return model, params


def bytes_per_step(model, params, batch: int, cache_len: int) -> dict:
  d = model.dims
  leaves = jax.tree_util.tree_leaves_with_path(params)
  weights = 0
  for path, x in leaves:
    name = jax.tree_util.keystr(path)
    if "embedding" in name and not d.tie_embeddings:
      weights += batch * x.shape[-1] * x.dtype.itemsize  # gathered rows
    else:
      weights += x.size * x.dtype.itemsize
  num_layers = sum(n for _, n in model.segments)
  cache = 2 * num_layers * batch * cache_len * d.num_heads * d.head_dim * (
      jnp.dtype(d.compute_dtype).itemsize)
  return {"weights": int(weights), "cache": int(cache),
          "total": int(weights + cache)}


def device_loop(model, params, batch, prompt, new, steps_timed):
  """Tokens/s of step + greedy sample chained on the device."""
  size = prompt + new
  rng = np.random.default_rng(0)
  tokens_BxS = np.zeros((batch, size), np.int32)
  tokens_BxS[:, :prompt] = rng.integers(4, model.dims.vocab_size,
                                        (batch, prompt))
  lengths_B = np.full(batch, prompt, np.int32)
  all_B = np.ones(batch, bool)
  caches = kv_cache.init(model.dims, model.segments, batch, size)
  logits, caches = decoding.prefill(model, params, caches, tokens_BxS,
                                    lengths_B, all_B)
  key = jax.random.key(0)
  zero, one = jnp.float32(0.0), jnp.float32(1.0)
  token_B = decoding.sample(logits, key, zero, one)
  state = {"caches": caches, "token": token_B, "i": 0}

  def one_step():
    pos = jnp.full((batch,), prompt + state["i"] % (new - 1), jnp.int32)
    logits, state["caches"] = decoding.step(
        model, params, state["caches"], state["token"], pos, all_B)
    state["token"] = decoding.sample(logits, key, zero, one)
    state["i"] += 1
    return state["token"]

  seconds = timing.seconds_per_call(one_step, steps_timed, warmup=3)
  return batch / seconds, seconds


def end_to_end(model, params, batch, prompt, new):
  rng = np.random.default_rng(1)
  prompts = [np.r_[1, rng.integers(4, model.dims.vocab_size, prompt - 1)]
             .astype(np.int32) for _ in range(batch)]
  sampling = generation.Sampling(max_new_tokens=new, temperature=0.0,
                                 top_p=1.0, seed=0, stop_ids=())
  run = lambda: generation.generate(model, [params], prompts,
                                    np.zeros(batch, np.int32), sampling)
  run()  # Compiles prefill, step and sample for these shapes.
  t0 = time.perf_counter()
  out = run()
  seconds = time.perf_counter() - t0
  made = sum(len(c.tokens) for c in out)
  return made / seconds, seconds


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--batch", default="1,64")
  p.add_argument("--prompt", type=int, default=128)
  p.add_argument("--new", type=int, default=256)
  p.add_argument("--steps", type=int, default=100)
  step_throughput.add_model_flags(p)  # --layers, --d_model, ... (--seq unused)
  p.add_argument("--bf16_weights", action="store_true")
  p.add_argument("--no_generate", action="store_true")
  p.add_argument("--out", default="")
  args = p.parse_args()
  kind = jax.devices()[0].device_kind
  bw = hbm_bandwidth(kind)
  model, params = build(args)
  rows = []
  for batch in [int(b) for b in args.batch.split(",")]:
    need = bytes_per_step(model, params, batch, args.prompt + args.new)
    bound = batch * bw / need["total"]
    tps, seconds = device_loop(model, params, batch, args.prompt, args.new,
                               args.steps)
    row = {"batch": batch, "device_loop_tokens_per_s": tps,
           "seconds_per_step": seconds, "bytes_per_step": need,
           "bound_tokens_per_s": bound, "share_of_bound": tps / bound}
    if not args.no_generate:
      row["generate_tokens_per_s"], row["generate_seconds"] = end_to_end(
          model, params, batch, args.prompt, args.new)
    rows.append(row)
    print(json.dumps(row), flush=True)
  timing.report({"device": kind, "jax": jax.__version__,
                 "hbm_bytes_per_s": bw, "args": vars(args), "results": rows},
                args.out)


if __name__ == "__main__":
  main()
