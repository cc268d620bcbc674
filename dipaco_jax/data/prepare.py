"""The data stage: corpus -> tokenizer -> token documents, cached in workdir.

Output (under `{workdir}/data/`): `train/`, `validation/` (token stores,
`data/doc_store.py`), `units.npz` (per split, each document's split unit:
its file, see `corpora.unit_of`), `manifest.json` (the corpus files' sizes,
times and sha256, see `corpus_manifest.file_manifest`) and `info.json`,
written last, with the stage's key, the corpus fingerprint and the
tokenizer hash.

Streaming. The corpus is never held: it is read as a stream of (split,
document), one file (or TFDS record) at a time, in up to three passes: a
scan (document counts, split units, the fingerprint, empty splits refused),
the tokenizer's training lines (only when a tokenizer is trained), and the
encoding, `_ENCODE_BATCH_CHARS` at a time, into the stores. What the stage
holds grows with the number of files and documents (8 bytes a document for
the units), not with their text.

Keying. The stage is reused when its key is the one in `info.json`; the key
covers the data config fields that shape the documents
(`DATA_STAGE_FIELDS`), `_FORMAT` (raised when the same files are read into
other text) and a fingerprint of the inputs taken BEFORE reading the
corpus: for `text_files` and `python_stdlib` the names, sizes and bytes of
every file found, or why it cannot be read (a file edited, added, removed
or made readable changes it; a file only touched does not), for `c4` the
TFDS name and version, and the bytes of `data.tokenizer_model` if given.
The trained tokenizer is keyed by a hash of the train split's text and its
own settings (`tokenizer.load_or_train_tokenizer`), so a changed corpus
retrains it.
The corpus fingerprint and the tokenizer hash (`DataBundle.hashes`) go into
every later stage's key and into the checkpoints, so everything after a
changed corpus is recomputed (`stages/experiment.py`).
"""

import dataclasses
import hashlib
import json
import os

from absl import logging
from etils import epath

from dipaco_jax.data import corpora
from dipaco_jax.data import corpus_files
from dipaco_jax.data import corpus_stream
from dipaco_jax.data import corpus_manifest
from dipaco_jax.data import doc_store
from dipaco_jax.data import doc_view
from dipaco_jax.data import token_store
from dipaco_jax.data import tokenizer as tokenizer_lib
from dipaco_jax.store import atomic

_SPLITS = ("train", "validation")
# 2: units.npz; 3: inputs fingerprint; 4: a file with a few undecodable
# bytes is read with them replaced, no longer skipped (same files, other
# text); 5: token stores on disk, a streamed fingerprint. Older data dirs
# are redone.
_FORMAT = 5
_SHOW_SKIPPED = 5  # File names listed in a `[data] skipped` line.

# The data config fields that shape the documents and the tokenizer: they
# reach training only through `DataBundle.hashes`.
DATA_STAGE_FIELDS = (
    "corpus", "text_glob", "text_field", "max_doc_chars", "max_corpus_chars",
    "validation_fraction", "max_documents", "vocab_size", "tokenizer_model",
    "tokenizer_max_sentences", "selection_split")


@dataclasses.dataclass
class DataBundle:
  tokenizer: tokenizer_lib.Tokenizer
  docs: dict  # split -> doc_view.DocView of the split's token store
  hashes: dict  # corpus, tokenizer
  units: dict  # split -> int64 [N]: the file (split unit) of each document

  @property
  def vocab_size(self) -> int:
    return self.tokenizer.vocab_size


def _short_hash(obj) -> str:
  return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()
                        ).hexdigest()[:16]


def _config_key(data_config) -> str:
  fields = {k: data_config.get(k, False) for k in DATA_STAGE_FIELDS}
  if not fields["selection_split"]:  # Data stages from before it: reused.
    del fields["selection_split"]
  fields["format"] = _FORMAT
  return _short_hash(fields)


def _read_json(path: epath.Path) -> dict:
  """The JSON object at `path`, or {} if absent or unreadable (a cache
  that cannot be read is recomputed, never an error)."""
  try:
    return json.loads(path.read_text()) if path.exists() else {}
  except (OSError, ValueError):
    return {}


def corpus_inputs(data_config, previous: dict) -> tuple[dict, dict]:
  """Fingerprints of what the data stage reads, without reading it all.

  Args:
    data_config: `config.data`.
    previous: the file record of the last run (`data/manifest.json`), so
      that only changed files are read (`corpus_manifest.file_manifest`).

  Returns:
    (inputs, record): inputs is {"corpus": ..., "tokenizer_model": ...},
    hex fingerprints; record is the new file record.

  Raises:
    corpora.CorpusError: no file matches `data.text_glob`.
  """
  d = data_config
  record = {}
  if d.corpus == "text_files":
    corpus, record = corpus_manifest.file_manifest(
        corpus_files.text_files(d.text_glob)[1], previous)
  elif d.corpus == "python_stdlib":
    corpus, record = corpus_manifest.file_manifest(corpus_files.stdlib_files()[1],
                                           previous)
  elif d.corpus == "c4":
    from dipaco_jax.data import c4  # pylint: disable=g-import-not-at-top
    # A TFDS version is immutable: its name is its content.
    corpus = f"tfds:{c4.DEFAULT_TFDS_NAME}"
  else:
    raise corpora.CorpusError(
        f"config.data.corpus: unknown corpus {d.corpus!r}; use "
        "python_stdlib, text_files or c4.")
  tokenizer = ""
  if d.tokenizer_model:
    # The given model's bytes: a file replaced at the same path must not
    # leave documents encoded by the old one. Its record entry is kept with
    # the corpus files'.
    tokenizer, entry = corpus_manifest.file_manifest(
        {"tokenizer_model": epath.Path(d.tokenizer_model)}, previous)
    record.update(entry)
  return {"corpus": corpus, "tokenizer_model": tokenizer}, record


# --- Messages ----------------------------------------------------------------


def _names(items, limit: int = _SHOW_SKIPPED) -> str:
  shown = ", ".join(items[:limit])
  return shown + (f", and {len(items) - limit} more" if len(items) > limit
                  else "")


def skipped_line(reading: corpora.Reading) -> str:
  """`[data] skipped 2 of 14 files: a.txt (dangling link), b.bin (binary);
  read 12 of the 14 matched by '/d/*'`, or '' if none. Counted against
  every file found, so each one is either read, named or left out by the
  cap (said too)."""
  if not reading.skipped:
    return ""
  n = reading.matched
  capped = n - reading.read - len(reading.skipped)
  return (f"[data] skipped {len(reading.skipped):,} of {n:,} files: "
          + _names([f"{name} ({why})"
                    for name, why in sorted(reading.skipped)])
          + f"; read {reading.read:,} of the {n:,} {reading.found_by}"
          + (f" ({capped:,} left out by config.data.max_corpus_chars)"
             if capped else ""))


def replaced_line(reading: corpora.Reading) -> str:
  """`[data] replaced 3 undecodable bytes with U+FFFD in 1 file: a.txt
  (3)`, or '' if none."""
  if not reading.replaced:
    return ""
  total = sum(count for _, count in reading.replaced)
  return (f"[data] replaced {_count(total, 'undecodable byte')} with U+FFFD "
          f"in {_count(len(reading.replaced), 'file')}: "
          + _names([f"{name} ({count:,})"
                    for name, count in reading.replaced]))


def _count(n: int, what: str) -> str:
  return f"{n:,} {what}{'' if n == 1 else 's'}"


def _found(reading: corpora.Reading | None, scan: corpus_stream.Scan) -> str:
  counts = ", ".join(f"{s} {scan.num_docs[s]:,}" for s in _SPLITS)
  if reading is None:
    return f"Documents per split: {counts}."
  skipped = f", {len(reading.skipped)} skipped" if reading.skipped else ""
  blank = f", {reading.blank} blank" if reading.blank else ""
  return (f"Found in {reading.source}: {_count(reading.matched, 'file')}, "
          f"{reading.kept:,} read ({_count(reading.bytes_read, 'byte')})"
          f"{skipped}{blank}; documents per split: {counts}.")


def _fix(data_config, reading: corpora.Reading | None,
         scan: corpus_stream.Scan, empty: str) -> str:
  """What to change so that the `empty` split gets documents."""
  d = data_config
  if reading is None:  # c4
    return ("Read more documents (config.data.max_documents, 0 = all) or "
            "check the TFDS copy of C4.")
  if (reading.kept == 0 and d.max_corpus_chars > 0
      and len(reading.skipped) < reading.matched):  # Some file could fit.
    return (f"config.data.max_corpus_chars={d.max_corpus_chars:,} is "
            f"smaller than every file (the smallest has "
            f"{reading.smallest:,} bytes): raise it (0 = no cap).")
  units = scan.unit_names
  if not units["train"] and not units["validation"]:
    if reading.skipped and not reading.read:
      # The kind only: 'unreadable: Permission denied' -> 'unreadable'.
      kinds = sorted({why.split(":")[0] for _, why in reading.skipped})
      return (f"Every file read was skipped ({', '.join(kinds)}): the "
              "corpus must be UTF-8 text (.txt, .py, .md, ... or .jsonl); "
              "point config.data.text_glob at such files.")
    return ("The files read hold no text (blank or skipped): point "
            "config.data.text_glob at files with text.")
  if empty == "validation" and d.validation_fraction == 0:
    return ("config.data.validation_fraction is 0: set it > 0 (e.g. 0.05) "
            "to hold out validation files.")
  other = "train" if empty == "validation" else "validation"
  n = len(units[other])
  if reading.kept < reading.matched and d.max_corpus_chars > 0:
    fix = (f"raise config.data.max_corpus_chars (now "
           f"{d.max_corpus_chars:,}: it keeps {reading.kept} of "
           f"{_count(reading.matched, 'file')})")
  elif n < 2:
    fix = "use at least 2 files" + (
        " (add files to config.data.text_glob, or split the text into "
        "several files or .jsonl lines)" if d.corpus == "text_files" else "")
  else:
    fix = (f"{'raise' if empty == 'validation' else 'lower'} "
           "config.data.validation_fraction, or add files")
  went = (f"the only one went to {other}" if n == 1 else
          f"all {n} went to {other}")
  return (f"The split is by file (by line in .jsonl files) and {went}: "
          f"{fix}.")


def check_splits(data_config, scan: corpus_stream.Scan,
                 reading: corpora.Reading | None) -> None:
  """Raises CorpusError, saying what was found and the fix, when a split
  is empty (both are needed: train to train, validation to evaluate)."""
  empty = [s for s in _SPLITS if not scan.num_docs[s]]
  if not empty:
    return
  which = " and ".join(empty)
  raise corpora.CorpusError(
      f"The {which} split{'s are' if len(empty) > 1 else ' is'} empty "
      f"(config.data.corpus={data_config.corpus!r}). "
      + _found(reading, scan) + " " + _fix(data_config, reading, scan,
                                           empty[0]))


def _changes(before: dict, after: dict) -> str:
  """'2 files changed, 1 added' between two file records (by name)."""
  old = {v[0]: v[4] for v in before.values()}
  new = {v[0]: v[4] for v in after.values()}
  counts = [(sum(old[k] != new[k] for k in old.keys() & new.keys()),
             "changed"), (len(new.keys() - old.keys()), "added"),
            (len(old.keys() - new.keys()), "removed")]
  parts = [f"{n} {what}" for n, what in counts if n]
  if parts:
    n = parts[0].split()[0]
    parts[0] = parts[0].replace(" ", " file " if n == "1" else " files ", 1)
  return ", ".join(parts)


def _why_again(info: dict, key: str, config_key: str, inputs: dict,
               previous: dict, record: dict) -> str:
  """Why the stored data is not reused, for the `[data]` line."""
  if not info:
    return ""
  if info.get("key") == key:
    return ": its tokenizer was replaced since"
  # Written since format 4: before it, the format was in config_key only.
  if info.get("format", 3) != _FORMAT:
    return ": data/ was made by an older version"
  reasons = []
  if info.get("config_key") != config_key:
    reasons.append("config.data changed")
  if info.get("inputs", {}).get("corpus") != inputs["corpus"]:
    changes = _changes(previous, record)
    reasons.append("the corpus changed" + (f" ({changes})" if changes
                                           else ""))
  if info.get("inputs", {}).get("tokenizer_model") != (
      inputs["tokenizer_model"]):
    reasons.append("config.data.tokenizer_model's file changed")
  return f": {'; '.join(reasons)}" if reasons else ""


# --- The stage ---------------------------------------------------------------

def _load(out: epath.Path, info: dict) -> DataBundle | None:
  """The stored stage, or None when its tokenizer is not the one it was
  encoded with (a later data stage retrained it, then stopped)."""
  try:
    tok = tokenizer_lib.Tokenizer.load(info["tokenizer_path"])
  except (KeyError, ValueError):
    return None
  if tok.sha256[:16] != info.get("hashes", {}).get("tokenizer"):
    return None
  try:
    docs = {s: doc_view.DocView(doc_store.DocStore(out / s)) for s in _SPLITS}
  except doc_store.StoreError:
    return None  # Unfinished or damaged: the stage runs again.
  units = token_store.load_npz(out / "units.npz", _SPLITS)
  return DataBundle(tok, docs, info["hashes"], units)


def prepare_data(data_config, workdir: str, seed: int) -> DataBundle:
  """Runs (or reuses) the data stage (module docstring: keying)."""
  out = epath.Path(workdir) / "data"
  info_path, manifest_path = out / "info.json", out / "manifest.json"
  previous = _read_json(manifest_path).get("files", {})
  inputs, record = corpus_inputs(data_config, previous)
  config_key = _config_key(data_config)
  key = _short_hash({"config": config_key, "inputs": inputs})
  info = _read_json(info_path)
  if info.get("key") == key:
    bundle = _load(out, info)
    if bundle is not None:
      if record != previous:  # New times of unchanged files: not re-read.
        atomic.write_json(manifest_path, {"files": record}, indent=None)
      print(f"[data] reusing {out}: " + ", ".join(
          f"{s} {len(bundle.docs[s]):,} docs / "
          f"{bundle.docs[s].num_tokens:,} tokens" for s in _SPLITS),
            flush=True)
      return bundle
  print(f"[data] reading corpus {data_config.corpus!r}"
        + _why_again(info, key, config_key, inputs, previous, record),
        flush=True)
  reading, stream = corpus_stream.stream_corpus(data_config)
  scan = corpus_stream.scan_corpus(stream)
  if reading is not None:  # c4 has no files to name.
    for line in (skipped_line(reading), replaced_line(reading)):
      if line:
        print(line, flush=True)
  check_splits(data_config, scan, reading)
  # From here on data/ is rewritten: first drop info.json, so that a crash
  # half-way leaves no key that would reuse a mix of old and new files.
  if info_path.exists():
    info_path.unlink()
  fingerprint = scan.fingerprint.hexdigest(_SPLITS)

  def train_texts():
    stream = corpus_stream.stream_corpus(data_config)[1]
    return (doc.text for split, doc in stream if split == "train")
  tok = tokenizer_lib.load_or_train_tokenizer(
      workdir, train_texts, data_config.vocab_size,
      data_config.tokenizer_model, seed, data_config.tokenizer_max_sentences,
      texts_key=scan.fingerprint.hexdigest(["train"])[:16])
  print(f"[data] tokenizer: {tok.vocab_size} pieces", flush=True)
  out.mkdir(parents=True, exist_ok=True)
  read_again = corpus_manifest.Fingerprint()

  def fingerprinted(stream):
    for split, doc in stream:
      read_again.add(split, doc)
      yield split, doc
  stores = corpus_stream.encode_to_stores(
      tok, fingerprinted(corpus_stream.stream_corpus(data_config)[1]),
      {s: out / s for s in _SPLITS})
  if read_again.hexdigest(_SPLITS) != fingerprint:
    raise corpora.CorpusError(
        f"The corpus changed while the data stage read it "
        f"(config.data.corpus={data_config.corpus!r}): rerun once the files "
        "stop changing.")
  docs = {s: doc_view.DocView(store) for s, store in stores.items()}
  units = scan.units
  token_store.save_npz(out / "units.npz", **units)
  atomic.write_json(manifest_path, {"files": record}, indent=None)
  hashes = {"corpus": fingerprint[:16], "tokenizer": tok.sha256[:16]}
  tokenizer_path = (epath.Path(data_config.tokenizer_model)
                    if data_config.tokenizer_model else
                    epath.Path(workdir) / "tokenizer" / "spm.model")
  atomic.write_text(info_path, json.dumps({
      "key": key, "config_key": config_key, "format": _FORMAT,
      "inputs": inputs,
      "hashes": hashes, "tokenizer_path": os.fspath(tokenizer_path),
      **{f"{s}_documents": len(docs[s]) for s in _SPLITS},
      **{f"{s}_tokens": docs[s].num_tokens for s in _SPLITS}}, indent=1))
  for s in _SPLITS:
    print(f"[data] {s}: {len(docs[s]):,} docs, {docs[s].num_tokens:,} "
          "tokens", flush=True)
  logging.info("Data stage wrote %s", out)
  return DataBundle(tok, docs, hashes, units)
