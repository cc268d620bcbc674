r"""Time of the low-rank codec's encode, Gram-Schmidt against LAPACK/cuSOLVER QR.

  python bench/lowrank_encode_cost.py --ranks=2,8,20 [--out=F.json]

The codec orthonormalizes with classical Gram-Schmidt applied twice
(`compress_lowrank.orthonormalize`) since batched LAPACK QR deadlocked runs
on a 2-core CPU (jaxlib 0.10.2). This times one outer step's encode
of every worker's contribution (vmapped over --workers) on the matrices of
experiments/diloco.py's model (the 8192 x 256 embedding, and per layer
four 256 x 256 attention projections and the 256 x 1024 and 1024 x 256
MLP matrices), once with the codec as it is and once with
`jnp.linalg.qr` put back in its place, in one process on one device.
"""

import argparse

import jax
import jax.numpy as jnp

from dipaco_jax.diloco import compress_lowrank
import timing  # bench/timing.py (the script's folder is on sys.path)

_LAYERS = 4
_SHAPES = ([(8192, 256)]
           + [(256, 256)] * 4 * _LAYERS
           + [(256, 1024), (1024, 256)] * _LAYERS)


def _householder(a_MxR):
  return jnp.linalg.qr(a_MxR)[0]


def encode_seconds(rank: int, workers: int, steps: int) -> float:
  keys = jax.random.split(jax.random.key(0), len(_SHAPES))
  xs = [jax.random.normal(k, (workers,) + s) for k, s in zip(keys, _SHAPES)]
  states = [jax.vmap(lambda x: compress_lowrank.init_state(x.shape, rank))(x)
            for x in xs]
  def encode_all(xs, states):
    return [jax.vmap(lambda x, s: compress_lowrank.encode(x, s, 1, 1.0))(x, s)
            for x, s in zip(xs, states)]
  fn = jax.jit(encode_all)
  return timing.seconds_per_call(lambda: fn(xs, states), steps, warmup=2)


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--ranks", default="2,8,20")
  p.add_argument("--workers", type=int, default=8)
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--out", default="")
  args = p.parse_args()
  gram_schmidt = compress_lowrank.orthonormalize
  rows = []
  for rank in (int(r) for r in args.ranks.split(",")):
    row = {"rank": rank, "workers": args.workers}
    for name, orth in (("gram_schmidt_ms", gram_schmidt),
                       ("qr_ms", _householder)):
      compress_lowrank.orthonormalize = orth  # power_step looks it up here
      row[name] = encode_seconds(rank, args.workers, args.steps) * 1e3
    compress_lowrank.orthonormalize = gram_schmidt
    rows.append(row)
    print(row, flush=True)
  timing.report({"device": jax.devices()[0].device_kind, "encode": rows},
                args.out)


if __name__ == "__main__":
  main()
