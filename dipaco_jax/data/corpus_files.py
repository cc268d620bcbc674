"""Which files a corpus is made of: the stdlib's `.py` files, or those a
glob matches (local or gs://). The errors say what was (not) found."""

import glob
import os
import pathlib
import sysconfig

from etils import epath

from dipaco_jax import errors

_GLOB_CHARS = frozenset('*?[')


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
