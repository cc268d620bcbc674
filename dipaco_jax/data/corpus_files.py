"""Which files a corpus is made of: the stdlib's `.py` files, or those a
glob matches (local or gs://), and how one file is read as text. The errors
say what was (not) found.

A glob match is every entry that is not a directory, dangling links and
special files included: they cannot be read, but the `[data]` line names
them with the reason (`problem`), rather than dropping them unseen.
"""

import glob
import os
import pathlib
import stat
import sysconfig

from etils import epath

from dipaco_jax import errors

_GLOB_CHARS = frozenset('*?[')
# The most of a file's bytes that may be undecodable and replaced (with
# U+FFFD) before the file is skipped as not UTF-8 (`decode`).
_MAX_UNDECODABLE_SHARE = 0.01


class CorpusError(errors.UserError, ValueError):
  """The corpus cannot give what the run needs; the message says what was
  found and which config field to change. A ValueError too, as the corpus
  errors were before."""


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
  base, paths = glob_files(pattern)
  if not paths:
    raise CorpusError(
        f'No files match the pattern {pattern!r} (config.data.text_glob): '
        'fix the path or the pattern (`**` matches any depth, e.g. '
        "'/data/**/*.txt').")
  return base, {os.path.relpath(os.fspath(p), os.fspath(base)): p
                for p in paths}


def _is_entry(name: str) -> bool:
  """Whether a local glob match counts as a corpus file: anything but a
  directory (or a link to one), so that a dangling link is still seen."""
  return os.path.lexists(name) and not os.path.isdir(name)


def glob_files(pattern: str) -> tuple[epath.Path, list[epath.Path]]:
  """Expands `pattern`; returns (base directory, sorted matches)."""
  parts = pattern.split('/')
  fixed = []
  for part in parts:
    if _GLOB_CHARS & set(part):
      break
    fixed.append(part)
  if len(fixed) == len(parts):  # No wildcard: a single file.
    path = epath.Path(pattern)
    found = path.is_file() if '://' in pattern else _is_entry(pattern)
    return path.parent, [path] if found else []
  base_str = '/'.join(fixed) or ('/' if pattern.startswith('/') else '.')
  rest = '/'.join(parts[len(fixed):])
  if '://' in pattern:
    base = epath.Path(base_str)
    matches = [p for p in base.glob(rest) if p.is_file()]
  else:
    base = epath.Path(base_str)
    matches = [pathlib.Path(p) for p in glob.glob(pattern, recursive=True)
               if _is_entry(p)]  # Local: pathlib is cheaper than epath.
  return base, sorted(matches, key=os.fspath)


def problem(path: epath.Path) -> str:
  """Why a corpus file cannot be read at all, or '' (it may still turn out
  unreadable or binary when read). Checked before anything opens the file:
  opening a FIFO would block the job."""
  name = os.fspath(path)
  if '://' in name:  # A bucket lists objects only: no links, no FIFOs.
    return ''
  try:
    mode = os.stat(name).st_mode
  except FileNotFoundError:
    return 'dangling link' if os.path.islink(name) else 'not found'
  except OSError as e:  # A link loop, a directory that denies search.
    return f'unreadable: {e.strerror or e}'
  return '' if stat.S_ISREG(mode) else 'not a regular file'


def read_text(path: epath.Path, replace: bool = True
              ) -> tuple[str | None, str, int]:
  """(text, '', bytes replaced) or (None, why it is skipped, 0); with
  `replace` False any undecodable byte skips the file (`decode`)."""
  try:
    # Bytes then decode, so '\r\n' and other line ends survive unchanged.
    data = path.read_bytes()
  except OSError as e:
    return None, f'unreadable: {e.strerror or e}', 0
  return decode(data, replace)


def decode(data: bytes, replace: bool = True
           ) -> tuple[str | None, str, int]:
  """(text, '', bytes replaced) or (None, why it is skipped, 0).

  The rule. A NUL byte means binary: NUL is valid UTF-8 and never in text,
  so a file of zeros or a compiled object would otherwise decode and become
  a document. Otherwise undecodable bytes are replaced with U+FFFD, so a
  few stray bytes cost a few characters, not the file; but when more than
  1% of the bytes are undecodable (random bytes: about half; a UTF-8 file
  with a stray byte: far below) the file is another encoding (latin-1 text
  in a language with accents) or binary, and replacing would feed the model
  garbled text: it is skipped as not UTF-8. Without `replace` (the
  embedded stdlib corpus, whose only such files are the encoding tests'
  deliberately malformed sources) any undecodable byte skips the file.
  """
  if b'\0' in data:
    return None, 'binary', 0
  try:
    return data.decode('utf-8'), '', 0
  except UnicodeDecodeError:
    pass
  text = data.decode('utf-8', errors='replace')
  replaced = _replaced_bytes(data, text)
  if replaced > (_MAX_UNDECODABLE_SHARE * len(data) if replace else 0):
    return None, (f'not UTF-8: {replaced:,} of {len(data):,} bytes '
                  'undecodable'), 0
  return text, '', replaced


def _replaced_bytes(data: bytes, text: str) -> int:
  """How many bytes of `data` the decoder replaced to give `text`.

  Every other byte comes back unchanged when `text` is encoded, and each
  U+FFFD it inserted encodes to 3 bytes. A U+FFFD already in `data`
  (b'\xef\xbf\xbd') always decodes as itself (0xEF starts a sequence, so no
  broken sequence before it can swallow it), so those are told apart.
  """
  inserted = text.count('\ufffd') - data.count('\ufffd'.encode('utf-8'))
  return len(data) - (len(text.encode('utf-8')) - 3 * inserted)
