"""The main job's stages, each cached in the workdir.

  data      corpus -> tokenizer -> token documents   ({workdir}/data)
  shards    documents per worker + manifest          ({workdir}/shards/NAME)
  train     SPMD training, checkpoints, metrics      ({workdir}/runs/NAME)
  eval      validation loss / perplexity             ({workdir}/results.json)
  report    table on stdout, plots                   ({workdir}/plots)

A finished stage is reused when the workdir is run again; an interrupted
training run resumes from its latest checkpoint.
"""

import json
import time

from absl import logging
from etils import epath
import jax
import numpy as np

from dipaco_jax import config_base
from dipaco_jax import paths as paths_lib
from dipaco_jax import report as report_lib
from dipaco_jax.data import batches as batches_lib
from dipaco_jax.data import prepare
from dipaco_jax.data import shards as shards_lib
from dipaco_jax.eval import perplexity
from dipaco_jax.model import layers
from dipaco_jax.parallel import mesh as mesh_lib
from dipaco_jax.train import checkpoint as ckpt_lib
from dipaco_jax.train import loop
from dipaco_jax.train import state as state_lib


def training_hash(config) -> str:
  """Hash of what determines the training numbers (not logging/ckpt)."""
  keep = config.to_dict()
  keep.pop("ckpt", None)
  keep["train"] = {k: v for k, v in keep["train"].items()
                   if k not in ("log_every", "eval_batch_size")}
  keep["data"] = {k: v for k, v in keep["data"].items() if k != "prefetch"}
  import hashlib  # pylint: disable=g-import-not-at-top
  return hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()
                        ).hexdigest()[:16]


def iid_shards(num_docs: int, num_shards: int, seed: int) -> list:
  """Documents dealt round-robin after a seeded shuffle (DiLoCo i.i.d.)."""
  order = np.random.default_rng([seed, 7]).permutation(num_docs)
  return [np.sort(order[w::num_shards]) for w in range(num_shards)]


def make_shards(workdir, name, docs, doc_indices_per_shard, hashes):
  """Writes (or reuses) a shard set; returns its directory and manifest."""
  directory = epath.Path(workdir) / "shards" / name
  manifest = shards_lib.read_manifest(str(directory))
  if manifest is not None and manifest["hashes"] == hashes:
    return directory, manifest
  manifest = shards_lib.write_shards(str(directory), docs,
                                     doc_indices_per_shard, hashes)
  return directory, manifest


class Experiment:
  """A training run of one topology on one shard set."""

  def __init__(self, config, data: prepare.DataBundle, workdir: str,
               name: str, shard_dir, manifest: dict):
    self.config, self.data, self.name = config, data, name
    self.run_dir = epath.Path(workdir) / "runs" / name
    self.topology = paths_lib.topology_from_config(config)
    self.shard_dir, self.manifest = shard_dir, manifest
    if manifest["num_shards"] != self.topology.num_workers:
      raise ValueError(f"{name}: {manifest['num_shards']} shards for "
                       f"{self.topology.num_workers} workers.")
    weights_W = np.array([s["num_tokens"] for s in manifest["shards"]],
                         np.float64)
    self.dims = layers.dims_from_config(config.model, data.vocab_size)
    self.mesh = mesh_lib.make_mesh(config)
    self.runtime = state_lib.Runtime(config, self.topology, self.dims,
                                     self.mesh, weights_W)
    self.hashes = {"config": training_hash(config), **data.hashes,
                   **{f"shards_{k}": v for k, v in manifest["hashes"].items()
                      if k not in data.hashes}}

  def batches(self):
    rows = [batches_lib.pack_rows(
        shards_lib.load_shard(str(self.shard_dir), w),
        self.config.data.seq_len) for w in range(self.topology.num_workers)]
    return batches_lib.StackedBatches(rows, self.config.seed,
                                      self.config.train.batch_size)

  def train(self, init_bank=None) -> loop.TrainResult:
    print(f"[{self.name}] {self.topology.describe()}\n[{self.name}] mesh "
          f"{mesh_lib.describe(self.mesh)}", flush=True)
    return loop.train(self.runtime, self.batches(), str(self.run_dir),
                      self.hashes, self.name, init_bank=init_bank)

  def eval_bank(self, state):
    """The modules to evaluate: the outer bank, or, when workers never
    synchronize (dense, H = 0), the single worker's parameters."""
    if self.config.diloco.inner_steps:
      return state["outer_params"]
    return state["inner_params"]

  def evaluate(self, bank, docs, path: int = 0) -> dict:
    """Loss/perplexity of one path over all documents of `docs`."""
    windows = batches_lib.eval_windows(docs, self.config.data.seq_len,
                                       self.config.data.prefix_len)
    params = jax.device_get(self.runtime.path_params(bank, path))
    nll, count = perplexity.window_nll(self.runtime.model, params, windows,
                                       self.config.train.eval_batch_size)
    return perplexity.summarize(nll.sum(), count.sum())


def run_dense(config, workdir: str) -> dict:
  """The foundation job: data -> shards -> train -> eval -> report."""
  t0 = time.time()
  workdir = epath.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  (workdir / "config.json").write_text(config.to_json_best_effort(indent=1))
  data = prepare.prepare_data(config.data, str(workdir), config.seed)
  topology = paths_lib.topology_from_config(config)
  train_docs = data.docs["train"]
  shard_dir, manifest = make_shards(
      workdir, "main", train_docs,
      iid_shards(len(train_docs), topology.num_workers, config.seed),
      {**data.hashes, "router": "iid"})
  exp = Experiment(config, data, str(workdir), "main", shard_dir, manifest)
  result = exp.train()
  metrics = exp.evaluate(exp.eval_bank(result.state),
                         data.docs["validation"])
  results = {
      "validation": metrics,
      "train": {"steps": result.steps,
                "tokens_per_s": result.tokens_per_s,
                "final_loss": float(np.mean(result.final_losses_W))
                if result.final_losses_W.size else None,
                "workers": topology.num_workers},
      "data": {s: {"documents": len(d), "tokens": d.num_tokens}
               for s, d in data.docs.items()},
      "wall_seconds": time.time() - t0,
  }
  (workdir / "results.json").write_text(json.dumps(results, indent=1))
  report_lib.plot_losses(workdir, ["main"])
  print(report_lib.dense_table(results), flush=True)
  logging.info("Wrote %s", workdir / "results.json")
  return results


def check_config(config) -> None:
  config_base.validate(config, jax.device_count())


def run(config, workdir: str) -> dict:
  """The main job for any config."""
  return run_dense(config, workdir)
