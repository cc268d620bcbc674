r"""Orbax item write/read speed with and without OCDBT, against dd.

  python bench/orbax_formats.py --dir=/tmp/orbax_formats [--mib=2048]

Why the store saves its keys without OCDBT (store/items.py). Prints one
JSON line per format and one for dd (write with fdatasync; read of the file
just written).
"""

import argparse
import json
import shutil
import subprocess
import time

import jax
import numpy as np
import orbax.checkpoint as ocp


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--dir", required=True)
  parser.add_argument("--mib", type=int, default=2048)
  args = parser.parse_args()
  floats = args.mib * 2**20 // 4 // 8
  rng = np.random.default_rng(0)
  tree = {f"leaf_{i}": rng.standard_normal(floats, np.float32)
          for i in range(8)}
  mb = 8 * floats * 4 / 1e6
  restore = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray),
                         tree)
  for use_ocdbt in (True, False):
    path = f"{args.dir}/ocdbt_{use_ocdbt}"
    shutil.rmtree(path, ignore_errors=True)
    ckpt = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=use_ocdbt))
    t0 = time.perf_counter()
    ckpt.save(path, args=ocp.args.PyTreeSave(tree))
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ckpt.restore(path, args=ocp.args.PyTreeRestore(restore_args=restore))
    read_s = time.perf_counter() - t0
    print(json.dumps({"ocdbt": use_ocdbt, "write_MBps": mb / write_s,
                      "read_MBps": mb / read_s}))
    shutil.rmtree(path, ignore_errors=True)
  dd = f"{args.dir}/dd.bin"
  t0 = time.perf_counter()
  subprocess.run(["dd", "if=/dev/zero", f"of={dd}", "bs=1M",
                  f"count={args.mib}", "conv=fdatasync"], check=True,
                 capture_output=True)
  write_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  subprocess.run(["dd", f"if={dd}", "of=/dev/null", "bs=1M"], check=True,
                 capture_output=True)
  print(json.dumps({"dd": True, "write_MBps": mb / write_s,
                    "read_MBps": mb / (time.perf_counter() - t0)}))


if __name__ == "__main__":
  main()
