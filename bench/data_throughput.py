r"""Tokenization and routing throughput on this machine's cores, in tokens/s
a core, against SentencePiece's own encode rate on the same text.

  python bench/data_throughput.py [--corpus_mb=50] [--out=FILE]

On the embedded corpus (the standard library's source, read as the
quickstart reads it, up to --corpus_mb of text) with the quickstart's
tokenizer size and model:

- floor: SentencePiece's `encode` of every document in this process, one
  thread (the rate a core can tokenize at, whatever the framework does);
- tokenization: `data/corpus_stream.encode_to_stores` as the data stage
  runs it (worker processes, one a core, streamed into a token store on
  disk), its tokens/s divided by the cores;
- routing: what the routing stages do with the tokenized corpus, on all the
  cores: prefix features read from the store (the quickstart's model, mean hidden state over
  the first 32 tokens), product k-means over them (2x2) and each document's
  top-2 paths; the corpus's tokens per second, divided by the cores.

Prints one JSON line; --out also writes it. Tokenizer training is timed
apart (it reads a sample, not the corpus).
"""

import importlib.util
import json
import os
import pathlib
import shutil
import tempfile
import time

from absl import app
from absl import flags
import jax
import numpy as np

from dipaco_jax import paths as paths_lib
from dipaco_jax.data import corpora
from dipaco_jax.data import doc_view
from dipaco_jax.data import corpus_stream
from dipaco_jax.data import tokenizer as tokenizer_lib
from dipaco_jax.model import layers
from dipaco_jax.model import transformer
from dipaco_jax.routing import features as features_lib
from dipaco_jax.routing import router as router_lib
from dipaco_jax.stages import assignment
from dipaco_jax.stages import feature_source
from dipaco_jax.stages import run_configs

_CORPUS_MB = flags.DEFINE_float("corpus_mb", 50.0,
                                "text to tokenize and route, in MB")
_OUT = flags.DEFINE_string("out", "", "also write the JSON line here")


_QUICKSTART = (pathlib.Path(__file__).resolve().parents[1] / "experiments" /
               "quickstart.py")


def _quickstart_config():
  spec = importlib.util.spec_from_file_location("quickstart", _QUICKSTART)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


class _Data:
  """What the feature source needs of the data stage."""

  def __init__(self, vocab_size: int):
    self.vocab_size = vocab_size


def main(argv):
  del argv
  config = _quickstart_config()
  cores = os.cpu_count() or 1
  splits, _ = corpora.read_python_stdlib(config.data.max_doc_chars, 0.0)
  texts, chars = [], 0
  for document in splits["train"]:
    if chars >= _CORPUS_MB.value * 1e6:
      break
    texts.append(document.text)
    chars += len(document.text)

  t0 = time.perf_counter()
  tok = tokenizer_lib.Tokenizer(tokenizer_lib.train_sentencepiece(
      texts, config.data.vocab_size, seed=config.seed,
      max_sentences=config.data.tokenizer_max_sentences))
  train_s = time.perf_counter() - t0

  t0 = time.perf_counter()
  floor_tokens = sum(ids.size for ids in tok.encode_batch(texts,
                                                          num_threads=1))
  floor_s = time.perf_counter() - t0

  # As the data stage runs it: streamed into a token store on disk.
  store_dir = pathlib.Path(tempfile.mkdtemp(prefix="data_throughput_"))
  t0 = time.perf_counter()
  stores = corpus_stream.encode_to_stores(
      tok, (("train", corpora.Document(str(i), text))
            for i, text in enumerate(texts)),
      {"train": store_dir / "train", "validation": store_dir / "validation"})
  docs = doc_view.DocView(stores["train"])
  encode_s = time.perf_counter() - t0

  topology = paths_lib.topology_from_config(config)
  # The base model's features, with its initial parameters (the same
  # work as trained ones).
  base = run_configs.base_config_of(config)
  params = feature_source.FeatureSource.of(
      base, _Data(tok.vocab_size), None, None).init_params
  model = transformer.build_model(
      layers.dims_from_config(base.model, tok.vocab_size),
      paths_lib.topology_from_config(base))
  t0 = time.perf_counter()
  feats = features_lib.prefix_features(
      model, params, docs, config.data.prefix_len, "base_hidden",
      config.train.eval_batch_size)
  features_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  router = router_lib.fit_generative(config.seed, feats,
                                     topology.level_sizes,
                                     config.routing.method,
                                     config.routing.kmeans_iters)
  shards = assignment.path_shards(router, feats, np.arange(len(docs)),
                                  config.routing.train_top_k,
                                  topology.num_paths,
                                  config.routing.min_shard_fraction)
  assign_s = time.perf_counter() - t0
  tokens = docs.num_tokens
  routing_s = features_s + assign_s
  row = {
      "device": jax.devices()[0].device_kind, "cores": cores,
      "documents": len(docs), "chars": chars, "tokens": tokens,
      "tokenizer_training_s": train_s,
      "sentencepiece_floor_tokens_per_s_per_core": floor_tokens / floor_s,
      "tokenization_tokens_per_s_per_core": tokens / encode_s / cores,
      "routing_tokens_per_s_per_core": tokens / routing_s / cores,
      "routing_phases_s": {"features": features_s,
                           "kmeans_and_assignment": assign_s},
      "shard_documents": int(sum(len(s) for s in shards)),
  }
  shutil.rmtree(store_dir)
  line = json.dumps(row)
  print(line)
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      f.write(line + "\n")


if __name__ == "__main__":
  app.run(main)
