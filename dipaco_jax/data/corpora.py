"""Text corpora as lists of documents, split into train and validation.

Two sources, both without TensorFlow (DESIGN invariant 2):

* `python_stdlib_documents`: the installed Python standard library's `.py`
  files. Present on every machine and needs no network, so the quickstart
  runs anywhere.
* `text_files_documents`: user files matched by a glob, plain text (`.txt`)
  or JSON lines (`.jsonl`).

The split is decided by hashing a stable name (a file's relative path), never
by position or a random draw, so it is deterministic across machines and
does not move when files are added or removed. All chunks of one file land
in the same split, so validation never sees a piece of a training file.
"""

import collections
import glob
import hashlib
import json
import os
import sysconfig
from typing import Iterable, Iterator, Sequence

from absl import logging
from etils import epath
import numpy as np

Document = collections.namedtuple('Document', ['doc_id', 'text'])


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

_GLOB_CHARS = frozenset('*?[')


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
    raise ValueError(f'max_doc_chars must be > 0, got {max_doc_chars}.')
  if not 0.0 <= validation_fraction < 1.0:
    raise ValueError(
        f'validation_fraction must be in [0, 1), got {validation_fraction}.')


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


def _documents_from_files(
    texts_by_name: dict[str, str], max_doc_chars: int,
    validation_fraction: float) -> dict[str, list[Document]]:
  splits = {'train': [], 'validation': []}
  for name in sorted(texts_by_name):
    split = splits[_split_of(name, validation_fraction)]
    for index, chunk in enumerate(chunk_text(texts_by_name[name],
                                             max_doc_chars)):
      if chunk.strip():
        split.append(Document(f'{name}#{index}', chunk))
  return splits


def _log_sizes(source: str, splits: dict[str, list[Document]]) -> None:
  for name, docs in splits.items():
    logging.info('%s: %s has %d documents, %d characters.', source, name,
                 len(docs), sum(len(d.text) for d in docs))
    if not docs:
      logging.warning('%s: the %s split is empty; use more data or change '
                      'config.data.validation_fraction.', source, name)


def python_stdlib_documents(
    max_doc_chars: int, validation_fraction: float,
    max_corpus_chars: int = 0) -> dict[str, list[Document]]:
  """Documents made of the installed Python standard library's source.

  Args:
    max_doc_chars: longer files become several documents (cut at lines).
    validation_fraction: the share of files (by hash of the relative path)
      that goes to 'validation'.
    max_corpus_chars: if > 0, keep whole files (in hash order) until this
      many characters; the cap is deterministic.

  Returns:
    {'train': [...], 'validation': [...]}, each sorted by relative path.
  """
  _check_args(max_doc_chars, validation_fraction)
  # The stdlib is always local: os.walk, since epath's glob refuses `**`.
  root = epath.Path(sysconfig.get_paths()['stdlib'])
  relpaths = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if d != 'site-packages']
    for filename in filenames:
      if filename.endswith('.py'):
        relpaths.append(os.path.relpath(os.path.join(dirpath, filename),
                                        root).replace(os.sep, '/'))
  relpaths.sort()
  if not relpaths:
    raise ValueError(f'No .py files found under the stdlib at {root}.')

  skipped = 0

  def read(relpath: str) -> str | None:
    nonlocal skipped
    try:
      # Bytes then decode, so '\r\n' and other line ends survive unchanged.
      return (root / relpath).read_bytes().decode('utf-8')
    except (OSError, UnicodeDecodeError):
      skipped += 1
      return None

  if max_corpus_chars > 0:
    # File sizes in bytes stand in for characters when choosing (the stdlib
    # is nearly all ASCII); the chosen files are then read once.
    sizes = [os.path.getsize(root / r) for r in relpaths]
    relpaths = sorted(_cap_by_hash(relpaths, sizes, max_corpus_chars))
  texts = {}
  for relpath in relpaths:
    text = read(relpath)
    if text is not None:
      texts[relpath] = text
  logging.info('stdlib corpus: %d files read from %s, %d skipped '
               '(unreadable or not UTF-8).', len(texts), root, skipped)
  splits = _documents_from_files(texts, max_doc_chars, validation_fraction)
  _log_sizes('stdlib corpus', splits)
  return splits


def _glob(pattern: str) -> tuple[epath.Path, list[epath.Path]]:
  """Expands `pattern`; returns (base directory, sorted matches)."""
  parts = pattern.split('/')
  fixed = []
  for part in parts:
    if _GLOB_CHARS & set(part):
      break
    fixed.append(part)
  if len(fixed) == len(parts):  # No wildcard: a single file.
    path = epath.Path(pattern)
    return path.parent, [path] if path.is_file() else []
  base_str = '/'.join(fixed) or ('/' if pattern.startswith('/') else '.')
  rest = '/'.join(parts[len(fixed):])
  if '://' in pattern:
    base = epath.Path(base_str)
    matches = [p for p in base.glob(rest) if p.is_file()]
  else:
    base = epath.Path(base_str)
    matches = [epath.Path(p) for p in glob.glob(pattern, recursive=True)
               if os.path.isfile(p)]
  return base, sorted(matches, key=os.fspath)


def _jsonl_texts(path: epath.Path,
                 text_field: str) -> Iterator[tuple[int, str]]:
  """Yields (1-based line number, text) for each non-blank JSON line."""
  with path.open('rb') as f:
    for line_no, raw in enumerate(f, start=1):
      if not raw.strip():
        continue
      try:
        record = json.loads(raw)
      except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(
            f'{path} line {line_no}: not valid JSON ({e}). Each line of a '
            '.jsonl file must be one JSON object.') from e
      if not isinstance(record, dict) or text_field not in record:
        raise ValueError(
            f'{path} line {line_no}: no field {text_field!r}. Set the text '
            'field (config.data.text_field) to the key that holds the text.')
      text = record[text_field]
      if not isinstance(text, str):
        raise ValueError(
            f'{path} line {line_no}: field {text_field!r} is '
            f'{type(text).__name__}, not a string.')
      yield line_no, text


def text_files_documents(
    pattern: str, text_field: str, max_doc_chars: int,
    validation_fraction: float,
    max_corpus_chars: int = 0) -> dict[str, list[Document]]:
  """Documents from files matching a glob (`.jsonl`, or any text file).

  A `.jsonl` file holds one document per line; any other file (`.txt`,
  `.py`, `.md`, ...) is one document (chunked like the stdlib source; doc ids
  `relpath#chunk`), split by the hash of its relative path. Each line of a
  `.jsonl` file is one document taken from `text_field` (doc id
  `relpath:line`, with `#chunk` added for chunks after the first of a long
  line), split by the hash of its doc id: one `.jsonl` file often holds the
  whole corpus, so splitting by file would put it all on one side.

  Args:
    pattern: a glob, local or gs:// (for example '/data/**/*.jsonl').
    text_field: the JSON key that holds the text in `.jsonl` files.
    max_doc_chars: longer texts become several documents.
    validation_fraction: the share that goes to 'validation'.
    max_corpus_chars: if > 0, keep whole files (in hash order) until this
      many characters.

  Returns:
    {'train': [...], 'validation': [...]}.

  Raises:
    ValueError: nothing matches, or a JSON line is bad (the message names
      the file and the line). Text files that are not UTF-8 are skipped and
      counted in the log.
  """
  _check_args(max_doc_chars, validation_fraction)
  base, paths = _glob(pattern)
  if not paths:
    raise ValueError(f'No files match the pattern {pattern!r}. Check the '
                     'path (config.data.text_glob).')
  by_rel = {}
  for path in paths:
    by_rel[os.path.relpath(os.fspath(path), os.fspath(base))] = path
  relpaths = sorted(by_rel)
  if max_corpus_chars > 0:
    sizes = [by_rel[r].stat().length for r in relpaths]
    relpaths = sorted(_cap_by_hash(relpaths, sizes, max_corpus_chars))

  splits = {'train': [], 'validation': []}
  skipped = not_utf8 = 0
  for relpath in relpaths:
    path = by_rel[relpath]
    if path.suffix != '.jsonl':
      try:
        text = path.read_bytes().decode('utf-8')
      except UnicodeDecodeError:
        not_utf8 += 1
        continue
      split = splits[_split_of(relpath, validation_fraction)]
      for index, chunk in enumerate(chunk_text(text, max_doc_chars)):
        if chunk.strip():
          split.append(Document(f'{relpath}#{index}', chunk))
        else:
          skipped += 1
      continue
    for line_no, text in _jsonl_texts(path, text_field):
      doc_id = f'{relpath}:{line_no}'
      split = splits[_split_of(doc_id, validation_fraction)]
      for index, chunk in enumerate(chunk_text(text, max_doc_chars)):
        if chunk.strip():
          split.append(Document(doc_id if index == 0 else f'{doc_id}#{index}',
                                chunk))
        else:
          skipped += 1
  logging.info('text files %r: %d files, %d blank pieces and %d non-UTF-8 '
               'files skipped.', pattern, len(relpaths), skipped, not_utf8)
  _log_sizes(f'text files {pattern!r}', splits)
  return splits


def corpus_fingerprint(splits: dict[str, list[Document]]) -> str:
  """A sha256 hex digest of every split's doc ids and texts, in order."""
  h = hashlib.sha256()
  for name, docs in splits.items():
    h.update(f'split:{name}:{len(docs)}\0'.encode('utf-8'))
    for doc in docs:
      for field in (doc.doc_id, doc.text):
        data = field.encode('utf-8')
        # Length prefixes keep ('ab', 'c') and ('a', 'bc') apart.
        h.update(len(data).to_bytes(8, 'little'))
        h.update(data)
  return h.hexdigest()
