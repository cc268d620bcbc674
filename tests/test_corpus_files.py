"""Reading a corpus's files: stray bytes replaced and counted, every file
that is not read named with its reason, counts against the glob's matches,
and the file fingerprint robust to files that cannot be read."""

import os
import pathlib

import ml_collections
import pytest

from dipaco_jax.data import corpora
from dipaco_jax.data import corpus_files
from dipaco_jax.data import corpus_manifest
from dipaco_jax.data import prepare

_TEXT = 'def f(x):\n    return x + 1\n' * 20  # 540 bytes of plain text.


def _read(pattern, max_corpus_chars=0):
  return corpora.read_text_files(str(pattern), 'text', 1000, 0.3,
                                 max_corpus_chars)


def _texts(splits):
  return {d.doc_id: d.text for docs in splits.values() for d in docs}


def test_a_few_undecodable_bytes_are_replaced_and_counted(tmp_path):
  # Two stray bytes and a truncated 3-byte sequence (2 bytes, one U+FFFD);
  # the U+FFFD already in the file is text, not a replacement.
  data = (_TEXT.encode() + b'caf\xe9 \xff\n' + b'\xe2\x82 end\n'
          + '\ufffd kept\n'.encode())
  (tmp_path / 'a.txt').write_bytes(data)
  (tmp_path / 'b.txt').write_text(_TEXT)
  splits, reading = _read(tmp_path / '*.txt')
  text = _texts(splits)['a.txt#0']
  assert text.endswith('caf\ufffd \ufffd\n\ufffd end\n\ufffd kept\n')
  assert reading.replaced == [('a.txt', 4)]
  assert reading.read == 2 and not reading.skipped
  assert prepare.replaced_line(reading) == (
      '[data] replaced 4 undecodable bytes with U+FFFD in 1 file: a.txt (4)')
  assert prepare.skipped_line(reading) == ''


def test_mostly_undecodable_is_skipped_as_not_utf8_and_nul_as_binary():
  assert corpus_files.decode(b'x' * 99 + b'\xff') == (
      'x' * 99 + '\ufffd', '', 1)  # 1% of the bytes: replaced.
  assert corpus_files.decode(b'x' * 98 + b'\xff') == (
      None, 'not UTF-8: 1 of 99 bytes undecodable', 0)
  assert corpus_files.decode('h\xe9llo'.encode('latin-1'))[1] == (
      'not UTF-8: 1 of 5 bytes undecodable')
  assert corpus_files.decode(b'text\0more') == (None, 'binary', 0)
  assert corpus_files.decode(b'') == ('', '', 0)


def test_skipped_files_are_named_and_counted_against_the_glob(tmp_path):
  for name in ('a.txt', 'b.txt', 'c.txt'):
    (tmp_path / name).write_text(_TEXT)
  (tmp_path / 'd.bin').write_bytes(b'\0\1\2' * 10)
  os.symlink(tmp_path / 'missing.txt', tmp_path / 'e.txt')
  os.mkfifo(tmp_path / 'f.pipe')  # Opening it would block the job.
  (tmp_path / 'subdir').mkdir()  # A directory is not a file: not counted.
  pattern = tmp_path / '*'
  splits, reading = _read(pattern)
  assert sorted(reading.skipped) == [('d.bin', 'binary'),
                                     ('e.txt', 'dangling link'),
                                     ('f.pipe', 'not a regular file')]
  assert (reading.matched, reading.read) == (6, 3)
  assert {n.split('#')[0] for n in _texts(splits)} == {'a.txt', 'b.txt',
                                                       'c.txt'}
  assert prepare.skipped_line(reading) == (
      '[data] skipped 3 of 6 files: d.bin (binary), e.txt (dangling link), '
      f"f.pipe (not a regular file); read 3 of the 6 matched by "
      f"'{pattern}'")


def test_files_the_cap_leaves_out_are_counted_apart(tmp_path):
  for i in range(4):
    (tmp_path / f'{i}.txt').write_text(_TEXT)
  os.symlink(tmp_path / 'missing.txt', tmp_path / 'z.txt')
  _, reading = _read(tmp_path / '*.txt', max_corpus_chars=2 * len(_TEXT))
  assert (reading.matched, reading.kept, reading.read) == (5, 2, 2)
  assert prepare.skipped_line(reading).endswith(
      f"read 2 of the 5 matched by '{tmp_path / '*.txt'}' (2 left out by "
      'config.data.max_corpus_chars)')


def _check_unreadable_is_named(tmp_path, locked):
  files = corpus_files.text_files(str(tmp_path / '*.txt'))[1]
  _, record = corpus_manifest.file_manifest(files, {})  # Not a traceback.
  _, reading = _read(tmp_path / '*.txt')
  assert record[str(locked)][4] == 'unreadable: Permission denied'
  assert reading.skipped == [('locked.txt', 'unreadable: Permission denied')]
  assert '[data] skipped 1 of 2 files: locked.txt (unreadable: Permission ' \
         'denied); read 1 of the 2' in prepare.skipped_line(reading)


@pytest.mark.skipif(os.geteuid() == 0,
                    reason='root reads a file whatever its mode')
def test_an_unreadable_file_is_named(tmp_path):
  (tmp_path / 'a.txt').write_text(_TEXT)
  locked = tmp_path / 'locked.txt'
  locked.write_text(_TEXT)
  locked.chmod(0)
  try:
    _check_unreadable_is_named(tmp_path, locked)
  finally:
    locked.chmod(0o644)


def test_an_unreadable_file_is_named_even_as_root(tmp_path, monkeypatch):
  # The same as root, where chmod denies nothing: opening it is refused.
  (tmp_path / 'a.txt').write_text(_TEXT)
  locked = tmp_path / 'locked.txt'
  locked.write_text(_TEXT)
  real_open = pathlib.Path.open

  def refusing_open(self, *args, **kwargs):
    if self.name == 'locked.txt':
      raise PermissionError(13, 'Permission denied', str(self))
    return real_open(self, *args, **kwargs)

  monkeypatch.setattr(pathlib.Path, 'open', refusing_open)
  _check_unreadable_is_named(tmp_path, locked)


def test_a_glob_without_wildcard_names_a_dangling_link(tmp_path):
  os.symlink(tmp_path / 'missing.txt', tmp_path / 'one.txt')
  splits, reading = _read(tmp_path / 'one.txt')
  assert reading.skipped == [('one.txt', 'dangling link')]
  assert not _texts(splits) and reading.read == 0


def test_jsonl_lines_get_their_stray_bytes_replaced(tmp_path):
  (tmp_path / 'c.jsonl').write_bytes(b'{"text": "caf\xe9 ' + b'x' * 200
                                     + b'"}\n{"text": "two"}\n')
  splits, reading = _read(tmp_path / '*.jsonl')
  assert _texts(splits)['c.jsonl:1'] == 'caf\ufffd ' + 'x' * 200
  assert _texts(splits)['c.jsonl:2'] == 'two'
  assert reading.replaced == [('c.jsonl', 1)]


def test_the_fingerprint_sees_a_file_that_cannot_be_read_become_readable(
    tmp_path):
  (tmp_path / 'a.txt').write_text(_TEXT)
  os.symlink(tmp_path / 'target.txt', tmp_path / 'b.txt')
  files = corpus_files.text_files(str(tmp_path / '*.txt'))[1]
  before, record = corpus_manifest.file_manifest(files, {})
  assert record[str(tmp_path / 'b.txt')][1:] == [0, 0, 0, 'dangling link']
  (tmp_path / 'target.txt').write_text(_TEXT)
  after, _ = corpus_manifest.file_manifest(files, record)
  assert after != before


def test_a_data_stage_of_the_old_reading_rule_is_redone_and_says_why():
  # Format 4: the same files now read into other text (stray bytes
  # replaced rather than the file skipped), so a stage of format 3 is not
  # reused, and the line blames the version, not the config.
  # pylint: disable=protected-access
  config = ml_collections.ConfigDict(dict(
      corpus='text_files', text_glob='/d/*', text_field='text',
      max_doc_chars=1000, max_corpus_chars=0, validation_fraction=0.1,
      max_documents=0, vocab_size=320, tokenizer_model='',
      tokenizer_max_sentences=0))
  fields = {k: config.get(k, False) for k in prepare.DATA_STAGE_FIELDS
            if k != 'selection_split'}
  old_key = prepare._short_hash({**fields, 'format': 3})
  assert prepare._config_key(config) != old_key
  inputs = {'corpus': 'c', 'tokenizer_model': ''}
  old_info = {'key': 'k3', 'config_key': old_key, 'inputs': inputs}
  assert prepare._why_again(old_info, 'k4', prepare._config_key(config),
                            inputs, {}, {}) == (
                                ': data/ was made by an older version')
