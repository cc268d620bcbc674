r"""The GPUs' all-reduce bandwidth as XLA lowers a data-parallel gradient sum.

  python bench/allreduce_bw.py --devices=2,4 --mib=16,128,512 [--out=F.json]

For each device count n and size S, an [n, S] float32 (and bfloat16) array
sharded one row per device is summed over its rows into a replicated
array, the collective a data-parallel step runs on its gradients (how
much of the dense config's 2-GPU step its 128 MiB gradient sum can
explain; docs/performance.md has the answer). Reports the time per sum
and the bus bandwidth in NCCL's convention, busbw = S / t x 2 (n - 1) / n,
which is comparable across n and with the link's datasheet figure.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import timing


def one_sum(n: int, mib: int, dtype) -> dict:
  devices = jax.devices()[:n]
  mesh = Mesh(np.array(devices), ("data",))
  per_device = mib * 2**20 // jnp.dtype(dtype).itemsize
  rows = NamedSharding(mesh, PartitionSpec("data"))
  replicated = NamedSharding(mesh, PartitionSpec())
  x_NxS = jax.device_put(jnp.ones((n, per_device), dtype), rows)
  total = jax.jit(lambda x: x.sum(0), out_shardings=replicated)
  seconds = timing.seconds_per_call(lambda: total(x_NxS), steps=20, warmup=2)
  size_bytes = per_device * jnp.dtype(dtype).itemsize
  return {"devices": n, "MiB": mib, "dtype": jnp.dtype(dtype).name,
          "ms": seconds * 1e3,
          "busbw_GBps": size_bytes / seconds * 2 * (n - 1) / n / 1e9}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", default="2,4")
  parser.add_argument("--mib", default="16,128,512")
  parser.add_argument("--out", default="")
  args = parser.parse_args()
  rows = []
  for n in (int(d) for d in args.devices.split(",")):
    if n > jax.device_count():
      print(f"skipping {n} devices: only {jax.device_count()} here")
      continue
    for mib in (int(m) for m in args.mib.split(",")):
      for dtype in (jnp.float32, jnp.bfloat16):
        rows.append(one_sum(n, mib, dtype))
        print(rows[-1], flush=True)
  timing.report({"device": jax.devices()[0].device_kind, "sums": rows},
                args.out)


if __name__ == "__main__":
  main()
