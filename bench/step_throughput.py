r"""Inner-step throughput and MFU of the SPMD runtime on the current device.

  python bench/step_throughput.py --paths=1,4 --batch=16 --out=/tmp/tp.json

Defaults are the DiPaCo paper's path shape (12 layers, d_model 896, 16 heads
of 64, MLP 3584, vocab 32000, sequence 1024). For each P in --paths it times
the framework's jitted inner step (P workers vmapped, sharded, donated) on
random tokens already on the device, and, for P = 1, a plain Flax/optax step
of the same model (jit of value_and_grad + AdamW, nothing else) as the
reference the framework must not be slower than.

MFU = tokens/s x FLOPs/token / peak, with FLOPs/token = 6 x (parameters
other than the input embedding table) + 12 x layers x d_model x sequence,
and peak = 989 TFLOP/s (H100/H200 dense bf16 datasheet), also with --fp8
(so that its MFU compares with bf16's; FP8's own peak is twice that).

--loss_chunk and --fp8 set config.model.loss_chunk and config.model.fp8 for
the framework's step; the plain reference step stays the bf16 step with
the whole [B, L, V] logits.
"""

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dipaco_jax import config_base
from dipaco_jax import testing
from dipaco_jax.diloco import inner as inner_lib
from dipaco_jax.model import transformer
from dipaco_jax.train import state as state_lib
import timing  # bench/timing.py (the script's folder is on sys.path)

PEAK_FLOPS = 989e12


def make_config(args, num_paths):
  c = config_base.base_config()
  c.model.num_layers = args.layers
  c.model.d_model = args.d_model
  c.model.num_heads = args.heads
  c.model.head_dim = args.head_dim
  c.model.mlp_dim = args.mlp
  c.model.remat = args.remat
  c.model.attention = args.attention
  c.model.scan_layers = bool(args.scan)
  c.model.scan_unroll = args.unroll
  c.model.loss_chunk = args.loss_chunk
  c.model.fp8 = args.fp8
  c.model.tie_embeddings = bool(args.tie)
  c.data.seq_len = args.seq
  c.paths.shape = "1"
  c.paths.num_replicas = num_paths
  c.diloco.inner_steps = 1_000_000 if num_paths > 1 else 0
  c.train.num_steps = 1_000_000
  c.train.batch_size = args.batch
  c.inner_opt.learning_rate = 1e-4
  return c


def flops_per_token(runtime, seq):
  boxed = runtime.boxed_path_params()
  params = sum(int(np.prod(x.value.shape if hasattr(x, "value") else x.shape))
               for x in jax.tree.leaves(
                   boxed, is_leaf=lambda x: hasattr(x, "value")))
  d = runtime.dims
  embedding = d.padded_vocab * d.d_model
  # A tied table is also the head, whose matmul does count.
  head = embedding if d.tie_embeddings else 0
  return 6 * (params - embedding + head) + (
      12 * d.num_layers * d.d_model * seq), params


def bench_framework(args, num_paths):
  config = make_config(args, num_paths)
  runtime = testing.tiny_runtime(config, vocab_size=args.vocab)
  holder = {"state": runtime.init_state(jax.random.key(0))}
  rng = np.random.default_rng(0)
  batch = runtime.worker_rows(rng.integers(
      0, args.vocab, (num_paths, args.batch, args.seq + 1)).astype(np.int32))

  def step():
    holder["state"], metrics = runtime.inner_step(holder["state"], batch)
    return metrics["loss"]

  compiled = runtime.inner_step.jitted.lower(holder["state"], batch).compile()
  memory = compiled.memory_analysis()
  fpt, params = flops_per_token(runtime, args.seq)
  out = {"kind": "framework", "paths": num_paths, "batch_per_path":
         args.batch, "params_per_path": params, "flops_per_token": fpt}
  if memory is not None:
    # What the step's program holds on the device: its inputs (the state,
    # donated, and the batch) and XLA's temporaries.
    out.update({name: int(getattr(memory, f"{name}_size_in_bytes", 0))
                for name in ("argument", "output", "alias", "temp")})
    out["program_bytes"] = out["argument"] + out["temp"] + (
        out["output"] - out["alias"])
  # Before the timing, which a program larger than the device cannot run.
  print(json.dumps({"compiled": out}), flush=True)
  if args.memory_only:
    return out, runtime
  seconds = timing.seconds_per_call(step, args.steps, args.warmup)
  tokens = num_paths * args.batch * args.seq
  stats = jax.local_devices()[0].memory_stats() or {}
  out.update({"seconds_per_step": seconds, "tokens_per_s": tokens / seconds,
              "mfu": tokens / seconds * fpt / PEAK_FLOPS,
              "peak_bytes_in_use": stats.get("peak_bytes_in_use")})
  return out, runtime


def bench_plain(args, runtime):
  """The reference: a plain jitted Flax/optax step of the same model."""
  model = transformer.build_model(dataclasses.replace(runtime.dims, fp8=False),
                                  runtime.topology)
  params = jax.jit(lambda k: jax.tree.map(
      lambda x: x.value if hasattr(x, "value") else x,
      model.init(k, jnp.zeros((1, 8), jnp.int32))["params"],
      is_leaf=lambda x: hasattr(x, "value")))(jax.random.key(0))
  tx = inner_lib.inner_optimizer(runtime.config.inner_opt, 1_000_000)
  opt_state = tx.init(params)

  @jax.jit
  def plain_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(
        lambda p: state_lib.next_token_loss(model, p, batch))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  batch = jnp.asarray(np.random.default_rng(0).integers(
      0, args.vocab, (args.batch, args.seq + 1)), jnp.int32)
  holder = {"p": params, "o": opt_state}

  def step():
    holder["p"], holder["o"], loss = plain_step(holder["p"], holder["o"],
                                                batch)
    return loss

  seconds = timing.seconds_per_call(step, args.steps, args.warmup)
  fpt, _ = flops_per_token(runtime, args.seq)
  tokens = args.batch * args.seq
  return {"kind": "plain", "paths": 1, "batch_per_path": args.batch,
          "seconds_per_step": seconds, "tokens_per_s": tokens / seconds,
          "mfu": tokens / seconds * fpt / PEAK_FLOPS}


def add_shape_flags(p: argparse.ArgumentParser) -> None:
  """The model and batch flags that `make_config` reads (also used by
  bench/step_profile.py)."""
  p.add_argument("--batch", type=int, default=16)
  add_model_flags(p)


def add_model_flags(p: argparse.ArgumentParser) -> None:
  """The model's shape, the paper's path by default (also used by
  bench/decode_throughput.py)."""
  p.add_argument("--layers", type=int, default=12)
  p.add_argument("--d_model", type=int, default=896)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--head_dim", type=int, default=64)
  p.add_argument("--mlp", type=int, default=3584)
  p.add_argument("--vocab", type=int, default=32000)
  p.add_argument("--tie", type=int, default=0,
                 help="config.model.tie_embeddings (the paper's config: 1)")
  p.add_argument("--seq", type=int, default=1024)
  p.add_argument("--remat", default="none")
  p.add_argument("--attention", default="auto")
  p.add_argument("--scan", type=int, default=1, help="scan over layers")
  p.add_argument("--unroll", type=int, default=0, help="0: full unroll")
  p.add_argument("--loss_chunk", type=int, default=0,
                 help="config.model.loss_chunk (0: whole logits)")
  p.add_argument("--fp8", action="store_true", help="config.model.fp8")


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--paths", default="1,4")
  add_shape_flags(p)
  p.add_argument("--no_plain", action="store_true")
  p.add_argument("--memory_only", action="store_true",
                 help="compile and report the program's memory, no timing")
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--out", default="")
  args = p.parse_args()
  device = jax.devices()[0].device_kind
  results = []
  for num_paths in [int(x) for x in args.paths.split(",")]:
    row, runtime = bench_framework(args, num_paths)
    results.append(row)
    print(json.dumps(row), flush=True)
    if num_paths == 1 and not args.no_plain:
      row = bench_plain(args, runtime)
      results.append(row)
      print(json.dumps(row), flush=True)
    del runtime
  single = [r for r in results if r["kind"] == "framework" and
            r["paths"] == 1]
  for r in results:
    if single and r["kind"] == "framework" and r["paths"] > 1:
      # P paths take P x the work of one: on one device, perfect scaling is
      # a step P times as long, i.e. the same tokens/s as a single path.
      r["vmap_efficiency"] = r["tokens_per_s"] / single[0]["tokens_per_s"]
      r["step_time_over_P_x_single"] = r["seconds_per_step"] / (
          r["paths"] * single[0]["seconds_per_step"])
  summary = {"device": device, "jax": jax.__version__, "args": vars(args),
             "results": results}
  timing.report(summary, args.out)


if __name__ == "__main__":
  main()
