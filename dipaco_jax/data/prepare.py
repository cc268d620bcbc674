"""The data stage: corpus -> tokenizer -> token documents, cached in workdir.

Output (under `{workdir}/data/`): `train.npz`, `validation.npz` (TokenDocs),
`units.npz` (per split, each document's split unit: its file, see
`corpora.unit_of`) and `info.json` with the corpus fingerprint and
tokenizer hash. A second run
with the same data config reuses them without reading the corpus again.
"""

import dataclasses
import hashlib
import json

from absl import logging
from etils import epath

from dipaco_jax.data import corpora
from dipaco_jax.data import token_store
from dipaco_jax.data import tokenizer as tokenizer_lib
from dipaco_jax.store import atomic

_SPLITS = ("train", "validation")


@dataclasses.dataclass
class DataBundle:
  tokenizer: tokenizer_lib.Tokenizer
  docs: dict  # split -> TokenDocs
  hashes: dict  # corpus, tokenizer
  units: dict  # split -> int64 [N]: the file (split unit) of each document

  @property
  def vocab_size(self) -> int:
    return self.tokenizer.vocab_size


def _data_key(data_config) -> str:
  fields = {k: data_config[k] for k in (
      "corpus", "text_glob", "text_field", "max_doc_chars",
      "max_corpus_chars", "validation_fraction", "max_documents",
      "vocab_size", "tokenizer_model", "tokenizer_max_sentences")}
  fields["format"] = 2  # 2: units.npz (older data dirs are redone).
  return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()
                        ).hexdigest()[:16]


def read_corpus(data_config) -> dict:
  d = data_config
  if d.corpus == "python_stdlib":
    return corpora.python_stdlib_documents(d.max_doc_chars,
                                           d.validation_fraction,
                                           d.max_corpus_chars)
  if d.corpus == "text_files":
    return corpora.text_files_documents(d.text_glob, d.text_field,
                                        d.max_doc_chars,
                                        d.validation_fraction,
                                        d.max_corpus_chars)
  if d.corpus == "c4":
    from dipaco_jax.data import c4  # pylint: disable=g-import-not-at-top
    docs = {split: [corpora.Document(*doc) for doc in c4.c4_documents(
        split, d.max_documents)] for split in _SPLITS}
    return docs
  raise ValueError(f"config.data.corpus: unknown corpus {d.corpus!r}")


def prepare_data(data_config, workdir: str, seed: int) -> DataBundle:
  """Runs (or reuses) the data stage."""
  out = epath.Path(workdir) / "data"
  info_path = out / "info.json"
  key = _data_key(data_config)
  if info_path.exists():
    info = json.loads(info_path.read_text())
    if info.get("key") == key:
      tok = tokenizer_lib.Tokenizer.load(info["tokenizer_path"])
      docs = {s: token_store.TokenDocs.load(out / f"{s}.npz")
              for s in _SPLITS}
      units = token_store.load_npz(out / "units.npz", _SPLITS)
      print(f"[data] reusing {out}: " + ", ".join(
          f"{s} {len(docs[s]):,} docs / {docs[s].num_tokens:,} tokens"
          for s in _SPLITS), flush=True)
      return DataBundle(tok, docs, info["hashes"], units)
  print(f"[data] reading corpus {data_config.corpus!r}", flush=True)
  splits = read_corpus(data_config)
  for split in _SPLITS:
    if not splits.get(split):
      raise ValueError(
          f"The {split} split of corpus {data_config.corpus!r} is empty; "
          "raise config.data.max_corpus_chars or "
          "config.data.validation_fraction.")
  fingerprint = corpora.corpus_fingerprint(splits)
  tok = tokenizer_lib.load_or_train_tokenizer(
      workdir, lambda: (doc.text for doc in splits["train"]),
      data_config.vocab_size, data_config.tokenizer_model, seed,
      data_config.tokenizer_max_sentences)
  print(f"[data] tokenizer: {tok.vocab_size} pieces", flush=True)
  docs = {s: token_store.encode_documents(
      tok, [doc.text for doc in splits[s]], tok.vocab_size) for s in _SPLITS}
  out.mkdir(parents=True, exist_ok=True)
  for s in _SPLITS:
    docs[s].save(out / f"{s}.npz")
  units = {s: corpora.unit_ids([doc.doc_id for doc in splits[s]])
           for s in _SPLITS}
  token_store.save_npz(out / "units.npz", **units)
  hashes = {"corpus": fingerprint[:16], "tokenizer": tok.sha256[:16]}
  tokenizer_path = (epath.Path(data_config.tokenizer_model)
                    if data_config.tokenizer_model else
                    epath.Path(workdir) / "tokenizer" / "spm.model")
  atomic.write_text(info_path, json.dumps({
      "key": key, "hashes": hashes, "tokenizer_path": str(tokenizer_path),
      **{f"{s}_documents": len(docs[s]) for s in _SPLITS},
      **{f"{s}_tokens": docs[s].num_tokens for s in _SPLITS}}, indent=1))
  for s in _SPLITS:
    print(f"[data] {s}: {len(docs[s]):,} docs, {docs[s].num_tokens:,} "
          "tokens", flush=True)
  logging.info("Data stage wrote %s", out)
  return DataBundle(tok, docs, hashes, units)
