r"""Repro: batched LAPACK eigh calls deadlock jaxlib 0.10's CPU thread pool.

  python bench/cpu_lapack_deadlock.py --n=200 --batch=8 --calls=6   # hangs
  python bench/cpu_lapack_deadlock.py --n=200 --batch=8 --calls=6 --one_at_a_time

One jitted function with `--calls` independent eigh calls, each of a batch
of `--batch` symmetric [n, n] matrices, run 20 times. jaxlib 0.10's CPU
LAPACK kernels split a batch over XLA's intra-op pool and wait for the
pieces from inside that pool; on a 2-core machine several at once wait for
each other for ever (jaxlib 0.11.1 compiled that path out of its
open-source builds). `--one_at_a_time` calls the kernel matrix by matrix
(`lax.map`), as `compress_lowrank.eigh_one_at_a_time` does on CPU. Bound
it with `timeout`: a hang never returns.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--n", type=int, default=200)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--calls", type=int, default=6)
  p.add_argument("--one_at_a_time", action="store_true")
  args = p.parse_args()
  eigh = ((lambda g: jax.lax.map(jnp.linalg.eigh, g)) if args.one_at_a_time
          else jnp.linalg.eigh)

  @jax.jit
  def all_calls(xs_BxNxN):
    total = 0.0
    for i, x_BxNxN in enumerate(xs_BxNxN):
      gram_BxNxN = jnp.einsum("bij,bkj->bik", x_BxNxN, x_BxNxN) + i
      w_BxN, v_BxNxN = eigh(gram_BxNxN)
      total = total + w_BxN.sum() + v_BxNxN.sum()
    return total

  rng = np.random.default_rng(0)
  xs = [jnp.asarray(rng.standard_normal((args.batch, args.n, args.n)),
                    jnp.float32) for _ in range(args.calls)]
  start = time.perf_counter()
  for _ in range(20):
    all_calls(xs).block_until_ready()
  print(f"finished: {args.calls} calls of {args.batch} x {args.n} x {args.n},"
        f" 20 times in {time.perf_counter() - start:.1f} s (jaxlib "
        f"{jaxlib.__version__})")


if __name__ == "__main__":
  main()
