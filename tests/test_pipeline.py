"""The main job end to end on tiny configs, through the CLI."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from dipaco_jax.data import corpora
from dipaco_jax.data import shards as shards_lib
from dipaco_jax.data import token_store
from dipaco_jax.model import layers
from dipaco_jax.model import transformer
from dipaco_jax import paths as paths_lib
from dipaco_jax.routing import features
from dipaco_jax.stages import assignment

TINY_FLAGS = [
    "--config.data.max_corpus_chars=1000000",
    "--config.data.vocab_size=512",
    "--config.data.seq_len=64",
    "--config.data.validation_fraction=0.2",
    "--config.model.num_layers=2",
    "--config.model.d_model=32",
    "--config.model.num_heads=2",
    "--config.model.head_dim=16",
    "--config.model.mlp_dim=64",
    "--config.train.batch_size=8",
    "--config.train.log_every=2",
    "--config.ckpt.every=4",
]


def _main(workdir, *flags, fake_devices=0, env=None):
  cmd = [sys.executable, "-m", "dipaco_jax.main",
         "--config=experiments/quickstart.py", f"--workdir={workdir}",
         *TINY_FLAGS, *flags]
  if fake_devices:
    cmd.append(f"--fake_devices={fake_devices}")
  return subprocess.run(
      cmd, capture_output=True, text=True, check=False,
      cwd=os.path.dirname(os.path.dirname(__file__)),
      env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})})


def test_dipaco_main_job_end_to_end_and_stage_reuse(tmp_path):
  flags = ["--config.base.num_steps=4", "--config.train.num_steps=8",
           "--config.diloco.inner_steps=4", "--config.eval.early_stopping=True",
           "--config.routing.discriminative_steps=4",
           "--config.routing.router_fraction=0.2",
           "--config.eval.reroute_every=16",
           "--config.eval.learned_reroute=True"]
  run = _main(tmp_path, *flags, fake_devices=8)
  assert run.returncode == 0, run.stderr[-3000:]
  assert "dense baseline" in run.stdout
  assert "re-routed every 16 tokens (the previous chunk)" in run.stdout
  assert "re-routed every 16 tokens (all tokens so far)" in run.stdout
  assert "re-routed every 16 tokens (learned window router" in run.stdout
  assert "mesh path=4 x stage=1 x data=2" in run.stdout  # 4 paths on 8 fake devices
  # The table says in words what it compares, with the run's own figures.
  assert "How to read it" in run.stdout
  assert "DiPaCo routed once runs ONE of its 4 paths per document" in (
      run.stdout)
  results = json.loads((tmp_path / "results.json").read_text())
  models = results["models"]
  scored = {m["tokens"] for m in models.values()}
  assert len(scored) == 1 and scored.pop() > 0  # all on the same tokens
  for m in models.values():
    assert np.isfinite(m["perplexity"])
  oracle = models["dipaco best path per document (oracle)"]["loss"]
  assert oracle <= models["dipaco routed once per document"]["loss"] + 1e-9
  assert results["router"]["kind"] == "linear"  # discriminative phase ran
  window = results["router"]["window_router"]
  assert window["chunks"] > 0 and window["every"] == 16
  assert list((tmp_path / "router").glob("window_*.npz"))
  assert len(results["paths"]) == 4
  assert sum(p["validation_documents"] for p in results["paths"]) == (
      results["data"]["validation"]["documents"])
  routed_tokens = sum(p["validation_dense"]["tokens"]
                      for p in results["paths"])
  assert routed_tokens == models["dense baseline (one path's size)"]["tokens"]
  assert all(p["early_stopping_step"] in (4, 8) for p in results["paths"])
  assert results["communication"]["bytes_outer_sync"] > 0
  assert (tmp_path / "plots" / "loss.png").exists()
  assert (tmp_path / "plots" / "paths.png").exists()
  metrics = (tmp_path / "runs" / "dipaco" / "logs" / "train" /
             "metrics.jsonl").read_text().splitlines()
  assert json.loads(metrics[-1])["step"] == 8
  _check_held_out_documents_are_never_trained_on(tmp_path)

  # Again, with the validation split scored in blocks of about 500 tokens
  # (one block above): the stages are reused, and every figure is the same
  # sum of the same per-token numbers.
  blocks = max(results["data"]["validation"]["tokens"] // 500, 1)
  again = _main(tmp_path, *flags, "--config.eval.block_tokens=500",
                fake_devices=8)
  assert again.returncode == 0, again.stderr[-3000:]
  assert "[data] reusing" in again.stdout
  assert again.stdout.count("[router] reusing") == 3  # k-means, linear, window
  assert "[dipaco] already trained 8 steps" in again.stdout
  assert "(reused)" in again.stdout
  assert blocks > 4
  in_blocks = json.loads((tmp_path / "results.json").read_text())["models"]
  assert in_blocks.keys() == models.keys()
  for name, model in models.items():
    assert in_blocks[name]["tokens"] == model["tokens"], name
    np.testing.assert_allclose(in_blocks[name]["loss"], model["loss"],
                               rtol=1e-6, err_msg=name)


def _trained_documents(workdir) -> set:
  """Every document of every shard set that a run trained on."""
  trained = set()
  for manifest in (workdir / "shards").glob("*/manifest.json"):
    for w in range(json.loads(manifest.read_text())["num_shards"]):
      _, ids = shards_lib.load_shard_with_indices(str(manifest.parent), w)
      trained |= set(ids.tolist())
  return trained


def _check_held_out_documents_are_never_trained_on(workdir):
  """Early-stopping documents are in no shard of either phase (nor the base
  or dense shards), and router and early-stopping documents share no file
  with any training document."""
  split = json.loads((workdir / "splits.json").read_text())
  holdout, router = set(split["holdout_ids"]), set(split["router_ids"])
  assert holdout and router
  trained = _trained_documents(workdir)
  assert not holdout & trained
  assert not router & trained
  for phase in ("dipaco", "dipaco_discriminative"):
    record = json.loads((workdir / "shards" / phase / "holdout.json")
                        .read_text())
    assert set(record["documents"]) == holdout
    per_path = [set(ids) for ids in record["per_path"]]
    assert len(per_path) == 4 and all(per_path)
    assert set().union(*per_path) <= holdout
  units_N = token_store.load_npz(workdir / "data" / "units.npz",
                                 ("train",))["train"]
  trained_files = set(units_N[sorted(trained)].tolist())
  assert not set(units_N[sorted(holdout)].tolist()) & trained_files
  assert not set(units_N[sorted(router)].tolist()) & trained_files


def test_documents_are_split_by_file_before_any_assignment():
  # Files 0..9 with 1..10 chunks each: a file's chunks go to one set.
  units_N = np.repeat(np.arange(10), np.arange(1, 11))
  split = assignment.split_documents(units_N, 0.2, 0.1, seed=3)
  sets = [split.train_ids, split.router_ids, split.holdout_ids]
  assert sum(len(s) for s in sets) == len(units_N)
  files = [set(units_N[s].tolist()) for s in sets]
  assert not files[0] & files[1] and not files[0] & files[2]
  assert not files[1] & files[2]
  assert all(len(s) for s in sets)
  # The shares are met up to one file's documents.
  assert 0.2 * 55 <= len(split.router_ids) <= 0.2 * 55 + 10
  again = assignment.split_documents(units_N, 0.2, 0.1, seed=3)
  np.testing.assert_array_equal(again.holdout_ids, split.holdout_ids)
  # One file of 400 chunks among small ones: passed over, not a holdout
  # of 400 documents.
  units_N = np.repeat(np.arange(41), [400] + [5] * 40)
  split = assignment.split_documents(units_N, 0.05, 0.05, seed=0)
  assert 30 <= len(split.router_ids) <= 60
  assert 30 <= len(split.holdout_ids) <= 60


def test_unit_of_a_document_is_its_file_or_jsonl_line():
  assert corpora.unit_of("pkg/mod.py#3") == "pkg/mod.py"
  assert corpora.unit_of("data.jsonl:17") == "data.jsonl:17"
  assert corpora.unit_of("data.jsonl:17#2") == "data.jsonl:17"
  assert corpora.unit_of("odd#name.txt#0") == "odd#name.txt"
  np.testing.assert_array_equal(
      corpora.unit_ids(["a#0", "b#0", "a#1", "c", "b#1"]), [0, 1, 0, 2, 1])


def test_bad_config_fails_before_compute_naming_the_field(tmp_path):
  run = _main(tmp_path, "--config.paths.shape=2x2x2x2x2",
              "--config.model.num_layers=4")
  assert run.returncode == 2
  assert "config.paths.shape" in run.stderr
  assert not (tmp_path / "data").exists()


def test_unknown_config_keys_are_rejected_by_the_cli(tmp_path):
  run = _main(tmp_path, "--config.model.num_layer=3")  # typo: num_layers
  assert run.returncode != 0
  assert "num_layer" in run.stderr
  assert not (tmp_path / "data").exists()


def test_fake_devices_refuse_a_non_cpu_platform(tmp_path):
  run = _main(tmp_path, fake_devices=8, env={"JAX_PLATFORMS": "cuda"})
  assert run.returncode != 0
  assert "--fake_devices=8 needs the CPU platform" in run.stderr


def test_routing_reads_only_the_first_32_tokens():
  dims = layers.ModelDims(vocab_size=97, num_layers=2, d_model=32,
                          num_heads=2, head_dim=16, mlp_dim=64,
                          dtype="float32")
  model = transformer.build_model(dims, paths_lib.build_topology(2, (1,)))
  params = model.init(jax.random.key(0), np.zeros((1, 8), np.int32))
  params = jax.tree.map(lambda x: getattr(x, "value", x), params["params"],
                        is_leaf=lambda x: hasattr(x, "value"))
  rng = np.random.default_rng(0)
  docs = [rng.integers(4, 97, n).astype(np.int32) for n in (20, 50, 90)]

  def store(ds):
    offsets = np.concatenate([[0], np.cumsum([len(d) for d in ds])])
    return token_store.TokenDocs(np.concatenate(ds), offsets)

  changed = [d.copy() for d in docs]
  for d in changed:
    d[32:] = rng.integers(4, 97, max(len(d) - 32, 0))
  changed_prefix = [d.copy() for d in docs]
  changed_prefix[2][31] = (changed_prefix[2][31] + 1) % 97
  for kind in ("base_hidden", "token_embedding"):
    a = features.prefix_features(model, params, store(docs), 32, kind, 2)
    b = features.prefix_features(model, params, store(changed), 32, kind, 2)
    c = features.prefix_features(model, params, store(changed_prefix), 32,
                                 kind, 2)
    np.testing.assert_array_equal(a, b)
    assert np.abs(a[2] - c[2]).max() > 0  # token 31 is read
    np.testing.assert_array_equal(a[:2], c[:2])


def test_diloco_main_job_with_kmeans_replica_shards(tmp_path):
  run = _main(tmp_path, "--config.paths.shape=1", "--config.paths.num_replicas=2",
              "--config.base.num_steps=0", "--config.train.num_steps=4",
              "--config.diloco.inner_steps=2",
              "--config.routing.features=token_embedding",
              "--config.routing.replica_shards=kmeans")
  assert run.returncode == 0, run.stderr[-3000:]
  results = json.loads((tmp_path / "results.json").read_text())
  assert list(results["models"]) == ["diloco x2"]
  assert results["runs"][0]["workers"] == 2
  manifest = json.loads((tmp_path / "shards" / "main" /
                         "manifest.json").read_text())
  assert manifest["hashes"]["router"] not in ("iid", "none")
  sizes = [s["num_documents"] for s in manifest["shards"]]
  assert sum(sizes) == results["data"]["train"]["documents"] and min(sizes)


def test_shards_are_reused_only_for_the_same_documents(tmp_path):
  from dipaco_jax import pipeline  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  lengths = rng.integers(5, 30, 40)
  docs = token_store.TokenDocs(
      rng.integers(4, 97, lengths.sum()).astype(np.int32),
      np.r_[0, np.cumsum(lengths)])
  hashes = {"corpus": "c", "tokenizer": "t", "router": "r"}
  split = [np.arange(0, 20), np.arange(20, 40)]
  _, first = pipeline.make_shards(tmp_path, "s", docs, split, hashes)
  manifest_file = tmp_path / "shards" / "s" / "manifest.json"
  stamp = manifest_file.stat().st_mtime_ns
  _, again = pipeline.make_shards(tmp_path, "s", docs, split, hashes)
  assert again == first and manifest_file.stat().st_mtime_ns == stamp
  # Same provenance (router hash), other documents: rewritten.
  other = [np.arange(0, 25), np.arange(25, 40)]
  _, changed = pipeline.make_shards(tmp_path, "s", docs, other, hashes)
  assert changed["hashes"]["documents"] != first["hashes"]["documents"]
  assert changed["shards"][0]["num_documents"] == 25
