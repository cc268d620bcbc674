"""What the repository keeps out: test helpers in the runtime's imports,
and work-log labels (the project speaks of its runs by topic, device and
date, never by the number of the session, issue or call that made them)."""

import ast
import pathlib
import re
import subprocess

import pytest

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_PACKAGE = _ROOT / "dipaco_jax"
# The word for a work session, a tracker entry or a device call followed
# by its number, with or without a space or underscore, also inside a name
# ("..._h200", "before_..."). Written in pieces so that this file does not
# match itself.
_LABEL = re.compile(
    r"(?<![a-z])(?:sess" r"ion|iss" r"ue|ca" r"ll)[ _-]?\d+(?![0-9])",
    re.IGNORECASE)


def _tracked_files() -> list[str]:
  try:
    listing = subprocess.run(["git", "ls-files", "-z"], cwd=_ROOT,
                             capture_output=True, check=True).stdout
  except (OSError, subprocess.CalledProcessError):
    pytest.skip("not a git checkout")
  return [name for name in listing.decode().split("\0") if name]


def _imported_modules(path: pathlib.Path) -> set[str]:
  names = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      names.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      names.add(node.module)
      names.update(f"{node.module}.{alias.name}" for alias in node.names)
  return names


def test_the_runtime_never_imports_the_test_helpers():
  offenders = []
  for path in sorted(_PACKAGE.rglob("*.py")):
    if "testing" in path.relative_to(_PACKAGE).parts:
      continue
    if any(name == "dipaco_jax.testing" or
           name.startswith("dipaco_jax.testing.")
           for name in _imported_modules(path)):
      offenders.append(str(path.relative_to(_ROOT)))
  assert not offenders, f"imports dipaco_jax.testing: {offenders}"


def test_no_work_log_label_in_any_tracked_file_or_path():
  found = []
  for name in _tracked_files():
    if _LABEL.search(name):
      found.append(f"{name} (its path)")
    path = _ROOT / name
    if not path.is_file() or path.suffix in (".png", ".npz", ".gz", ".pb"):
      continue
    try:
      text = path.read_text()
    except UnicodeDecodeError:
      continue
    for number, line in enumerate(text.splitlines(), 1):
      match = _LABEL.search(line)
      if match:
        found.append(f"{name}:{number}: {match.group(0)!r}")
  assert not found, ("work-log labels (name runs by topic, device and "
                     "date instead):\n" + "\n".join(found[:50]))
