"""Tokenized documents on disk: written as a stream, read by range.

A store is a directory:

* `tokens-00000.array_record`, ...: every document's tokens (BOS first)
  concatenated into one stream and cut into records of `chunk_tokens`
  little-endian int32 (the last record may be shorter), written with
  ArrayRecord and read through its `ArrayRecordDataSource` (the data
  source Grain's subclasses; random access by record index, thread-safe;
  riegeli checksums every chunk, so a damaged file fails its read instead
  of returning other tokens);
* `offsets.i64`: raw little-endian int64 [N + 1], document i is
  `stream[offsets[i]:offsets[i + 1]]`; memory-mapped, so a process touches
  only the pages of the documents it reads;
* `store.json`, written last: sizes, files and the sha256 of the tokens and
  offsets (the same digest `TokenDocs.sha256` gives). A directory without it
  is unfinished and is rewritten.

On gs:// (island workers that share only a bucket) a store is written on
local disk and uploaded, `store.json` last; a reader copies it to its own
disk once per content (`_local_copy`): ArrayRecord reads local files. At
C4's size that is the whole split on every worker's disk (docs/islands.md).

Why fixed chunks of the stream and not a record a document: training reads
rows of `seq_len + 1` tokens that cross document boundaries and routing
reads a document's first 32 tokens; with fixed chunks any range costs at
most `ceil(len / chunk_tokens) + 1` record reads whatever the document
lengths (a C4 document runs from a few tokens to 100k).

Memory a process holds: the writer holds one record, the open file's
buffers and nothing per document (offsets are appended to their file); a
reader holds the cache of decoded records (`CACHE_RECORDS` x 16 KiB) and
the offsets pages it touched. Views of a store's documents, and the
training rows cut from them, are in `data/doc_view.py`.
"""

import collections
import hashlib
import json
import os
import pathlib
import shutil
import tempfile
import threading
from typing import Iterable, Sequence

from etils import epath
import numpy as np

from dipaco_jax.data import token_store
from dipaco_jax.store import atomic

STORE_FILE = 'store.json'
OFFSETS_FILE = 'offsets.i64'
CHUNK_TOKENS = 4096  # 16 KiB a record: a training row spans one or two.
RECORDS_PER_FILE = 16384  # 256 MiB files: a few per GB of text.
CACHE_RECORDS = 256  # 4 MiB of decoded records a store keeps.
_FORMAT = 1


class StoreError(ValueError):
  """A store that is missing, unfinished or damaged; says the fix."""


def _is_remote(directory) -> bool:
  return '://' in os.fspath(directory)


def _copy_file(source: epath.Path, target: epath.Path) -> None:
  """Streams one file across (bounded memory: 8 MiB at a time)."""
  with source.open('rb') as src, target.open('wb') as dst:
    shutil.copyfileobj(src, dst, 8 << 20)


def _cache_root() -> pathlib.Path:
  return pathlib.Path(os.environ.get('DIPACO_JAX_STORE_CACHE') or os.path.join(
      tempfile.gettempdir(), 'dipaco_jax_stores'))


def _local_copy(directory: epath.Path, info: dict) -> pathlib.Path:
  """A store on gs:// copied to this machine's disk, once per content
  (ArrayRecord reads local files): under $DIPACO_JAX_STORE_CACHE, by
  default $TMPDIR/dipaco_jax_stores. Copied to a temporary name, then
  renamed, so that a copy cut short is never read."""
  key = hashlib.sha256(f'{directory}|{info["sha256"]}'.encode()).hexdigest()
  local = _cache_root() / key[:24]
  if (local / STORE_FILE).exists():
    return local
  local.parent.mkdir(parents=True, exist_ok=True)
  partial = pathlib.Path(tempfile.mkdtemp(prefix=local.name + '.',
                                          dir=local.parent))
  names = [name for name, _ in info['files']] + [OFFSETS_FILE, STORE_FILE]
  for name in names:  # store.json last: it marks the copy whole.
    _copy_file(directory / name, epath.Path(partial) / name)
  try:
    os.rename(partial, local)
  except OSError:  # Another process copied it first.
    shutil.rmtree(partial, ignore_errors=True)
  return local


class DocStoreWriter:
  """Appends documents to a new store; `close()` finishes it.

  Memory: one record of tokens, the files' buffers; nothing per document.
  """

  def __init__(self, directory: str | os.PathLike[str],
               chunk_tokens: int = CHUNK_TOKENS,
               records_per_file: int = RECORDS_PER_FILE):
    # Imported here: only writing and reading stores needs ArrayRecord.
    from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
    self._module = array_record_module
    # On gs:// the store is written here first, then uploaded by `close`.
    self._target = epath.Path(directory)
    if _is_remote(self._target):
      self._dir = epath.Path(tempfile.mkdtemp(prefix='dipaco_jax_store_'))
      (self._target / STORE_FILE).unlink(missing_ok=True)
    else:
      self._dir = self._target
    if chunk_tokens <= 0 or records_per_file <= 0:
      raise ValueError('chunk_tokens and records_per_file must be > 0.')
    self._dir.mkdir(parents=True, exist_ok=True)
    (self._dir / STORE_FILE).unlink(missing_ok=True)  # Unfinished from now.
    for old in self._dir.glob('tokens-*.array_record'):
      old.unlink()
    self._chunk = chunk_tokens
    self._records_per_file = records_per_file
    self._pending = []  # Token arrays not yet in a record.
    self._pending_size = 0
    self._files = []  # [name, records]
    self._writer = None
    self._num_docs = 0
    self._num_tokens = 0
    self._token_hash = hashlib.sha256(b'tokens:int32<')
    self._offsets = open(self._dir / OFFSETS_FILE, 'wb')  # pylint: disable=consider-using-with
    self._offsets.write(np.zeros(1, '<i8').tobytes())

  def add(self, tokens: np.ndarray) -> None:
    """Appends one document (its tokens, BOS included)."""
    tokens = np.asarray(tokens).astype('<i4', copy=False).reshape(-1)
    self._token_hash.update(tokens.tobytes())
    self._num_docs += 1
    self._num_tokens += tokens.size
    self._offsets.write(np.array([self._num_tokens], '<i8').tobytes())
    self._pending.append(tokens)
    self._pending_size += tokens.size
    if self._pending_size >= self._chunk:
      stream = np.concatenate(self._pending)
      full = stream.size // self._chunk * self._chunk
      for start in range(0, full, self._chunk):
        self._write_record(stream[start:start + self._chunk])
      self._pending = [stream[full:]]
      self._pending_size = stream.size - full

  def add_all(self, docs: Iterable[np.ndarray]) -> None:
    for tokens in docs:
      self.add(tokens)

  def _write_record(self, tokens: np.ndarray) -> None:
    if self._writer is None or self._files[-1][1] >= self._records_per_file:
      if self._writer is not None:
        self._writer.close()
      name = f'tokens-{len(self._files):05d}.array_record'
      # group_size:1, uncompressed: a record is read alone, without its
      # neighbours (token ids do not compress much anyway).
      self._writer = self._module.ArrayRecordWriter(
          os.fspath(self._dir / name), 'group_size:1,uncompressed')
      self._files.append([name, 0])
    self._writer.write(tokens.tobytes())
    self._files[-1][1] += 1

  def close(self) -> 'DocStore':
    """Writes the last record, the offsets and `store.json` (last)."""
    if self._pending_size:
      self._write_record(np.concatenate(self._pending))
    self._pending, self._pending_size = [], 0
    if self._writer is not None:
      self._writer.close()
    self._offsets.close()
    # The offsets are hashed from their file: nothing per document is kept.
    digest = self._token_hash.copy()
    digest.update(b'offsets:int64<')
    with open(self._dir / OFFSETS_FILE, 'rb') as f:
      for block in iter(lambda: f.read(1 << 20), b''):
        digest.update(block)
    atomic.write_json(self._dir / STORE_FILE, {
        'format': _FORMAT, 'num_documents': self._num_docs,
        'num_tokens': self._num_tokens, 'chunk_tokens': self._chunk,
        'files': self._files, 'sha256': digest.hexdigest()}, indent=1)
    if self._target != self._dir:  # gs://: upload, store.json last.
      self._target.mkdir(parents=True, exist_ok=True)
      for name in [n for n, _ in self._files] + [OFFSETS_FILE, STORE_FILE]:
        _copy_file(self._dir / name, self._target / name)
      shutil.rmtree(self._dir, ignore_errors=True)
    return DocStore(self._target)


def write_token_docs(directory: str | os.PathLike[str],
                     docs: token_store.TokenDocs,
                     chunk_tokens: int = CHUNK_TOKENS) -> 'DocStore':
  """A store holding `docs` (in-memory documents, e.g. in tests)."""
  writer = DocStoreWriter(directory, chunk_tokens)
  writer.add_all(docs.doc(i) for i in range(len(docs)))
  return writer.close()


_OPEN = {}
_OPEN_LOCK = threading.Lock()


def open_store(directory: str | os.PathLike[str]) -> 'DocStore':
  """The store at `directory`, opened once a process (every path's shard
  of a run shares one reader and one record cache); reopened when its
  `store.json` changed (the data stage ran again)."""
  if _is_remote(directory):  # Its store.json's digest says if it changed.
    key = os.fspath(directory)
    try:
      stamp = json.loads((epath.Path(directory) / STORE_FILE).read_text()
                         ).get('sha256')
    except (OSError, ValueError):
      stamp = None
  else:
    key = os.path.realpath(os.fspath(directory))
    try:
      stamp = os.stat(os.path.join(key, STORE_FILE)).st_mtime_ns
    except OSError:
      stamp = None
  with _OPEN_LOCK:
    cached = _OPEN.get(key)
    if cached is None or cached[0] != stamp:
      cached = (stamp, DocStore(key))
      _OPEN[key] = cached
    return cached[1]


class DocStore:
  """A finished store, opened for reading (module docstring: layout)."""

  def __init__(self, directory: str | os.PathLike[str]):
    self.directory = epath.Path(directory)
    path = self.directory / STORE_FILE
    try:
      info = json.loads(path.read_text())
    except FileNotFoundError as e:
      raise StoreError(f'{path} is missing: the token store in '
                       f'{self.directory} was never finished. Rerun the data '
                       'stage (delete the directory first).') from e
    except (OSError, ValueError) as e:
      raise StoreError(f'Cannot read {path} ({e}). Delete {self.directory} '
                       'and rerun the data stage.') from e
    self.num_docs = int(info['num_documents'])
    self.num_tokens = int(info['num_tokens'])
    self.chunk_tokens = int(info['chunk_tokens'])
    self.sha256 = str(info['sha256'])
    self._files = [name for name, _ in info['files']]
    # Where the files are read: the store itself, or its local copy.
    self._local = (epath.Path(_local_copy(self.directory, info))
                   if _is_remote(self.directory) else self.directory)
    offsets_path = self._local / OFFSETS_FILE
    size = (os.path.getsize(offsets_path) if offsets_path.exists() else -1)
    if size != 8 * (self.num_docs + 1):
      raise StoreError(
          f'{offsets_path} holds {max(size, 0) // 8} offsets, not the '
          f'{self.num_docs + 1} {STORE_FILE} names: the store is damaged. '
          f'Delete {self.directory} and rerun the data stage.')
    self.offsets = np.memmap(offsets_path, dtype='<i8', mode='r',
                             shape=(self.num_docs + 1,))
    self._source = None
    self._cache = collections.OrderedDict()
    self._lock = threading.Lock()

  def __getstate__(self):
    return {'directory': os.fspath(self.directory)}

  def __setstate__(self, state):
    self.__init__(state['directory'])

  def __len__(self) -> int:
    return self.num_docs

  def _records(self, ids: Sequence[int]) -> dict[int, np.ndarray]:
    """Records `ids` decoded, through the cache."""
    with self._lock:
      out = {}
      missing = []
      for i in ids:
        if i in self._cache:
          self._cache.move_to_end(i)
          out[i] = self._cache[i]
        else:
          missing.append(i)
      if missing:
        if self._source is None:
          # ArrayRecord's own data source, which Grain's subclasses (for
          # its usage counters): importing Grain costs a process 1 s and
          # about 180 MB, for the same reader.
          from array_record.python import array_record_data_source  # pylint: disable=g-import-not-at-top
          self._source = array_record_data_source.ArrayRecordDataSource(
              [os.fspath(self._local / name) for name in self._files])
        try:
          raw = self._source.__getitems__(missing)
        except Exception as e:  # pylint: disable=broad-except
          raise StoreError(
              f'Cannot read records of {self.directory} ({type(e).__name__}:'
              f' {e}). Delete it and rerun the data stage.') from e
        for i, data in zip(missing, raw):
          record = np.frombuffer(data, dtype='<i4')
          out[i] = record
          self._cache[i] = record
        while len(self._cache) > CACHE_RECORDS:
          self._cache.popitem(last=False)
      return out

  def read_ranges(self, starts: np.ndarray,
                  stops: np.ndarray) -> list[np.ndarray]:
    """Stream ranges [starts[i], stops[i]), int32, in one batched read."""
    starts = np.asarray(starts, np.int64).reshape(-1)
    stops = np.asarray(stops, np.int64).reshape(-1)
    if starts.size and (starts.min() < 0 or stops.max() > self.num_tokens
                        or np.any(stops < starts)):
      raise IndexError(f'token ranges out of [0, {self.num_tokens}].')
    c = self.chunk_tokens
    wanted = set()
    for a, b in zip(starts.tolist(), stops.tolist()):
      if b > a:
        wanted.update(range(a // c, (b - 1) // c + 1))
    records = self._records(sorted(wanted))
    out = []
    for a, b in zip(starts.tolist(), stops.tolist()):
      if b <= a:
        out.append(np.zeros(0, np.int32))
        continue
      first, last = a // c, (b - 1) // c
      if first == last:
        piece = records[first][a - first * c:b - first * c]
      else:
        piece = np.concatenate([records[r] for r in range(first, last + 1)])[
            a - first * c:b - first * c]
      out.append(piece.astype(np.int32))
    return out
