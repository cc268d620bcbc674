r"""Store write/read throughput against the disk's own (`dd`), one machine.

  python bench/store_throughput.py --dir=/tmp/store_bench [--mib=1024]

Writes a tree of float32 arrays (8 leaves, --mib in all) with
`store.items.save_tree` (orbax item + commit marker), reads it back with
`load_tree`, and times `dd` writing and reading a file of the same size in
the same directory (1 MiB blocks; with conv=fdatasync for the write, since
a commit must be on disk). Both reads come from a file just written, so
both may be served by the page cache: compare them with each other. Prints
one JSON line.
"""

import argparse
import json
import pathlib
import shutil
import subprocess
import time

import jax
import numpy as np

from dipaco_jax.store import items


def _dd(args) -> float:
  t0 = time.perf_counter()
  subprocess.run(["dd", *args], check=True, capture_output=True)
  return time.perf_counter() - t0


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--dir", required=True)
  parser.add_argument("--mib", type=int, default=1024)
  args = parser.parse_args()
  root = pathlib.Path(args.dir)
  shutil.rmtree(root, ignore_errors=True)
  root.mkdir(parents=True)
  leaf_floats = args.mib * 2**20 // 4 // 8
  rng = np.random.default_rng(0)
  tree = {f"leaf_{i}": rng.standard_normal(leaf_floats, np.float32)
          for i in range(8)}
  like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
  size = 8 * leaf_floats * 4
  t0 = time.perf_counter()
  items.save_tree(root / "key", tree)
  write_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  back, _ = items.load_tree(root / "key", like)
  read_s = time.perf_counter() - t0
  assert all(np.array_equal(tree[k], back[k]) for k in tree)
  dd_file = str(root / "dd.bin")
  dd_write_s = _dd(["if=/dev/zero", f"of={dd_file}", "bs=1M",
                    f"count={args.mib}", "conv=fdatasync"])
  dd_read_s = _dd([f"if={dd_file}", "of=/dev/null", "bs=1M"])
  mb = size / 1e6
  out = {"mib": args.mib, "store_write_MBps": mb / write_s,
         "store_read_MBps": mb / read_s, "dd_write_MBps": mb / dd_write_s,
         "dd_read_MBps": mb / dd_read_s}
  out["write_ratio"] = out["store_write_MBps"] / out["dd_write_MBps"]
  out["read_ratio"] = out["store_read_MBps"] / out["dd_read_MBps"]
  print(json.dumps(out))
  shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
  main()
