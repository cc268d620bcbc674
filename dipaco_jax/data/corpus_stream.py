"""The data stage's passes over a corpus, as a stream of (split, document):
read as it is consumed, scanned without its text, encoded into token
stores a batch at a time. Nothing here holds the corpus."""

import dataclasses
from typing import Iterable, Iterator

import numpy as np

from dipaco_jax.data import corpora
from dipaco_jax.data import corpus_manifest
from dipaco_jax.data import doc_store
from dipaco_jax.data import token_store
from dipaco_jax.data import tokenizer as tokenizer_lib

SPLITS = ("train", "validation")


def stream_corpus(data_config
                  ) -> tuple[corpora.Reading | None, Iterator]:
  """The corpus as a stream of (split, `corpora.Document`), read as it is
  consumed, and what reading found (None for c4; complete once the stream
  is exhausted); with `data.selection_split`, the split made of training
  files only. Each call reads the corpus again."""
  reading, stream = _stream_splits(data_config)
  if data_config.get("selection_split", False):
    stream = corpora.selection_stream(stream, data_config.validation_fraction)
  return reading, stream


def read_corpus(data_config) -> tuple[dict, corpora.Reading | None]:
  """`stream_corpus` collected into {split: [documents]} (small corpora)."""
  reading, stream = stream_corpus(data_config)
  return corpora.collect(stream), reading


def _stream_splits(data_config) -> tuple[corpora.Reading | None, Iterator]:
  d = data_config
  if d.corpus == "python_stdlib":
    return corpora.stream_python_stdlib(d.max_doc_chars,
                                        d.validation_fraction,
                                        d.max_corpus_chars)
  if d.corpus == "text_files":
    return corpora.stream_text_files(d.text_glob, d.text_field,
                                     d.max_doc_chars, d.validation_fraction,
                                     d.max_corpus_chars)
  if d.corpus == "c4":
    from dipaco_jax.data import c4  # pylint: disable=g-import-not-at-top
    # Opened now, so that a missing dataset fails before anything is read.
    opened = [(split, c4.iter_c4_documents(split, d.max_documents))
              for split in SPLITS]
    return None, ((split, corpora.Document(*doc)) for split, docs in opened
                  for doc in docs)
  raise corpora.CorpusError(
      f"config.data.corpus: unknown corpus {d.corpus!r}")


@dataclasses.dataclass
class Scan:
  """What one pass over the corpus found, without its text: documents and
  split units per split, the fingerprint."""
  num_docs: dict
  unit_names: dict  # split -> set of unit names (files, .jsonl lines)
  units: dict  # split -> int64 [N]: each document's unit, numbered
  fingerprint: corpus_manifest.Fingerprint


def scan_corpus(stream: Iterable) -> Scan:
  """Counts, units and the fingerprint of a (split, document) stream."""
  num_docs = {s: 0 for s in SPLITS}
  numbers = {s: {} for s in SPLITS}
  units = {s: [] for s in SPLITS}
  fingerprint = corpus_manifest.Fingerprint()
  for split, doc in stream:
    num_docs[split] += 1
    fingerprint.add(split, doc)
    unit = corpora.unit_of(doc.doc_id)
    units[split].append(numbers[split].setdefault(unit, len(numbers[split])))
  return Scan(num_docs, {s: set(numbers[s]) for s in SPLITS},
              {s: np.array(units[s], np.int64) for s in SPLITS},
              fingerprint)


# Characters of text encoded at a time: what the encoding pass holds.
_ENCODE_BATCH_CHARS = 16_000_000


def encode_to_stores(tok: tokenizer_lib.Tokenizer, stream: Iterable,
                      directories: dict) -> dict:
  """Encodes a (split, document) stream into one token store a split; each
  document becomes `[BOS] + encode(text)`, in stream order. Returns
  {split: DocStore}."""
  writers = {s: doc_store.DocStoreWriter(directories[s]) for s in SPLITS}
  bos = np.array([tok.bos_id], np.int32)

  def flush(batch):
    for (split, doc), ids in zip(batch, encoder.encode(
        [doc.text for _, doc in batch])):
      tokens = np.concatenate([bos, ids.astype(np.int32)])
      token_store.check_vocab(tokens, tok.vocab_size, tok,
                              f"Document {doc.doc_id!r}")
      writers[split].add(tokens)

  with token_store.Encoder(tok) as encoder:
    batch, chars = [], 0
    for split, doc in stream:
      batch.append((split, doc))
      chars += len(doc.text)
      if chars >= _ENCODE_BATCH_CHARS:
        flush(batch)
        batch, chars = [], 0
    if batch:
      flush(batch)
  return {s: writer.close() for s, writer in writers.items()}
