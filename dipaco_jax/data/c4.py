"""C4 (TFDS `c4/en`) through TFDS and seqio: the data-preparation side only.

Invariant 2 (DESIGN.md): training never imports TensorFlow. This module is the
one place that reads C4, and it imports `tensorflow`, `tensorflow_datasets`
and `seqio` inside its functions only, so `import dipaco_jax.data.c4` costs
nothing and works on machines without the `data` extra
(`pip install -e .[data]`). Its outputs are plain Python lists and numpy
arrays, which the rest of the pipeline turns into per-path shards.

Three entry points:

- `c4_documents(split, max_documents)`: `(doc_id, text)` pairs read with TFDS
  alone (no tokenizer, no seqio), for tokenizer training and routing.
  `doc_id` is `f'c4/{split}/{i}'`, `i` the position in TFDS' unshuffled order.
- `register_c4_task(vocab_model_path)`: registers (idempotently) a
  `seqio.Task` over TFDS `c4/en` with a `seqio.SentencePieceVocabulary`.
  Its one output feature, `targets`, is the tokenized `text` with **no EOS
  appended** (`add_eos=False`, and no `append_eos` preprocessor): documents
  are stored unpadded and unpacked, and the boundary marker we use is the BOS
  that `c4_token_docs` prepends, so an EOS would only duplicate it.
- `c4_token_docs(task_name, split, max_documents, bos_id)`: the task's
  documents as `(tokens, offsets)` in the flat layout of the token store:
  `tokens` is int32 of shape `[offsets[-1]]`, `offsets` is int64 of shape
  `[num_docs + 1]`, `offsets[0] == 0`, and document `i` is
  `tokens[offsets[i]:offsets[i + 1]]`. Each document starts with `bos_id`.
  BOS is prepended here because the T5 SentencePiece vocabulary (the one
  seqio/T5X use for C4) has no BOS piece (`bos_id == -1`), so the caller
  chooses the id (our own tokenizer's BOS, or e.g. T5's pad id 0, which T5's
  decoder uses as its start token). Document `i` of `c4_token_docs` is
  document `i` of `c4_documents` for the same split: both read TFDS in file
  order, without shuffling.

Reading the real C4 needs a prepared copy (`tfds build c4/en` needs Apache
Beam and about 800 GB; or point `data_dir` / `TFDS_DATA_DIR` at an existing
copy, e.g. a `gs://` bucket on Cloud TPU). Nothing here downloads C4.
"""

from __future__ import annotations

import functools
from typing import Any, Iterator

import numpy as np

DEFAULT_TASK_NAME = "dipaco_c4_en"
DEFAULT_TFDS_NAME = "c4/en:3.1.0"
DEFAULT_SPLITS = ("train", "validation")

_INSTALL_HINT = (
    "Reading C4 needs TensorFlow, tensorflow-datasets and seqio, which are "
    "not part of the core install (training never imports TensorFlow). "
    "Install the data extra: `pip install -e .[data]`."
)

# task name -> (vocab_model_path, tfds_name, data_dir, splits) of the tasks
# that register_c4_task added, to make it idempotent and to refuse a clash.
_REGISTERED: dict[str, tuple[Any, ...]] = {}


def _hide_gpus_from_tf(tf) -> None:
  """Keeps TF off any GPU, so that it never takes memory that JAX needs."""
  try:
    tf.config.set_visible_devices([], "GPU")
  except (RuntimeError, ValueError):  # Already initialized: leave it.
    pass


def _import_tfds():
  """Returns `(tf, tfds)`, or raises an ImportError naming the extra."""
  try:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(f"{_INSTALL_HINT} (import failed: {e})") from e
  _hide_gpus_from_tf(tf)
  return tf, tfds


def _import_seqio():
  """Returns `(tf, tfds, seqio)`, or raises an ImportError naming the extra."""
  tf, tfds = _import_tfds()
  try:
    import seqio  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(f"{_INSTALL_HINT} (import failed: {e})") from e
  return tf, tfds, seqio


def _check_max_documents(max_documents: int) -> None:
  """0 means the whole split, as in `config.data.max_documents`."""
  if (isinstance(max_documents, bool)
      or not isinstance(max_documents, (int, np.integer))
      or max_documents < 0):
    raise ValueError(
        "max_documents must be an int >= 0 (0 = the whole split), got "
        f"{max_documents!r}."
    )


def _take(ds, max_documents: int):
  return ds.take(int(max_documents)) if max_documents else ds


def _tfds_not_found(what: str, data_dir: str | None, e: Exception):
  return FileNotFoundError(
      f"{what} is not prepared in data_dir={data_dir!r} (None means "
      "$TFDS_DATA_DIR or ~/tensorflow_datasets). Nothing here "
      "downloads C4: point data_dir (or TFDS_DATA_DIR) at a prepared copy, "
      "or build one with `tfds build c4/en` (needs Apache Beam, ~800 GB). "
      f"TFDS said: {e}"
  )


def c4_documents(
    split: str,
    max_documents: int,
    data_dir: str | None = None,
    *,
    tfds_name: str = DEFAULT_TFDS_NAME,
) -> list[tuple[str, str]]:
  """`iter_c4_documents`, collected into a list (small reads, tests)."""
  return list(iter_c4_documents(split, max_documents, data_dir,
                                tfds_name=tfds_name))


def iter_c4_documents(
    split: str,
    max_documents: int,
    data_dir: str | None = None,
    *,
    tfds_name: str = DEFAULT_TFDS_NAME,
) -> Iterator[tuple[str, str]]:
  """Reads the first `max_documents` C4 documents of `split` with TFDS.

  Args:
    split: a TFDS split of `tfds_name` ('train', 'validation', or a slice
      such as 'train[:1000]').
    max_documents: how many documents at most (fewer if the split is
      shorter); 0 reads the whole split (all of C4 train does not fit in
      memory as a list: the data stage streams it into a token store).
    data_dir: TFDS data directory holding the prepared dataset (None: TFDS'
      default, `$TFDS_DATA_DIR` or `~/tensorflow_datasets`).
    tfds_name: the TFDS name and version.

  Returns:
    An iterator of `(doc_id, text)` with `doc_id == f'c4/{split}/{i}'`, in
    TFDS' file order (deterministic: files are not shuffled); TFDS is
    opened at the call, so a missing dataset fails there.
  """
  _check_max_documents(max_documents)
  _, tfds = _import_tfds()
  try:
    ds = tfds.load(
        tfds_name,
        split=split,
        data_dir=data_dir,
        shuffle_files=False,
        download=False,
    )
  except (AssertionError, FileNotFoundError,
          tfds.core.DatasetNotFoundError) as e:
    raise _tfds_not_found(f"TFDS dataset {tfds_name!r}", data_dir, e) from e
  ds = _take(ds.map(lambda ex: ex["text"]), max_documents)
  return (
      (f"c4/{split}/{i}", text.decode("utf-8"))
      for i, text in enumerate(tfds.as_numpy(ds))
  )


def _task_spec(vocab_model_path, tfds_name, data_dir, splits):
  return (str(vocab_model_path), tfds_name, data_dir, tuple(splits))


def register_c4_task(
    vocab_model_path: str,
    task_name: str = DEFAULT_TASK_NAME,
    tfds_name: str = DEFAULT_TFDS_NAME,
    data_dir: str | None = None,
    splits: tuple[str, ...] = DEFAULT_SPLITS,
) -> str:
  """Registers a seqio Task over TFDS C4 with a SentencePiece vocabulary.

  The task reads `text`, renames it to `targets` and tokenizes it with
  `seqio.SentencePieceVocabulary(vocab_model_path)` into int32 ids. No EOS is
  appended (`seqio.Feature(add_eos=False)`, no `append_eos` step); see the
  module docstring for why. The pretokenized string is not kept.

  Calling it again with the same arguments is a no-op; calling it with a
  name that is already registered with other arguments (or by other code) is
  an error rather than a silent mix of two vocabularies.

  Args:
    vocab_model_path: path of the SentencePiece `.model` file (local or any
      `tf.io.gfile` path such as `gs://`).
    task_name: seqio registry name.
    tfds_name: TFDS name and version of C4.
    data_dir: TFDS data directory (None: TFDS' default).
    splits: the splits that the task exposes. Explicit, because seqio would
      otherwise ask the TFDS dataset info, which needs the prepared dataset.

  Returns:
    `task_name`.
  """
  tf, _, seqio = _import_seqio()
  spec = _task_spec(vocab_model_path, tfds_name, data_dir, splits)
  if task_name in seqio.TaskRegistry.names():
    if _REGISTERED.get(task_name) == spec:
      return task_name
    raise ValueError(
        f"seqio task {task_name!r} is already registered with another "
        f"vocabulary or source ({_REGISTERED.get(task_name, 'by other code')}"
        f", asked for {spec}). Use another task_name, or "
        f"seqio.TaskRegistry.remove({task_name!r}) first."
    )
  vocab = seqio.SentencePieceVocabulary(str(vocab_model_path))
  source = seqio.TfdsDataSource(
      tfds_name=tfds_name, tfds_data_dir=data_dir, splits=list(splits)
  )
  seqio.TaskRegistry.add(
      task_name,
      source=source,
      preprocessors=[
          functools.partial(
              seqio.preprocessors.rekey, key_map={"targets": "text"}
          ),
          functools.partial(
              seqio.preprocessors.tokenize, copy_pretokenized=False
          ),
      ],
      output_features={
          "targets": seqio.Feature(
              vocabulary=vocab, add_eos=False, dtype=tf.int32
          ),
      },
  )
  _REGISTERED[task_name] = spec
  return task_name


def c4_token_docs(
    task_name: str,
    split: str,
    max_documents: int,
    bos_id: int,
) -> tuple[np.ndarray, np.ndarray]:
  """Tokenized documents of a registered seqio task, flat with offsets.

  Args:
    task_name: a task from `register_c4_task` (any seqio task with an int
      `targets` feature works).
    split: one of the task's splits.
    max_documents: how many documents at most, in unshuffled order; 0
      reads the whole split.
    bos_id: id prepended to every document. T5's vocabulary has no BOS, so
      the caller names it (see the module docstring).

  Returns:
    `(tokens, offsets)`: int32 `[offsets[-1]]` and int64 `[num_docs + 1]`,
    `offsets[0] == 0`; document `i` is `tokens[offsets[i]:offsets[i+1]]` and
    starts with `bos_id`. Document `i` matches `c4_documents(split, ...)[i]`.
  """
  _check_max_documents(max_documents)
  if not 0 <= int(bos_id) < 2**31:
    raise ValueError(f"bos_id must be a non-negative int32, got {bos_id!r}.")
  _, tfds, seqio = _import_seqio()
  task = seqio.get_mixture_or_task(task_name)
  try:
    ds = task.get_dataset(
        sequence_length=None,  # Whole documents: nothing trimmed or padded.
        split=split,
        shuffle=False,
        use_cached=False,
        num_epochs=1,
        # No in-memory cache: it would ask the TFDS split sizes (which need
        # the prepared dataset's info) and hold the whole split in memory.
        try_in_mem_cache=False,
    )
  except (AssertionError, FileNotFoundError,
          tfds.core.DatasetNotFoundError) as e:
    raise _tfds_not_found(
        f"The TFDS source of seqio task {task_name!r}",
        getattr(getattr(task.source, "tfds_dataset", None), "data_dir", None),
        e,
    ) from e
  ds = _take(ds.map(lambda ex: ex["targets"]), max_documents)

  bos = np.array([bos_id], dtype=np.int32)
  pieces = []
  lengths = []
  for ids in tfds.as_numpy(ds):
    pieces.append(bos)
    pieces.append(np.asarray(ids, dtype=np.int32))
    lengths.append(1 + len(ids))
  offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
  np.cumsum(lengths, out=offsets[1:])
  tokens = (
      np.concatenate(pieces) if pieces else np.zeros((0,), dtype=np.int32)
  )
  return tokens, offsets
