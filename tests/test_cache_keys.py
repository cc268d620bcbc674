"""Stage caches keyed by content: a changed corpus recomputes what follows,
a refused job writes nothing, and an empty corpus says what to fix."""

import json
import os
import shutil

import orbax.checkpoint as ocp
import pytest

from dipaco_jax import pipeline
from dipaco_jax import testing
from dipaco_jax.data import corpora
from dipaco_jax.data import prepare
from dipaco_jax.stages import cache
from dipaco_jax.stages import run_configs
from dipaco_jax.stages import experiment as experiment_lib
from dipaco_jax.train import checkpoint as ckpt_lib

_WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda "
          "mu nu xi omicron pi rho sigma tau upsilon phi chi psi omega").split()


def _text(seed: int, lines: int = 60) -> str:
  """Varied lines of code-like text (enough for a 320-piece tokenizer)."""
  out = []
  for i in range(lines):
    a, b = _WORDS[(seed + i) % 24], _WORDS[(seed * 7 + 3 * i) % 24]
    out.append(f"def {a}_{i}({b}, n={seed + i}):\n    return {b} * {i} + n\n")
  return "".join(out)


def _corpus(directory, count=6):
  directory.mkdir(parents=True, exist_ok=True)
  for i in range(count):
    (directory / f"f{i}.txt").write_text(_text(i))
  return directory


def _config(corpus_dir, shape="1x1", inner_steps=0):
  c = testing.tiny_config(shape=shape, inner_steps=inner_steps)
  c.data.corpus = "text_files"
  c.data.text_glob = str(corpus_dir / "*")
  c.data.vocab_size = 320
  c.data.validation_fraction = 0.3
  c.data.max_doc_chars = 1000
  return c


def _prepare(config, workdir, capsys):
  bundle = prepare.prepare_data(config.data, str(workdir), config.seed)
  return bundle, capsys.readouterr().out


def _tokenizer_texts(workdir):
  return json.loads((workdir / "tokenizer" / "info.json").read_text())[
      "texts"]


@pytest.fixture
def corpus(tmp_path):
  return _corpus(tmp_path / "corpus")


def test_unchanged_corpus_is_reused_even_when_touched(tmp_path, corpus,
                                                      capsys):
  config = _config(corpus)
  first, out = _prepare(config, tmp_path / "w", capsys)
  assert "[data] reading corpus" in out
  again, out = _prepare(config, tmp_path / "w", capsys)
  assert "[data] reusing" in out and again.hashes == first.hashes
  os.utime(corpus / "f0.txt", ns=(1, 1))  # New times, same bytes.
  _, out = _prepare(config, tmp_path / "w", capsys)
  assert "[data] reusing" in out


def test_replaced_file_recomputes_data_tokenizer_and_shards(
    tmp_path, corpus, capsys):
  config, workdir = _config(corpus), tmp_path / "w"
  before, _ = _prepare(config, workdir, capsys)
  texts_before = _tokenizer_texts(workdir)
  ids = list(range(len(before.docs["train"])))
  _, shards_before = cache.make_shards(workdir, "base", before.docs["train"],
                                       [ids], {**before.hashes, "router": "x"})
  # Same size and mtime as before: only ctime and the bytes tell.
  stat = os.stat(corpus / "f1.txt")
  (corpus / "f1.txt").write_text(_text(1).replace("alpha", "ALPHA"))
  os.utime(corpus / "f1.txt", ns=(stat.st_atime_ns, stat.st_mtime_ns))
  after, out = _prepare(config, workdir, capsys)
  assert "[data] reusing" not in out
  assert "the corpus changed (1 file changed)" in out
  assert after.hashes["corpus"] != before.hashes["corpus"]
  assert _tokenizer_texts(workdir) != texts_before  # Retrained.
  _, shards_after = cache.make_shards(workdir, "base", after.docs["train"],
                                      [ids], {**after.hashes, "router": "x"})
  assert shards_after["hashes"] != shards_before["hashes"]


def test_added_or_removed_file_recomputes(tmp_path, corpus, capsys):
  config, workdir = _config(corpus), tmp_path / "w"
  first, _ = _prepare(config, workdir, capsys)
  (corpus / "new.txt").write_text(_text(9))
  added, out = _prepare(config, workdir, capsys)
  assert "(1 file added)" in out and added.hashes != first.hashes
  (corpus / "new.txt").unlink()
  back, out = _prepare(config, workdir, capsys)
  assert "(1 file removed)" in out and back.hashes == first.hashes


def test_max_corpus_chars_retrains_the_tokenizer(tmp_path, corpus, capsys):
  config, workdir = _config(corpus), tmp_path / "w"
  first, _ = _prepare(config, workdir, capsys)
  texts = _tokenizer_texts(workdir)
  config.data.max_corpus_chars = 12_000  # Fewer files.
  capped, out = _prepare(config, workdir, capsys)
  assert "config.data changed" in out
  assert _tokenizer_texts(workdir) != texts
  assert capped.hashes["tokenizer"] != first.hashes["tokenizer"]


def test_base_hash_ignores_the_outer_optimizer():
  config = testing.tiny_config(shape="2x2", inner_steps=4)
  base = experiment_lib.training_hash(experiment_lib.base_config_of(config))
  dense = experiment_lib.training_hash(
      experiment_lib.dense_config_of(config))
  for field, value in (("outer_lr", 0.3), ("outer_optimizer", "adam"),
                       ("outer_momentum", 0.5)):
    other = experiment_lib.derive_config(config, **{f"diloco.{field}": value})
    assert experiment_lib.training_hash(
        experiment_lib.base_config_of(other)) == base
    assert experiment_lib.training_hash(
        experiment_lib.dense_config_of(other)) == dense
    assert experiment_lib.training_hash(other) != (
        experiment_lib.training_hash(config))  # The paths do use it.
  other = experiment_lib.derive_config(config, **{
      "inner_opt.learning_rate": 1e-4})
  assert experiment_lib.training_hash(
      experiment_lib.base_config_of(other)) != base
  # Data fields reach training through the data hashes, not this one.
  other = experiment_lib.derive_config(config, **{
      "data.max_corpus_chars": 5})
  assert experiment_lib.training_hash(other) == (
      experiment_lib.training_hash(config))


@pytest.mark.parametrize("files, fix", [
    ({}, r"No files match .*config\.data\.text_glob"),
    ({"a.bin": b"\0\1\2" * 50, "b.txt": "h\xe9llo".encode("latin-1")},
     r"2 files, 2 read \(155 bytes\), 2 skipped.*Every file read was skipped "
     r"\(binary, not UTF-8\).*config\.data\.text_glob"),
    ({"a.txt": b"   \n", "b.txt": b""},
     r"2 files, 2 read.*2 blank.*hold no text"),
    ({"one.txt": b"print('one line')\n"},
     r"1 file, 1 read .*the only one went to \w+: use at least 2 files"),
])
def test_empty_split_says_what_was_found_and_the_fix(tmp_path, capsys, files,
                                                     fix):
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  for name, data in files.items():
    (corpus / name).write_bytes(data)
  with pytest.raises(corpora.CorpusError, match=fix):
    _prepare(_config(corpus), tmp_path / "w", capsys)
  assert not (tmp_path / "w" / "data").exists()


def test_skipped_files_are_named_and_a_small_cap_says_raise_it(
    tmp_path, corpus, capsys):
  for i in range(7):
    (corpus / f"z{i}.bin").write_bytes(b"\0" * 10)
  config, workdir = _config(corpus), tmp_path / "w"
  _, out = _prepare(config, workdir, capsys)
  assert "[data] skipped 7 of 13 files: z0.bin (binary)" in out
  assert ", and 2 more" in out
  config.data.max_corpus_chars = 5
  with pytest.raises(corpora.CorpusError,
                     match=r"max_corpus_chars=5 is smaller than every file"):
    _prepare(config, workdir, capsys)
  config.data.max_corpus_chars = 5000  # One text file: one split only.
  with pytest.raises(corpora.CorpusError, match=r"raise config\.data\."
                     r"max_corpus_chars \(now 5,000: it keeps \d+ of 13"):
    _prepare(config, workdir, capsys)


def _fake_checkpoint(run_dir, hashes, step=4):
  """A checkpoint with only its meta item: what the checks read."""
  manager = ocp.CheckpointManager(run_dir / "checkpoints",
                                  item_names=("meta",))
  manager.save(step, args=ocp.args.Composite(meta=ocp.args.JsonSave(
      {"hashes": hashes, "name": run_dir.name, "step": step})))
  manager.wait_until_finished()
  manager.close()


def _snapshot(directory):
  return {str(p): p.read_bytes() for p in sorted(directory.rglob("*"))
          if p.is_file()}


def test_refused_job_writes_nothing(tmp_path, corpus, capsys):
  config = _config(corpus, shape="2x2", inner_steps=4)
  config.base.num_steps = 4
  workdir = tmp_path / "w"
  pipeline._prepare(config, workdir)  # pylint: disable=protected-access
  _fake_checkpoint(workdir / "runs" / "base", {"config": "x"})
  # Only the paths use the outer optimizer: the base run is not refused.
  outer = experiment_lib.derive_config(config, **{"diloco.outer_lr": 0.3})
  pipeline._prepare(outer, workdir)  # pylint: disable=protected-access
  assert json.loads((workdir / "config.json").read_text())[
      "diloco"]["outer_lr"] == 0.3
  # A training setting of a run with checkpoints: refused, nothing written.
  (corpus / "f0.txt").write_text(_text(42))  # Would redo the data stage.
  before = _snapshot(workdir)
  changed = experiment_lib.derive_config(outer, **{
      "inner_opt.learning_rate": 1e-4})
  capsys.readouterr()
  with pytest.raises(ckpt_lib.CheckpointMismatchError,
                     match=r"(?s)runs/base: inner_opt\.learning_rate: "
                     r"0\.003 -> 0\.0001.*Nothing was written"):
    pipeline._prepare(changed, workdir)  # pylint: disable=protected-access
  assert _snapshot(workdir) == before
  assert "[data]" not in capsys.readouterr().out
  # Checkpoints that carry the new settings' own hash are not refused,
  # whatever config.json says (older code wrote it, then refused).
  shutil.rmtree(workdir / "runs" / "base")
  _fake_checkpoint(workdir / "runs" / "base", {
      "config": experiment_lib.training_hash(
          experiment_lib.base_config_of(changed))})
  experiment_lib.check_workdir(changed, workdir)


def test_checkpoints_of_other_inputs_are_moved_aside(tmp_path, capsys):
  run_dir = tmp_path / "runs" / "dipaco"
  hashes = {"config": "c", "corpus": "a", "tokenizer": "t", "init": "i"}
  _fake_checkpoint(run_dir, hashes)
  assert experiment_lib.retire_if_stale(run_dir, hashes) is None
  assert experiment_lib.retire_if_stale(
      run_dir, {**hashes, "init": "j"}, ignore=("init",)) is None
  moved = experiment_lib.retire_if_stale(run_dir, {**hashes, "corpus": "b"})
  assert moved is not None and moved.name.startswith("dipaco.stale-")
  assert not run_dir.exists()
  assert experiment_lib.checkpoint_hashes(moved) == hashes
  assert "inputs changed since its checkpoints (corpus)" in (
      capsys.readouterr().out)


def test_checkpoints_with_the_legacy_config_hash_are_kept(tmp_path):
  config = experiment_lib.base_config_of(testing.tiny_config())
  run_dir = tmp_path / "runs" / "base"
  assert experiment_lib.config_hash_of_run(run_dir, config) == (
      experiment_lib.training_hash(config))
  legacy = experiment_lib.legacy_training_hash(config)
  assert legacy != experiment_lib.training_hash(config)
  _fake_checkpoint(run_dir, {"config": legacy})
  assert experiment_lib.config_hash_of_run(run_dir, config) == legacy
  other = experiment_lib.derive_config(config, **{"data.seq_len": 48})
  assert experiment_lib.config_hash_of_run(run_dir, other) == (
      experiment_lib.training_hash(other))


def test_the_sparse_aggregate_is_hashed_only_where_it_changes_numbers():
  config = testing.tiny_config(shape="2x2", inner_steps=4)
  plain = experiment_lib.training_hash(config)
  derive = experiment_lib.derive_config
  # No top-k slot: the aggregate changes nothing, whatever it is.
  assert experiment_lib.training_hash(derive(
      config, **{"diloco.sparse_aggregate": "mean"})) == plain
  # Top-k with mean (the default until 2026-11-29) keeps the hash those
  # runs had; today's default, senders, is another run.
  topk = derive(config, **{"diloco.compression": "topk"})
  mean = derive(topk, **{"diloco.sparse_aggregate": "mean"})
  assert "sparse_aggregate" not in run_configs.training_fields(mean)["diloco"]
  assert experiment_lib.training_hash(topk) != experiment_lib.training_hash(
      mean)
  per_slot = derive(config, **{"diloco.per_slot": "level=compression:topk"})
  assert run_configs.training_fields(per_slot)["diloco"][
      "sparse_aggregate"] == "senders"


def test_the_low_rank_matrix_is_hashed_only_where_it_changes_numbers():
  config = testing.tiny_config(shape="2x2", inner_steps=4)
  derive = experiment_lib.derive_config
  for matrix in ("per_layer", "stacked"):  # No low rank: no change.
    assert experiment_lib.training_hash(derive(
        config, **{"diloco.compression_matrix": matrix})) == (
            experiment_lib.training_hash(config))
  # Low rank stacked (every low-rank run before the field) keeps the hash
  # those runs had; per layer is another run, by either way of asking.
  for low_rank in ({"diloco.compression": "lowrank_shared"},
                   {"diloco.per_slot": "level=compression:lowrank"}):
    stacked = derive(config, **low_rank,
                     **{"diloco.compression_matrix": "stacked"})
    per_layer = derive(stacked, **{"diloco.compression_matrix": "per_layer"})
    assert "compression_matrix" not in run_configs.training_fields(
        stacked)["diloco"]
    assert run_configs.training_fields(per_layer)["diloco"][
        "compression_matrix"] == "per_layer"
  # Where per_layer changes nothing, it is not hashed either: unstacked
  # layers, or a low rank on the embedding alone.
  per_layer = derive(config, **{"diloco.compression": "lowrank",
                                "diloco.compression_matrix": "per_layer"})
  for no_effect in ({"model.scan_layers": False},
                    {"diloco.compression": "int4",
                     "diloco.per_slot": "shared=compression:lowrank"}):
    assert "compression_matrix" not in run_configs.training_fields(
        derive(per_layer, **no_effect))["diloco"]


def test_the_index_code_is_not_hashed():
  # Elias-Fano indices change the bytes on the wire, not the numbers.
  config = testing.tiny_config(shape="2x2", inner_steps=4)
  topk = experiment_lib.derive_config(config, **{
      "diloco.compression": "topk", "diloco.compression_topk_chunk": 64})
  assert experiment_lib.training_hash(topk) == experiment_lib.training_hash(
      experiment_lib.derive_config(
          topk, **{"diloco.compression_index_code": "elias_fano"}))
