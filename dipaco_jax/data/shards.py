"""Per-path shards of tokenized documents, with a manifest.

Each path p trains on `shard_{p:05d}.npz` (its documents as `TokenDocs`,
plus `doc_indices`: where each came from in the full corpus). A dense run
has one shard. `manifest.json` lists the shards with their sizes and content
hashes and the hashes of what produced them (corpus, tokenizer, router).

The manifest is written last and atomically: a directory without one is
unfinished, so an interrupted write is redone, never half-used (DESIGN
invariant 5). Checkpoints record the shard hashes (invariant 4), and
`load_shard` checks each file against its hash.
"""

import hashlib
import json
from typing import Sequence

from absl import logging
from etils import epath
import numpy as np

from dipaco_jax.data import token_store
from dipaco_jax.store import atomic

MANIFEST = 'manifest.json'


def shard_file(index: int) -> str:
  return f'shard_{index:05d}.npz'


def _shard_sha256(docs: token_store.TokenDocs,
                  doc_indices: np.ndarray) -> str:
  """Content hash of a shard (npz bytes carry timestamps, so not those)."""
  h = hashlib.sha256(docs.sha256().encode('ascii'))
  h.update(b'doc_indices:int64<')
  h.update(np.asarray(doc_indices).astype('<i8', copy=False).tobytes())
  return h.hexdigest()


def write_shards(directory: str, token_docs: token_store.TokenDocs,
                 doc_indices_per_shard: Sequence[np.ndarray],
                 hashes: dict[str, str]) -> dict:
  """Writes one shard per path, then the manifest.

  Args:
    directory: the output directory (created if needed).
    token_docs: all documents.
    doc_indices_per_shard: for each shard, the indices into `token_docs` of
      its documents, in order.
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
  lengths = token_docs.lengths()
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
  entries = []
  for index, ix in enumerate(indices_per_shard):
    docs = token_docs.subset(ix)
    token_store.save_npz(directory / shard_file(index), tokens=docs.tokens,
                         offsets=docs.offsets, doc_indices=ix)
    entries.append({
        'index': index,
        'file': shard_file(index),
        'num_documents': len(docs),
        'num_tokens': docs.num_tokens,
        'sha256': _shard_sha256(docs, ix),
    })
  manifest = {'num_shards': len(entries), 'shards': entries,
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
    directory: str, index: int) -> tuple[token_store.TokenDocs, np.ndarray]:
  """Shard `index` and its `doc_indices`, checked against the manifest."""
  manifest = read_manifest(directory)
  if manifest is None:
    raise ValueError(f'No {MANIFEST} in {directory}: the shards were never '
                     'finished. Rerun the sharding stage.')
  if not 0 <= index < manifest['num_shards']:
    raise ValueError(f'Shard {index} does not exist in {directory} (it has '
                     f'{manifest["num_shards"]}); the number of paths must '
                     'match the shards.')
  entry = manifest['shards'][index]
  path = epath.Path(directory) / entry['file']
  arrays = token_store.load_npz(path, ('tokens', 'offsets', 'doc_indices'))
  try:
    docs = token_store.TokenDocs(arrays['tokens'], arrays['offsets'])
  except ValueError as e:
    raise ValueError(f'{path} is corrupt ({e}). Delete {directory} and rerun '
                     'the sharding stage.') from e
  digest = _shard_sha256(docs, arrays['doc_indices'])
  if digest != entry['sha256']:
    raise ValueError(
        f'{path} does not match its sha256 in the manifest ({digest} vs '
        f'{entry["sha256"]}): it was changed after writing. Delete '
        f'{directory} and rerun the sharding stage.')
  return docs, arrays['doc_indices']


def load_shard(directory: str, index: int) -> token_store.TokenDocs:
  """Shard `index` as `TokenDocs`, checked against the manifest's sha256."""
  return load_shard_with_indices(directory, index)[0]
