"""Tests of the TF-free data package: corpora, tokenizer, shards, batches."""

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from dipaco_jax.data import batches
from dipaco_jax.data import corpora
from dipaco_jax.data import corpus_manifest
from dipaco_jax.data import doc_store
from dipaco_jax.data import prefetch
from dipaco_jax.data import shards
from dipaco_jax.data import token_store
from dipaco_jax.data import tokenizer as tokenizer_lib

_CODE = ('def f(x):\n'
         '\tif x:\n'
         '\n'
         '\n'
         "\t\treturn 'héllo wörld 世界 🙂 \u2581 ▁▁'  # tab\tinside\n"
         '    \n'
         '  leading spaces\r\n'
         'trailing   \n\n')


@pytest.fixture(scope='module')
def small_corpus():
  return corpora.read_python_stdlib(
      max_doc_chars=4000, validation_fraction=0.1, max_corpus_chars=300_000)[0]


@pytest.fixture(scope='module')
def model_proto(small_corpus):
  texts = [d.text for d in small_corpus['train']]
  return tokenizer_lib.train_sentencepiece(texts, vocab_size=512)


@pytest.fixture(scope='module')
def tok(model_proto):
  return tokenizer_lib.Tokenizer(model_proto)


def _docs(lengths, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(4, 100, size=sum(lengths)).astype(np.int32)
  offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
  tokens[offsets[:-1][np.asarray(lengths) > 0]] = 2  # BOS
  return token_store.TokenDocs(tokens, offsets)


# ---------------------------------------------------------------- corpora


def test_chunk_text_respects_limit_and_concatenates_back():
  text = 'short\n' * 50 + 'x' * 250 + '\nend\n' + 'y' * 30
  chunks = corpora.chunk_text(text, 100)
  assert ''.join(chunks) == text
  assert all(0 < len(c) <= 100 for c in chunks)
  # Cut at line ends except inside the overlong line.
  assert chunks[0].endswith('\n')
  assert corpora.chunk_text('', 10) == []


def test_stdlib_split_is_deterministic_and_disjoint():
  a = corpora.read_python_stdlib(20_000, 0.2, max_corpus_chars=2_000_000)[0]
  b = corpora.read_python_stdlib(20_000, 0.2, max_corpus_chars=2_000_000)[0]
  assert a == b
  assert corpus_manifest.corpus_fingerprint(a) == corpus_manifest.corpus_fingerprint(b)
  files = {s: {d.doc_id.rsplit('#', 1)[0] for d in docs}
           for s, docs in a.items()}
  assert files['train'] and files['validation']
  assert not files['train'] & files['validation']
  total = sum(len(d.text) for docs in a.values() for d in docs)
  assert 1_000_000 < total <= 2_000_000
  for docs in a.values():
    ids = [d.doc_id for d in docs]
    assert len(ids) == len(set(ids))
    assert all(len(d.text) <= 20_000 and d.text.strip() for d in docs)
    assert not any('site-packages' in i for i in ids)
  # A different cap gives a different (but still valid) corpus.
  c = corpora.read_python_stdlib(20_000, 0.2, max_corpus_chars=500_000)[0]
  assert corpus_manifest.corpus_fingerprint(c) != corpus_manifest.corpus_fingerprint(a)


def test_selection_split_never_holds_a_validation_document():
  real = corpora.read_python_stdlib(20_000, 0.2,
                                    max_corpus_chars=2_000_000)[0]
  chosen = corpora.selection_split(real, 0.2)
  units = {s: {corpora.unit_of(d.doc_id) for d in docs}
           for s, docs in chosen.items()}
  real_units = {s: {corpora.unit_of(d.doc_id) for d in docs}
                for s, docs in real.items()}
  # Both of its splits are made of training files, whole, and disjoint.
  assert units['train'] | units['validation'] == real_units['train']
  assert not units['train'] & units['validation']
  assert not (units['train'] | units['validation']) & real_units['validation']
  assert sorted(chosen['train'] + chosen['validation']) == sorted(
      real['train'])
  share = len(units['validation']) / len(real_units['train'])
  assert 0.1 < share < 0.3
  # Not the real split's hash: another set of files is held out.
  assert corpora.selection_split(real, 0.2) == chosen


def test_stdlib_chunks_of_a_file_give_back_the_file():
  import sysconfig  # pylint: disable=g-import-not-at-top
  splits = corpora.read_python_stdlib(3000, 0.5)[0]
  by_file = {}
  for docs in splits.values():
    for d in docs:
      name, index = d.doc_id.rsplit('#', 1)
      by_file.setdefault(name, []).append((int(index), d.text))
  relpath = 'argparse.py'
  assert len(by_file[relpath]) > 5
  chunks = [t for _, t in sorted(by_file[relpath])]
  root = sysconfig.get_paths()['stdlib']
  with open(os.path.join(root, relpath), 'rb') as f:
    assert ''.join(chunks) == f.read().decode('utf-8')
  assert all(len(c) <= 3000 for c in chunks)


def test_text_files_txt_and_jsonl(tmp_path):
  (tmp_path / 'sub').mkdir()
  (tmp_path / 'a.txt').write_text('line one\nline two\n' * 20)
  (tmp_path / 'sub' / 'b.txt').write_text('   \n')  # Blank: skipped.
  with open(tmp_path / 'c.jsonl', 'w') as f:
    for i in range(40):
      f.write(json.dumps({'text': f'doc {i} ' * (i + 1), 'id': i}) + '\n')
    f.write('\n')  # A blank line is not an error.
  pattern = str(tmp_path / '**' / '*.*')
  splits = corpora.read_text_files(pattern, 'text', 100, 0.3)[0]
  docs = splits['train'] + splits['validation']
  ids = {d.doc_id for d in docs}
  assert 'a.txt#0' in ids and 'a.txt#1' in ids
  assert 'c.jsonl:1' in ids and 'c.jsonl:40' in ids
  assert not any(i.startswith('sub/') for i in ids)
  assert all(len(d.text) <= 100 for d in docs)
  # jsonl lines split one by one, so both sides get some of them.
  for split in ('train', 'validation'):
    assert any(d.doc_id.startswith('c.jsonl:') for d in splits[split])
  a_chunks = sorted((int(d.doc_id.split('#')[1]), d.text) for d in docs
                    if d.doc_id.startswith('a.txt#'))
  assert ''.join(t for _, t in a_chunks) == 'line one\nline two\n' * 20
  again = corpora.read_text_files(pattern, 'text', 100, 0.3)[0]
  assert corpus_manifest.corpus_fingerprint(again) == corpus_manifest.corpus_fingerprint(
      splits)


def test_text_files_errors(tmp_path):
  with pytest.raises(ValueError, match='nothing_here'):
    corpora.read_text_files(str(tmp_path / 'nothing_here*.txt'),
                            'text', 100, 0.1)
  bad = tmp_path / 'bad.jsonl'
  bad.write_text('{"text": "ok"}\n{not json\n')
  with pytest.raises(ValueError, match=r'bad\.jsonl line 2'):
    corpora.read_text_files(str(bad), 'text', 100, 0.1)
  bad.write_text('{"text": "ok"}\n{"body": "no text field"}\n')
  with pytest.raises(ValueError, match=r"bad\.jsonl line 2: no field 'text'"):
    corpora.read_text_files(str(bad), 'text', 100, 0.1)


# -------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip(tok, small_corpus):
  assert tok.pad_id == 0 and tok.bos_id == 2 and tok.eos_id == 3
  assert tok.vocab_size == 512
  for text in [_CODE, '', ' ', '\n', '\t\t', '\u2581', 'x\u2581y',
               '\x00\x7f', 'ünïcödé ∑ ∫ 😀\n']:
    ids = tok.encode(text)
    assert ids.dtype == np.int32
    assert tok.decode(ids) == text, repr(text)
  # Every validation document (unseen in training) round-trips too.
  texts = [d.text for d in small_corpus['validation']] or [
      d.text for d in small_corpus['train'][:5]]
  for text in texts:
    assert tok.decode(tok.encode(text)) == text
  # Indentation is compressed: 8 spaces are fewer than 8 tokens.
  assert len(tok.encode('        return x\n')) < 8
  # encode_batch equals encode.
  batch = tok.encode_batch([_CODE, 'a\u2581b', ''])
  for ids, text in zip(batch, [_CODE, 'a\u2581b', '']):
    np.testing.assert_array_equal(ids, tok.encode(text))


def test_tokenizer_training_is_deterministic(model_proto, small_corpus):
  texts = [d.text for d in small_corpus['train']]
  again = tokenizer_lib.train_sentencepiece(texts, vocab_size=512)
  assert again == model_proto
  other_seed = tokenizer_lib.Tokenizer(
      tokenizer_lib.train_sentencepiece(texts, vocab_size=512, seed=1))
  assert other_seed.decode(other_seed.encode(_CODE)) == _CODE


def test_tokenizer_vocab_errors():
  with pytest.raises(ValueError, match='config.data.vocab_size'):
    tokenizer_lib.train_sentencepiece(['abc def\n'] * 5, vocab_size=5000)
  with pytest.raises(ValueError, match='config.data.vocab_size'):
    tokenizer_lib.train_sentencepiece(['abc'], vocab_size=100)


def test_load_or_train_tokenizer_caches(tmp_path, model_proto):
  calls = []

  def texts_fn():
    calls.append(1)
    return ['def f(x):\n    return x + 1\n' * 50,
            'class A:\n\tpass\n' * 50]

  workdir = str(tmp_path / 'run')
  a = tokenizer_lib.load_or_train_tokenizer(workdir, texts_fn, 300)
  b = tokenizer_lib.load_or_train_tokenizer(workdir, texts_fn, 300)
  assert len(calls) == 1 and a.sha256 == b.sha256
  info = json.loads((tmp_path / 'run' / 'tokenizer' / 'info.json').read_text())
  assert info['vocab_size'] == 300 and info['sha256'] == a.sha256
  tokenizer_lib.load_or_train_tokenizer(workdir, texts_fn, 310)
  assert len(calls) == 2  # A different vocab size retrains.
  assert not [p for p in os.listdir(tmp_path / 'run' / 'tokenizer')
              if 'tmp' in p]
  given = tmp_path / 'given.model'
  given.write_bytes(model_proto)
  c = tokenizer_lib.load_or_train_tokenizer(workdir, texts_fn, 300,
                                            model_path=str(given))
  assert c.vocab_size == 512 and len(calls) == 2
  with pytest.raises(ValueError, match='missing.model'):
    tokenizer_lib.load_or_train_tokenizer(
        workdir, texts_fn, 300, model_path=str(tmp_path / 'missing.model'))


def test_seqio_vocabulary_needs_extra(tok):
  try:
    import seqio  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    with pytest.raises(ImportError, match=r'dipaco_jax\[data\]'):
      tok.as_seqio_vocabulary()
  else:
    vocab = tok.as_seqio_vocabulary()
    assert vocab.vocab_size >= tok.vocab_size


def test_training_never_imports_tensorflow():
  """DESIGN invariant 2, checked in a fresh interpreter: other tests in this
  process may have imported seqio (and with it TensorFlow)."""
  code = ('import sys; import dipaco_jax.pipeline, dipaco_jax.train.loop, '
          'dipaco_jax.data.batches, dipaco_jax.data.tokenizer; '
          'assert "tensorflow" not in sys.modules, "tensorflow imported"')
  subprocess.run([sys.executable, '-c', code], check=True,
                 env={**os.environ, 'JAX_PLATFORMS': 'cpu'})


# ------------------------------------------------------------ token store


def test_encode_documents(tok):
  texts = [_CODE, '', 'x = 1\n']
  docs = token_store.encode_documents(tok, texts, vocab_size_check=512)
  assert len(docs) == 3
  for i, text in enumerate(texts):
    assert docs.doc(i)[0] == tok.bos_id
    assert tok.decode(docs.doc(i)[1:]) == text
  np.testing.assert_array_equal(docs.lengths(),
                                [len(tok.encode(t)) + 1 for t in texts])
  with pytest.raises(ValueError, match='Document 0 has token id'):
    token_store.encode_documents(tok, texts, vocab_size_check=10)
  # Worker processes give the same ids as one process.
  many = [f'{_CODE} {i}\n' * (i % 7) for i in range(50)]
  serial = token_store.encode_documents(tok, many, num_workers=1)
  parallel = token_store.encode_documents(tok, many, num_workers=2)
  assert parallel.sha256() == serial.sha256()


def test_token_docs_save_load_subset_prefixes(tmp_path):
  docs = _docs([5, 0, 40, 3])
  assert len(docs) == 4 and docs.num_tokens == 48
  path = tmp_path / 'd' / 'docs.npz'
  docs.save(str(path))
  loaded = token_store.TokenDocs.load(str(path))
  np.testing.assert_array_equal(loaded.tokens, docs.tokens)
  np.testing.assert_array_equal(loaded.offsets, docs.offsets)
  assert loaded.sha256() == docs.sha256()
  assert os.listdir(path.parent) == ['docs.npz']

  sub = docs.subset([3, 0, 2])
  np.testing.assert_array_equal(sub.lengths(), [3, 5, 40])
  for j, i in enumerate([3, 0, 2]):
    np.testing.assert_array_equal(sub.doc(j), docs.doc(i))
  assert sub.sha256() != docs.sha256()
  assert len(docs.subset([])) == 0

  prefix_nxt, lengths_n = docs.prefixes(8, pad_id=0)
  assert prefix_nxt.shape == (4, 8) and prefix_nxt.dtype == np.int32
  np.testing.assert_array_equal(lengths_n, [5, 0, 8, 3])
  np.testing.assert_array_equal(prefix_nxt[0, :5], docs.doc(0))
  np.testing.assert_array_equal(prefix_nxt[0, 5:], 0)
  np.testing.assert_array_equal(prefix_nxt[1], 0)
  np.testing.assert_array_equal(prefix_nxt[2], docs.doc(2)[:8])

  with pytest.raises(ValueError):
    token_store.TokenDocs(np.zeros(3, np.int32), np.array([0, 2]))
  (tmp_path / 'junk.npz').write_bytes(b'not a zip')
  with pytest.raises(ValueError, match='junk.npz'):
    token_store.TokenDocs.load(str(tmp_path / 'junk.npz'))


# ----------------------------------------------------------------- shards


def test_shards_manifest_and_tamper(tmp_path):
  docs = _docs([10, 20, 30, 40, 50])
  directory = str(tmp_path / 'shards')
  assert shards.read_manifest(directory) is None
  manifest = shards.write_shards(
      directory, docs, [np.array([0, 2, 4]), np.array([1, 3])],
      {'tokenizer': 'abc'})
  assert manifest == shards.read_manifest(directory)
  assert manifest['num_shards'] == 2 and manifest['hashes'] == {
      'tokenizer': 'abc'}
  s0, s1 = manifest['shards']
  assert (s0['index'], s0['file'], s0['num_documents'], s0['num_tokens']) == (
      0, 'shard_00000.npz', 3, 90)
  assert (s1['num_documents'], s1['num_tokens']) == (2, 60)
  loaded, indices = shards.load_shard_with_indices(directory, 1)
  np.testing.assert_array_equal(indices, [1, 3])
  np.testing.assert_array_equal(loaded.doc(1), docs.doc(3))
  # Index files into one store, not copies: the shard is its documents.
  assert sorted(os.listdir(directory)) == [
      'docs', 'manifest.json', 'shard_00000.npz', 'shard_00001.npz']
  assert shards.load_shard(directory, 0).materialize().sha256() == (
      docs.subset([0, 2, 4]).sha256())

  # Tampering: point the shard at another document, keep a valid file.
  path = os.path.join(directory, 'shard_00001.npz')
  with np.load(path) as npz:
    arrays = dict(npz)
  arrays['store_indices'][1] = 4
  np.savez(path, **arrays)
  with pytest.raises(ValueError, match='shard_00001.npz.*sha256'):
    shards.load_shard(directory, 1)
  os.remove(path)
  with pytest.raises(ValueError, match='shard_00001.npz'):
    shards.load_shard(directory, 1)
  # The store rewritten under the shards (another corpus): refused.
  doc_store.write_token_docs(os.path.join(directory, 'docs'),
                             _docs([11, 20, 30, 40, 50]))
  with pytest.raises(ValueError, match='not the one the shards'):
    shards.load_shard(directory, 0)


def test_shards_empty_shard_error_writes_nothing(tmp_path):
  docs = _docs([10, 20])
  directory = tmp_path / 'shards'
  with pytest.raises(ValueError, match=r'Shard 1 .*fewer paths'):
    shards.write_shards(str(directory), docs,
                        [np.array([0, 1]), np.array([], np.int64)], {})
  assert not directory.exists() or not os.listdir(directory)


# ---------------------------------------------------------------- batches


def test_pack_rows():
  docs = _docs([7, 5, 9])  # 21 tokens.
  rows = batches.pack_rows(docs, 4)
  assert rows.shape == (5, 5) and rows.dtype == np.int32
  for r in range(5):
    np.testing.assert_array_equal(rows[r], docs.tokens[r * 4:r * 4 + 5])
  with pytest.raises(ValueError, match='seq_len'):
    batches.pack_rows(docs, 21)


def test_batch_for_step_determinism_and_epochs():
  n, width, b = 37, 6, 8
  rows = np.arange(n, dtype=np.int32)[:, None] * np.ones(width, np.int32)
  first = batches.batch_for_step(rows, 7, 0, 3, b)
  assert first.shape == (b, width)
  np.testing.assert_array_equal(first, batches.batch_for_step(rows, 7, 0, 3, b))
  # Pure function of its arguments: the cache does not change the answer.
  batches._permutation.cache_clear()  # pylint: disable=protected-access
  np.testing.assert_array_equal(first, batches.batch_for_step(rows, 7, 0, 3, b))
  # Every row exactly once per epoch (batches straddle epoch boundaries).
  seen = np.concatenate([batches.batch_for_step(rows, 7, 0, s, b)[:, 0]
                         for s in range(n * 3 // b + 1)])
  for epoch in range(3):
    np.testing.assert_array_equal(np.sort(seen[epoch * n:(epoch + 1) * n]),
                                  np.arange(n))
  # The formula itself.
  perm1 = np.random.default_rng([7, 0, 1]).permutation(n)
  i = 5 * b
  assert seen[i] == perm1[i - n]
  # Epochs, streams and seeds differ.
  assert not np.array_equal(seen[:n], seen[n:2 * n])
  other_stream = np.concatenate(
      [batches.batch_for_step(rows, 7, 1, s, b)[:, 0] for s in range(4)])
  assert not np.array_equal(other_stream, seen[:4 * b])


def test_stacked_batches_equal_per_stream():
  rows = [np.arange(n * 5, dtype=np.int32).reshape(n, 5) for n in (20, 33, 7)]
  stacked = batches.StackedBatches(rows, seed=3, batch_size=4)
  assert stacked.num_streams == 3 and stacked.rows_per_stream == [20, 33, 7]
  for step in (0, 1, 9, 100):
    out = stacked.batch(step)
    assert out.shape == (3, 4, 5)
    for w in range(3):
      np.testing.assert_array_equal(
          out[w], batches.batch_for_step(rows[w], 3, w, step, 4))
  with pytest.raises(ValueError, match='same length'):
    batches.StackedBatches([rows[0], np.zeros((3, 6), np.int32)], 0, 2)


def test_batch_for_step_large_is_fast():
  rows = np.zeros((1_000_000, 2), dtype=np.int32)
  batches.batch_for_step(rows, 0, 0, 0, 64)
  start = time.perf_counter()
  for step in range(1, 200):
    batches.batch_for_step(rows, 0, 0, step, 64)
  # Generous: cached permutations make this milliseconds, recomputing
  # them every step would take seconds.
  assert time.perf_counter() - start < 2.0


def test_eval_windows_skip_prefix():
  lengths = [1, 20, 32, 33, 70, 200, 5]
  docs = _docs(lengths)
  seq_len, prefix_len = 16, 32
  out = batches.eval_windows(docs, seq_len, prefix_len=prefix_len)
  m = out['inputs'].shape[0]
  assert out['targets'].shape == out['weights'].shape == (m, seq_len)
  assert out['weights'].dtype == np.float32
  assert out['weights'].sum() == sum(max(0, n - prefix_len) for n in lengths)
  assert np.all(out['weights'].sum(axis=1) > 0)  # No empty windows.
  assert set(out['doc_index'].tolist()) == {3, 4, 5}
  scored = {d: [] for d in range(len(lengths))}
  for w in range(m):
    d = int(out['doc_index'][w])
    doc = docs.doc(d)
    # Window start k*L found from the inputs; inputs/targets shift by one.
    k = int(np.sum(out['doc_index'][:w] == d)) + (
        (prefix_len - 1) // seq_len if lengths[d] > prefix_len else 0)
    start = k * seq_len
    np.testing.assert_array_equal(
        out['inputs'][w][:max(0, min(seq_len, len(doc) - start))],
        doc[start:start + seq_len])
    for i in range(seq_len):
      j = start + i + 1
      if out['weights'][w, i]:
        assert j >= prefix_len and j < len(doc)
        assert out['targets'][w, i] == doc[j]
        scored[d].append(j)
      elif j >= len(doc):
        assert out['targets'][w, i] == 0
  for d, n in enumerate(lengths):
    assert scored[d] == list(range(prefix_len, n))


# --------------------------------------------------------------- prefetch


def test_prefetcher_order_and_values():
  with prefetch.Prefetcher(lambda s: s * s, 3, 20, depth=2) as p:
    got = list(p)
  assert got == [(s, s * s) for s in range(3, 20)]


def test_prefetcher_propagates_errors():

  def produce(step):
    if step == 5:
      raise KeyError('boom')
    return step

  got = []
  with pytest.raises(KeyError, match='boom') as info:
    with prefetch.Prefetcher(produce, 0, 10) as p:
      for step, item in p:
        got.append(item)
  assert got == [0, 1, 2, 3, 4]
  assert any('step 5' in n for n in info.value.__notes__)


def test_prefetcher_close_stops_thread():
  produced = []

  def produce(step):
    produced.append(step)
    return np.zeros(10)

  p = prefetch.Prefetcher(produce, 0, 10**9, depth=2)
  it = iter(p)
  assert next(it)[0] == 0
  start = time.perf_counter()
  p.close()
  assert time.perf_counter() - start < 2.0
  assert not any(t.name == 'dipaco-prefetch' and t.is_alive()
                 for t in threading.enumerate())
  # Bounded: the producer ran at most a few steps ahead.
  assert len(produced) <= 5
  assert list(it) == []
