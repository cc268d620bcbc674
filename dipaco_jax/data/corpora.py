"""Text corpora as streams of documents, split into train and validation.

Each source is a stream of (split, document) that reads one file at a time
(`stream_*`; the data stage tokenizes it into a store on disk without
holding the corpus), or the same documents collected into lists
(`read_*`: small corpora and tests). Two sources, both
without TensorFlow (DESIGN invariant 2):

* `stream_python_stdlib`: the installed Python standard library's `.py`
  files. Present on every machine and needs no network, so the quickstart
  runs anywhere.
* `stream_text_files`: user files matched by a glob, plain text (`.txt`)
  or JSON lines (`.jsonl`).

The split is decided by hashing a stable name (a file's relative path), never
by position or a random draw, so it is deterministic across machines and
does not move when files are added or removed. All chunks of one file land
in the same split, so validation never sees a piece of a training file.

A file with a few undecodable bytes is read with them replaced (U+FFFD);
binary files (a NUL byte), files that are mostly not UTF-8 (the rule:
`corpus_files.decode`), dangling links and unreadable files are skipped.
The `read_*` functions return a `Reading` that names both. Fingerprints of
a corpus (its files, its documents) are in `data/corpus_manifest.py`.
"""

import collections
import dataclasses
import hashlib
import json
from typing import Iterable, Iterator, Sequence

from absl import logging
from etils import epath
import numpy as np

from dipaco_jax.data import corpus_files
from dipaco_jax.data import corpus_manifest

Document = collections.namedtuple('Document', ['doc_id', 'text'])


CorpusError = corpus_files.CorpusError


@dataclasses.dataclass
class Reading:
  """What reading a corpus found: for the `[data]` lines and for saying
  why a split came out empty."""
  source: str  # e.g. "text files '/data/*.txt'"
  found_by: str = ''  # e.g. "matched by '/data/*.txt'"
  matched: int = 0  # Files found (glob matches, stdlib .py files).
  kept: int = 0  # Of those that can be opened, all or what the cap kept.
  read: int = 0  # Of those kept, the files read (not skipped).
  smallest: int = 0  # Bytes of the smallest file kept (0 if none).
  bytes_read: int = 0  # Bytes of the files kept.
  blank: int = 0  # Files read that hold no text (whitespace only).
  # (name, why) of every file found and not read, the cap aside.
  skipped: list = dataclasses.field(default_factory=list)
  # (name, bytes replaced with U+FFFD) of the files read that had some.
  replaced: list = dataclasses.field(default_factory=list)


def unit_of(doc_id: str) -> str:
  """The split unit of a document: its file (`relpath#chunk` -> relpath),
  its `.jsonl` line (`relpath:line#chunk` -> relpath:line), or itself.

  Train/validation is split by this unit; held-out router and
  early-stopping documents are drawn by it too, so no held-out document
  shares a file with a training document.
  """
  head, sep, tail = doc_id.rpartition('#')
  return head if sep and tail.isdigit() else doc_id


def unit_ids(doc_ids: Sequence[str]) -> np.ndarray:
  """Integer unit ids (numbered in order of first appearance), int64 [N]."""
  numbers = {}
  return np.array([numbers.setdefault(unit_of(d), len(numbers))
                   for d in doc_ids], np.int64)

def _hash_fraction(name: str) -> float:
  """Maps a name to a fixed number in [0, 1) (the same on every machine)."""
  digest = hashlib.sha256(name.encode('utf-8')).digest()
  return int.from_bytes(digest[:8], 'big') / 2.0**64


def _cap_order(name: str) -> bytes:
  """The order in which a capped corpus takes files.

  Other bytes of the digest than `_hash_fraction` reads: ordering by the
  split hash itself would fill a small cap with validation files only.
  """
  return hashlib.sha256(name.encode('utf-8')).digest()[8:16]


def _split_of(name: str, validation_fraction: float) -> str:
  if _hash_fraction(name) < validation_fraction:
    return 'validation'
  return 'train'


def _selection_fraction(unit: str) -> float:
  """A second fixed number in [0, 1) per unit, independent of the split's
  (other bytes of the digest), for `selection_split`."""
  digest = hashlib.sha256(unit.encode('utf-8')).digest()
  return int.from_bytes(digest[16:24], 'big') / 2.0**64


def selection_stream(stream: Iterable[tuple[str, Document]],
                     validation_fraction: float
                     ) -> Iterator[tuple[str, Document]]:
  """`selection_split` over a stream of (split, document)."""
  for split, doc in stream:
    if split == 'train':
      held_out = (_selection_fraction(unit_of(doc.doc_id))
                  < validation_fraction)
      yield ('validation' if held_out else 'train'), doc


def selection_split(splits: dict[str, list[Document]],
                    validation_fraction: float) -> dict[str, list[Document]]:
  """The split to choose settings on without the validation set: its
  documents are left out, and a `validation_fraction` share of the
  training units (files, `.jsonl` lines) is held out in its place, whole,
  by another hash. Models compared on it never see the validation set, and
  the final run is scored on the real one."""
  out = {'train': [], 'validation': []}
  for doc in splits['train']:
    held_out = _selection_fraction(unit_of(doc.doc_id)) < validation_fraction
    out['validation' if held_out else 'train'].append(doc)
  return out


def chunk_text(text: str, max_doc_chars: int) -> list[str]:
  """Splits `text` into chunks of at most `max_doc_chars` characters.

  Cuts at line ends where possible so chunks stay readable code; a single
  line longer than the limit is cut hard. Concatenating the chunks gives back
  `text` exactly (no chunk is dropped here; callers skip blank ones).

  Args:
    text: the text to split.
    max_doc_chars: the largest chunk; <= 0 means no limit.

  Returns:
    The chunks, in order.
  """
  if max_doc_chars <= 0 or len(text) <= max_doc_chars:
    return [text] if text else []
  chunks = []
  current = []
  current_len = 0
  for line in text.splitlines(keepends=True):
    if current_len + len(line) > max_doc_chars and current:
      chunks.append(''.join(current))
      current, current_len = [], 0
    while len(line) > max_doc_chars:
      chunks.append(line[:max_doc_chars])
      line = line[max_doc_chars:]
    if line:
      current.append(line)
      current_len += len(line)
  if current:
    chunks.append(''.join(current))
  return chunks


def _check_args(max_doc_chars: int, validation_fraction: float) -> None:
  if max_doc_chars <= 0:
    raise CorpusError(f'config.data.max_doc_chars must be > 0, got '
                      f'{max_doc_chars}.')
  if not 0.0 <= validation_fraction < 1.0:
    raise CorpusError(f'config.data.validation_fraction must be in [0, 1), '
                      f'got {validation_fraction}.')


def _cap_by_hash(names: Sequence[str], sizes: Iterable[int],
                 max_corpus_chars: int) -> set[str]:
  """Chooses whole files, in hash order, until `max_corpus_chars` is reached.

  Hash order rather than sorted order so a capped corpus samples the whole
  tree instead of only the first packages alphabetically.

  Args:
    names: file names (relative paths).
    sizes: the character count of each name, in the same order.
    max_corpus_chars: the cap.

  Returns:
    The names kept.
  """
  size_of = dict(zip(names, sizes))
  kept = set()
  total = 0
  for name in sorted(names, key=lambda n: (_cap_order(n), n)):
    if total >= max_corpus_chars:
      break
    if total + size_of[name] > max_corpus_chars:
      continue  # Too big for what is left; a smaller file may still fit.
    kept.add(name)
    total += size_of[name]
  return kept


def _file_documents(name: str, text: str, max_doc_chars: int,
                    validation_fraction: float
                    ) -> Iterator[tuple[str, Document]]:
  """(split, document) of each non-blank chunk of one file."""
  split = _split_of(name, validation_fraction)
  for index, chunk in enumerate(chunk_text(text, max_doc_chars)):
    if chunk.strip():
      yield split, Document(f'{name}#{index}', chunk)


def collect(stream: Iterable[tuple[str, Document]]
            ) -> dict[str, list[Document]]:
  """A stream of (split, document) as {'train': [...], 'validation': [...]}
  (in memory: for small corpora and tests; the data stage streams)."""
  splits = {'train': [], 'validation': []}
  for split, doc in stream:
    splits[split].append(doc)
  return splits


def _log_sizes(source: str, splits: dict[str, list[Document]]) -> None:
  for name, docs in splits.items():
    logging.info('%s: %s has %d documents, %d characters.', source, name,
                 len(docs), sum(len(d.text) for d in docs))
    if not docs:  # Info only: the data stage raises with the fix.
      logging.info('%s: the %s split is empty.', source, name)


def _read_files(files: dict[str, epath.Path], reading: Reading,
                max_corpus_chars: int) -> dict[str, epath.Path]:
  """The files to read (all, or those the cap keeps), sizes noted.

  A file that cannot be opened (a dangling link) is skipped here, before
  the cap, so it is named whatever the cap keeps.
  """
  reading.matched = len(files)
  sizes = {}
  for name, path in files.items():
    why = corpus_files.problem(path)
    if why:
      reading.skipped.append((name, why))
    else:
      sizes[name] = corpus_manifest.stat_signature(path)[0]
  files = {name: files[name] for name in sizes}
  names = sorted(files)
  if max_corpus_chars > 0:
    # File sizes in bytes stand in for characters when choosing (text is
    # mostly ASCII); the chosen files are then read once.
    names = sorted(_cap_by_hash(names, [sizes[n] for n in names],
                                max_corpus_chars))
  reading.kept = len(names)
  reading.smallest = min(sizes.values(), default=0)
  reading.bytes_read = sum(sizes[n] for n in names)
  return {n: files[n] for n in names}


def _texts(files: dict[str, epath.Path], reading: Reading,
           replace: bool = True) -> Iterator[tuple[str, epath.Path, str]]:
  """(name, path, text) of each file that reads as text; the others go to
  `reading.skipped`, the bytes replaced to `reading.replaced`."""
  for name, path in files.items():
    text, why, replaced = corpus_files.read_text(path, replace)
    if text is None:
      reading.skipped.append((name, why))
      continue
    reading.read += 1
    reading.blank += not text.strip()
    if replaced:
      reading.replaced.append((name, replaced))
    yield name, path, text


def stream_python_stdlib(
    max_doc_chars: int, validation_fraction: float,
    max_corpus_chars: int = 0
) -> tuple[Reading, Iterator[tuple[str, Document]]]:
  """Documents made of the installed Python standard library's source, as
  a stream of (split, document), one file read at a time; the `Reading` is
  complete once the stream is exhausted.

  Args:
    max_doc_chars: longer files become several documents (cut at lines).
    validation_fraction: the share of files (by hash of the relative path)
      that goes to 'validation'.
    max_corpus_chars: if > 0, keep whole files (in hash order) until this
      many characters; the cap is deterministic.

  Returns:
    (reading, stream); each split's documents come sorted by relative path.
  """
  _check_args(max_doc_chars, validation_fraction)
  root, files = corpus_files.stdlib_files()
  reading = Reading(f'the stdlib at {root}', f'in the stdlib at {root}')
  kept = _read_files(files, reading, max_corpus_chars)

  def stream():
    # Strict: the stdlib's only such files are its encoding tests' malformed
    # sources, skipped as ever (the figures measured on it unchanged).
    for name, _, text in _texts(kept, reading, False):
      yield from _file_documents(name, text, max_doc_chars,
                                 validation_fraction)
    logging.info('stdlib corpus: %d files read from %s, %d skipped.',
                 reading.read, root, len(reading.skipped))
  return reading, stream()


def read_python_stdlib(
    max_doc_chars: int, validation_fraction: float,
    max_corpus_chars: int = 0) -> tuple[dict[str, list[Document]], Reading]:
  """`stream_python_stdlib` collected into lists, and what reading found."""
  reading, stream = stream_python_stdlib(max_doc_chars, validation_fraction,
                                         max_corpus_chars)
  splits = collect(stream)
  _log_sizes('stdlib corpus', splits)
  return splits, reading


def _jsonl_texts(path: epath.Path, text: str,
                 text_field: str) -> Iterator[tuple[int, str]]:
  """Yields (1-based line number, text) for each non-blank JSON line of
  `text` (the file at `path`, read)."""
  for line_no, line in enumerate(text.split('\n'), start=1):
    if not line.strip():
      continue
    try:  # Without a BOM, as json.loads read bytes before.
      record = json.loads(line.lstrip('\ufeff'))
    except json.JSONDecodeError as e:
      raise CorpusError(
          f'{path} line {line_no}: not valid JSON ({e}). Each line of a '
          '.jsonl file must be one JSON object.') from e
    if not isinstance(record, dict) or text_field not in record:
      raise CorpusError(
          f'{path} line {line_no}: no field {text_field!r}. Set the text '
          'field (config.data.text_field) to the key that holds the text.')
    field = record[text_field]
    if not isinstance(field, str):
      raise CorpusError(
          f'{path} line {line_no}: field {text_field!r} is '
          f'{type(field).__name__}, not a string.')
    yield line_no, field


def _chunk_documents(split: str, doc_id: str, text: str,
                     max_doc_chars: int, first_plain: bool
                     ) -> Iterator[tuple[str, Document | None]]:
  """(split, document) of each non-blank chunk of `text`, and (split, None)
  for each blank one.

  `first_plain`: the first chunk's id is `doc_id` itself (`.jsonl` lines),
  else every chunk is `doc_id#index`.
  """
  for index, chunk in enumerate(chunk_text(text, max_doc_chars)):
    if not chunk.strip():
      yield split, None
    elif index == 0 and first_plain:
      yield split, Document(doc_id, chunk)
    else:
      yield split, Document(f'{doc_id}#{index}', chunk)


def stream_text_files(
    pattern: str, text_field: str, max_doc_chars: int,
    validation_fraction: float, max_corpus_chars: int = 0
) -> tuple[Reading, Iterator[tuple[str, Document]]]:
  """Documents from files matching a glob, as a stream of (split,
  document), one file read at a time; the `Reading` is complete once the
  stream is exhausted.

  A `.jsonl` file holds one document per line, taken from `text_field`
  (doc id `relpath:line`, with `#chunk` added for chunks after the first of
  a long line) and split by the hash of its doc id: one `.jsonl` file often
  holds the whole corpus, so splitting by file would put it all on one
  side. Any other file (`.txt`, `.py`, `.md`, ...) is one document, chunked
  like the stdlib source (doc ids `relpath#chunk`), split by the hash of
  its relative path.

  Args:
    pattern: a glob, local or gs:// (for example '/data/**/*.jsonl').
    text_field: the JSON key that holds the text in `.jsonl` files.
    max_doc_chars: longer texts become several documents.
    validation_fraction: the share that goes to 'validation'.
    max_corpus_chars: if > 0, keep whole files (in hash order) until this
      many characters.

  Raises:
    CorpusError (a ValueError): nothing matches, or (while streaming) a
      JSON line is bad; the message names the file and the line. Files
      that cannot be read as text are skipped; the `Reading` says which,
      and why.
  """
  _check_args(max_doc_chars, validation_fraction)
  _, files = corpus_files.text_files(pattern)
  reading = Reading(f'text files {pattern!r}', f'matched by {pattern!r}')
  kept = _read_files(files, reading, max_corpus_chars)

  def stream():
    blank = [0]  # Blank pieces, for the log line.

    def documents(doc_id, text, first_plain):
      for split, doc in _chunk_documents(
          _split_of(doc_id, validation_fraction), doc_id, text,
          max_doc_chars, first_plain):
        if doc is None:
          blank[0] += 1
        else:
          yield split, doc

    for relpath, path, text in _texts(kept, reading):
      if path.suffix == '.jsonl':
        docs = 0
        for line_no, line_text in _jsonl_texts(path, text, text_field):
          for item in documents(f'{relpath}:{line_no}', line_text, True):
            docs += 1
            yield item
        # Blank if it gave no document (`_texts` counted the whole text).
        reading.blank += docs == 0 and bool(text.strip())
        continue
      yield from documents(relpath, text, False)
    logging.info('text files %r: %d files read, %d blank pieces and %d '
                 'files skipped.', pattern, reading.read, blank[0],
                 len(reading.skipped))
  return reading, stream()


def read_text_files(
    pattern: str, text_field: str, max_doc_chars: int,
    validation_fraction: float,
    max_corpus_chars: int = 0) -> tuple[dict[str, list[Document]], Reading]:
  """`stream_text_files` collected into lists, and what reading found."""
  reading, stream = stream_text_files(pattern, text_field, max_doc_chars,
                                      validation_fraction, max_corpus_chars)
  splits = collect(stream)
  _log_sizes(f'text files {pattern!r}', splits)
  return splits, reading
