"""The paper's config (`experiments/paper_dipaco_16x16_c4.py`) end to end on
CPU, at a tiny width with its real structure: 16x16 = 256 paths, product
k-means routing, top-2 overlapping shards, C4 through TFDS's mock, and the
island runtime training the paths in groups of 64 a task. Only sizes are
changed (width, lengths, steps, batch, vocabulary; levels of 1 + 1 layers
for the 2 layers) and early stopping, which islands refuse."""

import importlib.util
import json
import os

import numpy as np

from dipaco_jax import pipeline
from dipaco_jax.islands import launcher
from dipaco_jax.islands import layout
import test_c4

pytestmark = test_c4.pytestmark  # The data extra (TFDS, seqio).

_CONFIG = os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "experiments", "paper_dipaco_16x16_c4.py")
_NUM_DOCS = {"train": 2000, "validation": 64}
_TINY = {
    "model": {"num_layers": 2, "d_model": 32, "num_heads": 2, "head_dim": 16,
              "mlp_dim": 64},
    "paths": {"layers_per_level": "1,1"},
    "data": {"vocab_size": 512, "seq_len": 64,
             "tokenizer_max_sentences": 20_000, "max_doc_chars": 2000},
    "base": {"num_steps": 4, "batch_size": 8},
    "train": {"batch_size": 8, "num_steps": 2, "log_every": 1,
              "eval_batch_size": 8},
    "diloco": {"inner_steps": 2},  # One round.
    "inner_opt": {"warmup_steps": 1},
    "eval": {"early_stopping": False},  # Refused on islands.
    "ckpt": {"every": 0},
}


def _paper_config():
  spec = importlib.util.spec_from_file_location("paper", _CONFIG)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  for section, fields in _TINY.items():
    for field, value in fields.items():
      config[section][field] = value
  return config


def _texts(split: str, n: int) -> list[str]:
  """Documents of 20-120 words and a random tag (distinct prefixes)."""
  rng = np.random.default_rng(0 if split == "train" else 1)
  letters = list("abcdefghijklmnopqrstuvwxyz")
  return [" ".join(rng.choice(test_c4._WORDS, size=int(rng.integers(20, 120))))  # pylint: disable=protected-access
          + " " + "".join(rng.choice(letters, 6)) for _ in range(n)]


def _as_dataset(self, split, decoders=None, read_config=None, **kwargs):
  del self, decoders, read_config, kwargs
  name = str(split).split("[")[0]
  texts = _texts(name, _NUM_DOCS[name])
  return test_c4.tf.data.Dataset.from_tensor_slices({
      "text": texts, "url": [f"https://example.com/{i}" for i in
                             range(len(texts))],
      "timestamp": ["2019-04-25T12:00:00Z"] * len(texts),
      "content-type": ["text/plain"] * len(texts),
      "content-length": [str(len(t)) for t in texts]})


def test_the_paper_config_trains_its_256_paths_as_island_tasks(tmp_path):
  config = _paper_config()
  workdir = tmp_path / "paper"
  with test_c4.tfds.testing.mock_data(
      policy=test_c4.tfds.testing.MockPolicy.USE_CODE,
      as_dataset_fn=_as_dataset):
    results = pipeline.run(config, str(workdir), islands=(
        launcher.IslandOptions(num_workers=2, paths_per_task=64,
                               fake_devices=4, num_executors=2)))
  assert results["kind"] == "dipaco"
  assert results["data"]["train"]["documents"] == _NUM_DOCS["train"]
  # 256 paths, each one expert of each of the 2 levels of 16.
  paths = results["paths"]
  assert len(paths) == 256
  assert sorted(tuple(p["level_ids"]) for p in paths) == [
      (a, b) for a in range(16) for b in range(16)]
  # Top-2 shards: every training document but the router's in two paths'
  # shards, and the few paths short of documents topped up.
  router = results["router"]
  assert (router["kind"], router["train_top_k"]) == ("product_kmeans", 2)
  placed = sum(p["train_documents"] for p in paths)
  routed = 2 * (_NUM_DOCS["train"] - router["router_documents"])
  assert routed <= placed <= routed + 256 * 4, (placed, routed)
  # The island runtime: 256 / 64 = 4 tasks in the round, both workers' own.
  done = layout.read_json(workdir / "islands" / "dipaco" / "DONE.json")
  assert done["rounds"] == 1 and sum(done["tasks_done"].values()) == 4
  assert set(done["tasks_done"]) == {"w0", "w1"}, done
  # Scored: routed once (one path a document) and the dense baseline, on
  # every validation token, as results.json has them.
  models = json.loads((workdir / "results.json").read_text())["models"]
  for name in ("dipaco routed once per document",
               "dense baseline (one path's size)"):
    assert np.isfinite(models[name]["perplexity"]), models[name]
    assert models[name]["tokens"] == models[
        "dipaco routed once per document"]["tokens"] > 0
