"""C4 through TFDS + seqio, end to end on `tfds.testing.mock_data` (offline).

Skipped where the `data` extra (`pip install -e .[data]`) is not installed.
"""

import importlib
import importlib.util
import sys

import numpy as np
import pytest

from dipaco_jax.data import c4

_EXTRA = ("seqio", "tensorflow_datasets", "tensorflow", "sentencepiece")
pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in _EXTRA),
    reason="needs the data extra: pip install -e .[data]")


class _OnFirstUse:
  """A module imported when a test first uses it, not when the file is
  collected: every test worker collects this file, and seqio's import of
  TensorFlow cost each about 8 s of CPU before any test ran."""

  def __init__(self, name: str):
    self._name = name

  def __getattr__(self, attr):
    if attr.startswith("_"):  # pytest's probes of the file's names
      raise AttributeError(attr)
    return getattr(importlib.import_module(self._name), attr)


tfds = _OnFirstUse("tensorflow_datasets")
tf = _OnFirstUse("tensorflow")
spm = _OnFirstUse("sentencepiece")

_BOS = 2
_WORDS = (
    "the quick brown fox jumps over a lazy dog while seven wizards hex "
    "jolly vixens and big quiet zebras fetch cold milk from the market"
).split()


def _mock_texts(split: str, n: int) -> list[str]:
  """Deterministic sentences (lowercase words, single spaces) per split."""
  rng = np.random.default_rng(0 if split == "train" else 1)
  return [
      " ".join(rng.choice(_WORDS, size=int(rng.integers(3, 15))))
      for _ in range(n)
  ]


_NUM_MOCK = {"train": 12, "validation": 5}


def _as_dataset(self, split, decoders=None, read_config=None, **kwargs):
  """Replaces `_as_dataset` of the c4 builder: the mock texts of `split`."""
  del self, decoders, read_config, kwargs
  name = str(split).split("[")[0]
  texts = _mock_texts(name, _NUM_MOCK[name])
  return tf.data.Dataset.from_tensor_slices({
      "text": texts,
      "url": [f"https://example.com/{i}" for i in range(len(texts))],
      "timestamp": ["2019-04-25T12:00:00Z"] * len(texts),
      "content-type": ["text/plain"] * len(texts),
      "content-length": [str(len(t)) for t in texts],
  })


@pytest.fixture(scope="module")
def vocab_path(tmp_path_factory):
  """A 128-piece SentencePiece model trained on the mock sentences."""
  d = tmp_path_factory.mktemp("spm")
  corpus = d / "corpus.txt"
  rng = np.random.default_rng(2)
  letters = list("abcdefghijklmnopqrstuvwxyz")
  # Random letter strings give the trainer enough distinct pieces for 128.
  noise = [
      " ".join("".join(rng.choice(letters, size=int(rng.integers(2, 7))))
               for _ in range(10))
      for _ in range(200)
  ]
  lines = _mock_texts("train", 200) + noise
  corpus.write_text("\n".join(lines) + "\n")
  prefix = str(d / "c4_test")
  spm.SentencePieceTrainer.train(
      input=str(corpus),
      model_prefix=prefix,
      vocab_size=128,
      model_type="unigram",
      character_coverage=1.0,
      pad_id=0,
      unk_id=1,
      bos_id=2,
      eos_id=3,
      num_threads=1,
      minloglevel=2,
  )
  return prefix + ".model"


@pytest.fixture(scope="module")
def task_name(vocab_path):
  return c4.register_c4_task(vocab_path, task_name="dipaco_c4_en_test")


def test_c4_documents_mock_texts():
  with tfds.testing.mock_data(
      policy=tfds.testing.MockPolicy.USE_CODE, as_dataset_fn=_as_dataset
  ):
    docs = c4.c4_documents("validation", max_documents=3)
    all_train = c4.c4_documents("train", max_documents=100)
    whole = c4.c4_documents("train", max_documents=0)  # 0 = the whole split.
  assert docs == [
      (f"c4/validation/{i}", t)
      for i, t in enumerate(_mock_texts("validation", 3))
  ]
  assert len(all_train) == _NUM_MOCK["train"]  # max_documents is an upper bound.
  assert whole == all_train


def test_c4_documents_default_mock_data():
  """The builder's own code (c4/en features) under the default random mock."""
  with tfds.testing.mock_data(
      num_examples=7, policy=tfds.testing.MockPolicy.USE_CODE
  ):
    docs = c4.c4_documents("train", max_documents=5)
  assert [d for d, _ in docs] == [f"c4/train/{i}" for i in range(5)]
  assert all(isinstance(t, str) for _, t in docs)


def test_register_is_idempotent(vocab_path, task_name):
  assert c4.register_c4_task(vocab_path, task_name=task_name) == task_name
  with pytest.raises(ValueError, match="already registered"):
    c4.register_c4_task(vocab_path, task_name=task_name, tfds_name="c4/en:3.0.1")


def test_c4_token_docs_end_to_end(vocab_path, task_name):
  sp = spm.SentencePieceProcessor(model_file=vocab_path)
  with tfds.testing.mock_data(
      policy=tfds.testing.MockPolicy.USE_CODE, as_dataset_fn=_as_dataset
  ):
    docs = c4.c4_documents("train", max_documents=10)
    tokens, offsets = c4.c4_token_docs(
        task_name, "train", max_documents=10, bos_id=_BOS
    )
    tokens2, offsets2 = c4.c4_token_docs(
        task_name, "train", max_documents=10, bos_id=_BOS
    )

  # Layout: flat int32 tokens, int64 offsets with a leading 0.
  assert tokens.dtype == np.int32 and tokens.ndim == 1
  assert offsets.dtype == np.int64 and offsets.shape == (11,)
  assert offsets[0] == 0 and offsets[-1] == tokens.shape[0]
  assert np.all(np.diff(offsets) >= 2)  # BOS plus at least one piece.
  # BOS exactly at each document start and nowhere else; no EOS appended.
  is_bos = np.zeros(tokens.shape[0], dtype=bool)
  is_bos[offsets[:-1]] = True
  np.testing.assert_array_equal(tokens == _BOS, is_bos)
  assert not np.any(tokens == 3)
  assert tokens.min() >= 0 and tokens.max() < sp.get_piece_size()
  # Same ids as sentencepiece itself, and the texts round-trip, in the order
  # of c4_documents (document i is document i).
  for i, (doc_id, text) in enumerate(docs):
    assert doc_id == f"c4/train/{i}"
    ids = tokens[offsets[i] + 1:offsets[i + 1]].tolist()
    assert ids == sp.encode(text)
    assert sp.decode(ids) == text
  # Deterministic.
  np.testing.assert_array_equal(tokens, tokens2)
  np.testing.assert_array_equal(offsets, offsets2)


def test_c4_token_docs_default_mock_data(vocab_path, task_name):
  """Random mock c4/en examples through the seqio task match sentencepiece."""
  sp = spm.SentencePieceProcessor(model_file=vocab_path)
  with tfds.testing.mock_data(
      num_examples=6, policy=tfds.testing.MockPolicy.USE_CODE
  ):
    docs = c4.c4_documents("validation", max_documents=4)
    tokens, offsets = c4.c4_token_docs(
        task_name, "validation", max_documents=4, bos_id=_BOS
    )
  assert offsets.shape == (5,)
  assert np.all(tokens[offsets[:-1]] == _BOS)
  for i, (_, text) in enumerate(docs):
    assert tokens[offsets[i] + 1:offsets[i + 1]].tolist() == sp.encode(text)


def test_bad_arguments(task_name):
  with pytest.raises(ValueError, match="max_documents"):
    c4.c4_documents("train", max_documents=-1)
  with pytest.raises(ValueError, match="bos_id"):
    c4.c4_token_docs(task_name, "train", max_documents=1, bos_id=-1)


def test_missing_extra_names_the_install_command(monkeypatch):
  monkeypatch.setitem(sys.modules, "seqio", None)
  with pytest.raises(ImportError, match=r"pip install -e \.\[data\]"):
    c4.register_c4_task("unused.model", task_name="dipaco_c4_never")
