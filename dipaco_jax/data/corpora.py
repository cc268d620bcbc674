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

Binary files (a NUL byte) and files that are not UTF-8 are skipped; the
`read_*` functions return a `Reading` that names them. `file_manifest`
fingerprints a corpus's files without reading them again on a second run,
so the data stage can tell a changed corpus from an unchanged one first.
"""

import collections
import dataclasses
import glob
import hashlib
import json
import os
import pathlib
import sysconfig
from typing import Iterable, Iterator, Sequence

from absl import logging
from etils import epath
import numpy as np

from dipaco_jax import errors

Document = collections.namedtuple('Document', ['doc_id', 'text'])


class CorpusError(errors.UserError, ValueError):
  """The corpus cannot give what the run needs; the message says what was
  found and which config field to change. A ValueError too, as the corpus
  errors were before."""


@dataclasses.dataclass
class Reading:
  """What reading a corpus found: for the `[data]` lines and for saying
  why a split came out empty."""
  source: str  # e.g. "text files '/data/*.txt'"
  matched: int = 0  # Files found (glob matches, stdlib .py files).
  kept: int = 0  # Of those, the files read (all, or what the cap kept).
  smallest: int = 0  # Bytes of the smallest file found (0 if none).
  bytes_read: int = 0  # Bytes of the files read.
  blank: int = 0  # Files read that hold no text (whitespace only).
  skipped: list = dataclasses.field(default_factory=list)  # (name, why)


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
    if not docs:  # Info only: the data stage raises with the fix.
      logging.info('%s: the %s split is empty.', source, name)


def _decode(data: bytes) -> tuple[str | None, str]:
  """(text, '') or (None, why it is skipped).

  A NUL byte marks a binary file: NUL is valid UTF-8, so a file of zeros
  or a compiled object could otherwise decode and become a document.
  """
  if b'\0' in data:
    return None, 'binary'
  try:
    return data.decode('utf-8'), ''
  except UnicodeDecodeError:
    return None, 'not UTF-8'


def stdlib_files() -> tuple[pathlib.Path, dict[str, pathlib.Path]]:
  """(root, relative path -> path) of the stdlib's `.py` files."""
  # The stdlib is always local: os.walk, since epath's glob refuses `**`.
  root = pathlib.Path(sysconfig.get_paths()['stdlib'])
  files = {}
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if d != 'site-packages']
    for filename in filenames:
      if filename.endswith('.py'):
        # pathlib, not epath: 10x cheaper to make and to name, and the
        # stdlib is local.
        path = pathlib.Path(dirpath, filename)
        files[path.relative_to(root).as_posix()] = path
  if not files:
    raise CorpusError(f'No .py files found under the stdlib at {root}; use '
                      'another corpus (config.data.corpus).')
  return root, dict(sorted(files.items()))


def text_files(pattern: str) -> tuple[epath.Path, dict[str, epath.Path]]:
  """(base directory, relative path -> path) of the files `pattern` matches.

  Raises:
    CorpusError: nothing matches.
  """
  base, paths = _glob(pattern)
  if not paths:
    raise CorpusError(
        f'No files match the pattern {pattern!r} (config.data.text_glob): '
        'fix the path or the pattern (`**` matches any depth, e.g. '
        "'/data/**/*.txt').")
  return base, {os.path.relpath(os.fspath(p), os.fspath(base)): p
                for p in paths}


def _stat_signature(path: epath.Path) -> list[int]:
  """[size, mtime_ns, ctime_ns] of a local file; [size, mtime_ns, 0] of
  an object in a bucket.

  ctime too: a tool can set mtime back (`cp -p`, `rsync -t`, `touch -d`),
  never ctime, so an edit that keeps the size and the mtime is still seen.
  """
  name = os.fspath(path)
  if '://' not in name:
    st = os.stat(name)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns]
  st = path.stat()
  return [int(st.length), int((st.mtime or 0) * 1e9), 0]


def _file_sha256(path: epath.Path) -> str:
  h = hashlib.sha256()
  with path.open('rb') as f:
    for block in iter(lambda: f.read(1 << 20), b''):
      h.update(block)
  return h.hexdigest()


def file_manifest(files: dict[str, epath.Path],
                  previous: dict) -> tuple[str, dict]:
  """A fingerprint of the files' names and bytes, cheap on a second run.

  Each file's sha256 is taken from `previous` (the record of the last run)
  when its stat signature (size, mtime, ctime) is the one recorded there,
  and read otherwise. Measured on the stdlib (1,790 files, ~30 MB, 2-core
  machine): listing and hashing every file takes 0.5-0.9 s, listing and
  stat alone 0.3 s; so the first run reads every byte and later runs read
  only the files that changed, which keeps a large user corpus cheap too.
  The fingerprint covers names, sizes and contents, not times, so a file
  touched but unchanged changes nothing.

  Args:
    files: relative name -> path (the names are what the fingerprint sees,
      so a corpus moved elsewhere keeps its fingerprint).
    previous: the record a previous call returned (or {}).

  Returns:
    (hex fingerprint, record): the record maps each full path to
    [relative name, size, mtime_ns, ctime_ns, sha256], for the next call.
  """
  record = {}
  h = hashlib.sha256()
  for name, path in sorted(files.items()):
    signature = _stat_signature(path)
    known = previous.get(os.fspath(path))
    if known and known[0] == name and known[1:4] == signature:
      sha = known[4]
    else:
      sha = _file_sha256(path)
    record[os.fspath(path)] = [name, *signature, sha]
    h.update(json.dumps([name, signature[0], sha]).encode('utf-8') + b'\n')
  return h.hexdigest(), record


def _read_files(files: dict[str, epath.Path], reading: Reading,
                max_corpus_chars: int) -> dict[str, epath.Path]:
  """The files to read (all, or those the cap keeps), sizes noted."""
  sizes = {name: _stat_signature(path)[0] for name, path in files.items()}
  reading.matched = len(files)
  reading.smallest = min(sizes.values(), default=0)
  names = sorted(files)
  if max_corpus_chars > 0:
    # File sizes in bytes stand in for characters when choosing (text is
    # mostly ASCII); the chosen files are then read once.
    names = sorted(_cap_by_hash(names, [sizes[n] for n in names],
                                max_corpus_chars))
  reading.kept = len(names)
  reading.bytes_read = sum(sizes[n] for n in names)
  return {n: files[n] for n in names}


def read_python_stdlib(
    max_doc_chars: int, validation_fraction: float,
    max_corpus_chars: int = 0) -> tuple[dict[str, list[Document]], Reading]:
  """`python_stdlib_documents` and what reading found."""
  _check_args(max_doc_chars, validation_fraction)
  root, files = stdlib_files()
  reading = Reading(f'the stdlib at {root}')
  texts = {}
  for relpath, path in _read_files(files, reading, max_corpus_chars).items():
    try:
      # Bytes then decode, so '\r\n' and other line ends survive unchanged.
      text, why = _decode(path.read_bytes())
    except OSError as e:
      text, why = None, f'unreadable: {e.strerror or e}'
    if text is None:
      reading.skipped.append((relpath, why))
    else:
      texts[relpath] = text
      reading.blank += not text.strip()
  logging.info('stdlib corpus: %d files read from %s, %d skipped.',
               len(texts), root, len(reading.skipped))
  splits = _documents_from_files(texts, max_doc_chars, validation_fraction)
  _log_sizes('stdlib corpus', splits)
  return splits, reading


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
  return read_python_stdlib(max_doc_chars, validation_fraction,
                            max_corpus_chars)[0]


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
    matches = [pathlib.Path(p) for p in glob.glob(pattern, recursive=True)
               if os.path.isfile(p)]  # Local: pathlib is cheaper than epath.
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
        raise CorpusError(
            f'{path} line {line_no}: not valid JSON ({e}). Each line of a '
            '.jsonl file must be one JSON object.') from e
      if not isinstance(record, dict) or text_field not in record:
        raise CorpusError(
            f'{path} line {line_no}: no field {text_field!r}. Set the text '
            'field (config.data.text_field) to the key that holds the text.')
      text = record[text_field]
      if not isinstance(text, str):
        raise CorpusError(
            f'{path} line {line_no}: field {text_field!r} is '
            f'{type(text).__name__}, not a string.')
      yield line_no, text


def _add_chunks(split: list[Document], doc_id: str, text: str,
                max_doc_chars: int, first_plain: bool) -> int:
  """Appends the non-blank chunks of `text`; returns how many were blank.

  `first_plain`: the first chunk's id is `doc_id` itself (`.jsonl` lines),
  else every chunk is `doc_id#index`.
  """
  blank = 0
  for index, chunk in enumerate(chunk_text(text, max_doc_chars)):
    if not chunk.strip():
      blank += 1
    elif index == 0 and first_plain:
      split.append(Document(doc_id, chunk))
    else:
      split.append(Document(f'{doc_id}#{index}', chunk))
  return blank


def read_text_files(
    pattern: str, text_field: str, max_doc_chars: int,
    validation_fraction: float,
    max_corpus_chars: int = 0) -> tuple[dict[str, list[Document]], Reading]:
  """`text_files_documents` and what reading found."""
  _check_args(max_doc_chars, validation_fraction)
  _, files = text_files(pattern)
  reading = Reading(f'text files {pattern!r}')
  splits = {'train': [], 'validation': []}
  blank_pieces = 0
  for relpath, path in _read_files(files, reading, max_corpus_chars).items():
    if path.suffix == '.jsonl':
      before = sum(map(len, splits.values()))
      for line_no, text in _jsonl_texts(path, text_field):
        doc_id = f'{relpath}:{line_no}'
        blank_pieces += _add_chunks(
            splits[_split_of(doc_id, validation_fraction)], doc_id, text,
            max_doc_chars, first_plain=True)
      reading.blank += sum(map(len, splits.values())) == before
      continue
    text, why = _decode(path.read_bytes())
    if text is None:
      reading.skipped.append((relpath, why))
      continue
    reading.blank += not text.strip()
    blank_pieces += _add_chunks(
        splits[_split_of(relpath, validation_fraction)], relpath, text,
        max_doc_chars, first_plain=False)
  logging.info('text files %r: %d files, %d blank pieces and %d files '
               'skipped.', pattern, reading.kept, blank_pieces,
               len(reading.skipped))
  _log_sizes(f'text files {pattern!r}', splits)
  return splits, reading


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
    CorpusError (a ValueError): nothing matches, or a JSON line is bad (the
      message names the file and the line). Binary files (a NUL byte) and
      text files that are not UTF-8 are skipped; `read_text_files` says
      which.
  """
  return read_text_files(pattern, text_field, max_doc_chars,
                         validation_fraction, max_corpus_chars)[0]


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
