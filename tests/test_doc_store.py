"""The token store on disk: the same documents, rows and windows as in
memory; unfinished or damaged stores refused; bounded memory to write."""

import os
import pickle
import tracemalloc

import numpy as np
import pytest

from dipaco_jax import config_base
from dipaco_jax.data import batches
from dipaco_jax.data import corpus_stream
from dipaco_jax.data import doc_store
from dipaco_jax.data import doc_view
from dipaco_jax.data import prepare
from dipaco_jax.data import token_store


def _random_docs(seed=0, num_docs=400, max_len=300):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, max_len, size=num_docs)
  offsets = np.zeros(num_docs + 1, np.int64)
  np.cumsum(lengths, out=offsets[1:])
  return token_store.TokenDocs(
      rng.integers(0, 1000, size=offsets[-1]).astype(np.int32), offsets)


@pytest.mark.parametrize('chunk_tokens', [1, 37, 4096])
def test_store_answers_what_memory_answers(tmp_path, chunk_tokens):
  docs = _random_docs()
  store = doc_store.write_token_docs(tmp_path / 's', docs, chunk_tokens)
  assert (len(store), store.num_tokens) == (len(docs), docs.num_tokens)
  assert store.sha256 == docs.sha256()  # The same digest as in memory.
  view = doc_view.DocView(store)
  rng = np.random.default_rng(1)
  picks = rng.integers(0, len(docs), size=150)  # Repeats, any order.
  in_memory, on_disk = docs.subset(picks), view.subset(picks)
  np.testing.assert_array_equal(on_disk.lengths(), in_memory.lengths())
  np.testing.assert_array_equal(on_disk.doc(7), in_memory.doc(7))
  np.testing.assert_array_equal(on_disk.materialize().tokens,
                                in_memory.tokens)
  for got, want in zip(on_disk.prefixes(32), in_memory.prefixes(32)):
    np.testing.assert_array_equal(got, want)
  # Training rows: every row, and batches, equal to the packed copy.
  rows, stream_rows = (batches.pack_rows(in_memory, 16),
                       batches.pack_rows(on_disk, 16))
  assert isinstance(stream_rows, doc_view.StreamRows)
  assert stream_rows.shape == rows.shape
  np.testing.assert_array_equal(stream_rows[np.arange(rows.shape[0])], rows)
  for step in (0, 5, 400):  # 400: past an epoch boundary.
    np.testing.assert_array_equal(
        batches.batch_for_step(stream_rows, 3, 2, step, 8),
        batches.batch_for_step(rows, 3, 2, step, 8))
  windows = batches.eval_windows(on_disk, 16)
  for key, want in batches.eval_windows(in_memory, 16).items():
    np.testing.assert_array_equal(windows[key], want)


def test_subset_of_subset_and_bounds(tmp_path):
  docs = _random_docs(num_docs=50)
  view = doc_view.DocView(
      doc_store.write_token_docs(tmp_path / 's', docs, 64))
  nested = view.subset([5, 6, 7, 8]).subset([3, -4])
  np.testing.assert_array_equal(nested.indices, [8, 5])
  with pytest.raises(IndexError):
    view.subset([50])
  rows = batches.pack_rows(view, 8)
  with pytest.raises(IndexError):
    rows[np.array([rows.shape[0]])]
  # A store crosses processes by its path, not its contents.
  again = pickle.loads(pickle.dumps(view.store))
  assert len(pickle.dumps(view.store)) < 500
  np.testing.assert_array_equal(doc_view.DocView(again).doc(3), docs.doc(3))


def test_unfinished_or_damaged_store_is_refused(tmp_path):
  docs = _random_docs(num_docs=30)
  directory = tmp_path / 's'
  writer = doc_store.DocStoreWriter(directory, 64)
  writer.add_all(docs.doc(i) for i in range(len(docs)))
  # Not closed: no store.json, so not a store.
  with pytest.raises(doc_store.StoreError, match='never finished'):
    doc_store.DocStore(directory)
  writer.close()
  doc_store.DocStore(directory)
  # A flipped bit in a record: riegeli's chunk hash catches it on read.
  path = directory / 'tokens-00000.array_record'
  data = bytearray(path.read_bytes())
  data[200] ^= 1
  path.write_bytes(bytes(data))
  with pytest.raises(doc_store.StoreError, match='hash mismatch'):
    doc_view.DocView(doc_store.DocStore(directory)).materialize()
  # Offsets cut short.
  offsets = directory / doc_store.OFFSETS_FILE
  offsets.write_bytes(offsets.read_bytes()[:-8])
  with pytest.raises(doc_store.StoreError, match='damaged'):
    doc_store.DocStore(directory)


def test_writer_holds_nothing_per_document(tmp_path):
  """200k documents, 8M tokens (32 MB): the writer's peak allocation stays
  at a record and its buffers, whatever was written before."""
  writer = doc_store.DocStoreWriter(tmp_path / 's', 4096)
  doc = np.arange(40, dtype=np.int32)
  tracemalloc.start()
  try:
    for _ in range(200_000):
      writer.add(doc)
    _, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
  store = writer.close()
  assert store.num_tokens == 8_000_000
  assert peak < 1_000_000, peak  # The corpus is 32 MB.


def test_data_stage_stores_the_documents_in_memory_encoding(tmp_path):
  """The streamed data stage writes exactly what encoding the collected
  corpus gives: the same documents in the same order, so every run built
  on them is unchanged."""
  config = config_base.base_config()
  d = config.data
  d.max_corpus_chars = 600_000
  d.max_doc_chars = 3000
  d.vocab_size = 512
  d.validation_fraction = 0.3
  bundle = prepare.prepare_data(d, str(tmp_path), 0)
  splits, _ = corpus_stream.read_corpus(d)
  for split in ('train', 'validation'):
    want = token_store.encode_documents(
        bundle.tokenizer, [doc.text for doc in splits[split]])
    store = bundle.docs[split].store
    assert os.path.isdir(store.directory)
    assert store.sha256 == want.sha256(), split
    assert len(bundle.units[split]) == len(want)
  # Reused on the second call, from the stores.
  again = prepare.prepare_data(d, str(tmp_path), 0)
  assert again.docs['train'].store.sha256 == bundle.docs['train'].store.sha256
