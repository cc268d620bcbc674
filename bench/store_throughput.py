r"""Store write/read throughput against the disk's own (`dd`), one machine.

  python bench/store_throughput.py --dir=/tmp/store_bench [--mib=1024]

Writes a tree of float32 arrays (8 leaves, --mib in all) with
`store.items.save_tree` (orbax item + commit marker), reads it back with
`load_tree`, and times `dd` writing and reading a file of the same size in
the same directory (1 MiB blocks; with conv=fdatasync for the write, since
a commit must be on disk), --repeats times: the medians after the first
(cold) round are the figures, the first is kept under "first". Both reads
come from a file just written, so both may be served by the page cache:
compare them with each other. `numpy_read_MBps` reads the dd file into a
fresh array (the page faults a store read also pays; dd reuses one
buffer). Prints one JSON line.
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


def _once(root, tree, like, mib: int, i: int) -> dict:
  """One store write and read and one dd write and read, in MB/s."""
  size_mb = sum(x.nbytes for x in tree.values()) / 1e6
  t0 = time.perf_counter()
  items.save_tree(root / f"key{i}", tree)
  write_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  back, _ = items.load_tree(root / f"key{i}", like)
  read_s = time.perf_counter() - t0
  assert all(np.array_equal(tree[k], back[k]) for k in tree)
  dd_file = str(root / f"dd{i}.bin")
  dd_write_s = _dd(["if=/dev/zero", f"of={dd_file}", "bs=1M",
                    f"count={mib}", "conv=fdatasync"])
  dd_read_s = _dd([f"if={dd_file}", "of=/dev/null", "bs=1M"])
  # dd reads through one reused 1 MiB buffer; a reader that keeps the bytes
  # must also fault in fresh memory for them, as numpy does here.
  t0 = time.perf_counter()
  np.fromfile(dd_file, np.uint8)
  numpy_read_s = time.perf_counter() - t0
  return {"store_write_MBps": size_mb / write_s,
          "store_read_MBps": size_mb / read_s,
          "dd_write_MBps": size_mb / dd_write_s,
          "dd_read_MBps": size_mb / dd_read_s,
          "numpy_read_MBps": size_mb / numpy_read_s}


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--dir", required=True)
  parser.add_argument("--mib", type=int, default=1024)
  parser.add_argument("--repeats", type=int, default=4)
  args = parser.parse_args()
  root = pathlib.Path(args.dir)
  shutil.rmtree(root, ignore_errors=True)
  root.mkdir(parents=True)
  leaf_floats = args.mib * 2**20 // 4 // 8
  rng = np.random.default_rng(0)
  # Parameter-like values (float32 of a trained model's scale).
  tree = {f"leaf_{i}": 0.02 * rng.standard_normal(leaf_floats, np.float32)
          for i in range(8)}
  like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
  runs = [_once(root, tree, like, args.mib, i) for i in range(args.repeats)]
  # The first write of a process also starts orbax's and tensorstore's
  # machinery; a run's store writes many keys, so the later ones count.
  steady = {k: float(np.median([r[k] for r in runs[1:] or runs]))
            for k in runs[0]}
  out = {"mib": args.mib, "repeats": args.repeats, "first": runs[0],
         **steady}
  out["write_ratio"] = out["store_write_MBps"] / out["dd_write_MBps"]
  out["read_ratio"] = out["store_read_MBps"] / out["dd_read_MBps"]
  print(json.dumps(out))
  shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
  main()
