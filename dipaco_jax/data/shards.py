"""Per-path shards: index files into the token store, with a manifest.

Each path p trains on `shard_{p:05d}.npz`, which holds `doc_indices` only:
which documents of the split's token store (`data/doc_store.py`) are its,
in order. Nothing is copied: a shard costs 8 bytes a document on disk, and
training reads its rows from the store (`doc_view.StreamRows`). A dense
run has one shard. `manifest.json` lists the shards with their sizes and
hashes, names the store and its sha256, and records the hashes of what
produced them (corpus, tokenizer, router).

The manifest is written last and atomically: a directory without one is
unfinished, so an interrupted write is redone, never half-used (DESIGN
invariant 5). Checkpoints record the shard hashes (invariant 4), and
`load_shard` checks each index file against its hash and the store against
the manifest's (riegeli checksums the store's records as they are read).
"""

import hashlib
import json
import os
from typing import Sequence

from absl import logging
from etils import epath
import numpy as np

from dipaco_jax.data import doc_store
from dipaco_jax.data import doc_view
from dipaco_jax.data import token_store
from dipaco_jax.store import atomic

MANIFEST = 'manifest.json'
_STORE_DIR = 'docs'  # In-memory documents given to `write_shards` go here.


def shard_file(index: int) -> str:
  return f'shard_{index:05d}.npz'


def _shard_sha256(store_sha256: str, store_indices: np.ndarray) -> str:
  """A shard's hash: its store's content and its documents' indices."""
  h = hashlib.sha256(store_sha256.encode('ascii'))
  h.update(b'doc_indices:int64<')
  h.update(np.asarray(store_indices).astype('<i8', copy=False).tobytes())
  return h.hexdigest()


def _store_reference(store_dir, directory) -> str:
  """Where the manifest says the store is: relative to the shards on a
  local disk (a moved work directory still finds it), whole on gs://
  (object names have no `..`)."""
  if '://' in os.fspath(store_dir) or '://' in os.fspath(directory):
    return os.fspath(store_dir)
  return os.path.relpath(os.fspath(store_dir), os.fspath(directory))


def write_shards(directory: str,
                 docs: doc_view.DocView | token_store.TokenDocs,
                 doc_indices_per_shard: Sequence[np.ndarray],
                 hashes: dict[str, str]) -> dict:
  """Writes one index file per path, then the manifest.

  Args:
    directory: the output directory (created if needed).
    docs: all documents, as a view of a token store (the data stage's); in
      memory (tests, generated text) they are first written to a store in
      `directory/docs`.
    doc_indices_per_shard: for each shard, the indices into `docs` of its
      documents, in order.
    hashes: provenance recorded in the manifest (e.g. corpus, tokenizer,
      router hashes).

  Returns:
    The manifest dict (also written to `manifest.json`).

  Raises:
    ValueError: a shard would be empty (checked before anything is written).
  """
  directory = epath.Path(directory)
  indices_per_shard = [np.asarray(ix, dtype=np.int64).reshape(-1)
                       for ix in doc_indices_per_shard]
  if not indices_per_shard:
    raise ValueError('write_shards needs at least one shard.')
  lengths = docs.lengths()
  for index, ix in enumerate(indices_per_shard):
    if ix.size == 0 or lengths[ix].sum() == 0:
      raise ValueError(
          f'Shard {index} of {len(indices_per_shard)} would be empty (no '
          'documents routed to it). Use fewer paths, more data '
          '(config.data.max_corpus_chars), or a lower config.data.seq_len.')
  directory.mkdir(parents=True, exist_ok=True)
  manifest_path = directory / MANIFEST
  if manifest_path.exists():
    # From here on the directory is unfinished until the new manifest lands.
    manifest_path.unlink()
  if not isinstance(docs, doc_view.DocView):
    docs = doc_view.DocView(
        doc_store.write_token_docs(directory / _STORE_DIR, docs))
  entries = []
  for index, ix in enumerate(indices_per_shard):
    store_ix = docs.store_indices(ix)
    token_store.save_npz(directory / shard_file(index), doc_indices=ix,
                         store_indices=store_ix)
    entries.append({
        'index': index,
        'file': shard_file(index),
        'num_documents': int(ix.size),
        'num_tokens': int(lengths[ix].sum()),
        'sha256': _shard_sha256(docs.store.sha256, store_ix),
    })
  manifest = {'num_shards': len(entries), 'shards': entries,
              'store': _store_reference(docs.store.directory, directory),
              'store_sha256': docs.store.sha256,
              'hashes': dict(hashes)}
  atomic.write_json(manifest_path, manifest, indent=2)
  logging.info('Wrote %d shards to %s (tokens per shard: %s).', len(entries),
               directory, [e['num_tokens'] for e in entries])
  return manifest


def read_manifest(directory: str) -> dict | None:
  """The manifest, or None when the directory has none (not done yet)."""
  path = epath.Path(directory) / MANIFEST
  if not path.exists():
    return None
  try:
    return json.loads(path.read_text())
  except (OSError, json.JSONDecodeError) as e:
    raise ValueError(f'Cannot read {path} ({e}). Delete {directory} and '
                     'rerun the sharding stage.') from e


def load_shard_with_indices(
    directory: str, index: int) -> tuple[doc_view.DocView, np.ndarray]:
  """Shard `index` (a view of the store) and its `doc_indices`, checked
  against the manifest."""
  manifest = read_manifest(directory)
  if manifest is None:
    raise ValueError(f'No {MANIFEST} in {directory}: the shards were never '
                     'finished. Rerun the sharding stage.')
  if 'store' not in manifest:
    raise ValueError(f'{directory} holds shards of an older format (copies, '
                     'not index files). Delete it and rerun.')
  if not 0 <= index < manifest['num_shards']:
    raise ValueError(f'Shard {index} does not exist in {directory} (it has '
                     f'{manifest["num_shards"]}); the number of paths must '
                     'match the shards.')
  entry = manifest['shards'][index]
  path = epath.Path(directory) / entry['file']
  arrays = token_store.load_npz(path, ('doc_indices', 'store_indices'))
  store = doc_store.open_store(
      manifest['store'] if '://' in manifest['store'] else
      epath.Path(directory) / manifest['store'])
  if store.sha256 != manifest['store_sha256']:
    raise ValueError(
        f'The token store {store.directory} is not the one the shards in '
        f'{directory} index (sha256 {store.sha256[:16]} vs '
        f'{manifest["store_sha256"][:16]}): the data stage was rerun since. '
        f'Delete {directory} and rerun the sharding stage.')
  digest = _shard_sha256(store.sha256, arrays['store_indices'])
  if digest != entry['sha256']:
    raise ValueError(
        f'{path} does not match its sha256 in the manifest ({digest} vs '
        f'{entry["sha256"]}): it was changed after writing. Delete '
        f'{directory} and rerun the sharding stage.')
  try:
    docs = doc_view.DocView(store, arrays['store_indices'])
  except IndexError as e:
    raise ValueError(f'{path} is corrupt ({e}). Delete {directory} and rerun '
                     'the sharding stage.') from e
  return docs, arrays['doc_indices']


def load_shard(directory: str, index: int) -> doc_view.DocView:
  """Shard `index` as a view of the store, checked against the manifest."""
  return load_shard_with_indices(directory, index)[0]
