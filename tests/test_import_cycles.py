"""No module of dipaco_jax imports anything that imports it back.

Reads every module with ast, no import: module-level and function-level
imports alike (a cycle hidden inside a function still ties the two modules
together), `import a.b`, `from a import b` where b may be a submodule, and
relative imports. Importing `a.b.c` also runs the packages `a` and `a.b`,
so those are edges too (except the importer's own packages, which Python
runs before the importer). The test helpers (`dipaco_jax/testing*`) are
left out."""

import ast
import pathlib

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_PACKAGE = "dipaco_jax"


def _modules() -> dict[str, pathlib.Path]:
  """Module name -> file, for every module of the package."""
  modules = {}
  for path in sorted((_ROOT / _PACKAGE).rglob("*.py")):
    parts = path.relative_to(_ROOT).with_suffix("").parts
    if parts[1].startswith("testing"):
      continue
    if parts[-1] == "__init__":
      parts = parts[:-1]
    modules[".".join(parts)] = path
  return modules


def _ancestors(name: str) -> list[str]:
  parts = name.split(".")
  return [".".join(parts[:i]) for i in range(1, len(parts))]


def _imports(name: str, path: pathlib.Path, modules) -> set[str]:
  """The modules of the package that `name` imports, anywhere in its file."""
  is_package = path.name == "__init__.py"
  targets = set()
  for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
    if isinstance(node, ast.Import):
      targets.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        package = name.split(".")
        if not is_package:
          package = package[:-1]
        package = package[:len(package) - (node.level - 1)]
        base = ".".join(package + ([node.module] if node.module else []))
      else:
        base = node.module
      targets.add(base)
      for alias in node.names:
        if f"{base}.{alias.name}" in modules:
          targets.add(f"{base}.{alias.name}")
  own = set(_ancestors(name)) | {name}
  edges = set()
  for target in targets:
    for module in _ancestors(target) + [target]:
      if module in modules and module not in own:
        edges.add(module)
  return edges


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One cycle of `graph` as [a, b, ..., a], or None."""
  state = {}  # absent: unvisited; 1: on the current path; 2: done
  for start in sorted(graph):
    if start in state:
      continue
    stack = [(start, iter(sorted(graph[start])))]
    path = [start]
    state[start] = 1
    while stack:
      node, children = stack[-1]
      child = next(children, None)
      if child is None:
        stack.pop()
        path.pop()
        state[node] = 2
      elif state.get(child) == 1:
        return path[path.index(child):] + [child]
      elif child not in state:
        state[child] = 1
        path.append(child)
        stack.append((child, iter(sorted(graph[child]))))
  return None


def import_graph() -> dict[str, set[str]]:
  modules = _modules()
  return {name: _imports(name, path, modules)
          for name, path in modules.items()}


def test_graph_sees_function_level_and_relative_imports():
  graph = import_graph()
  assert "dipaco_jax.config_fields" in graph["dipaco_jax.config_base"]
  assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [
      "a", "b", "c", "a"]
  assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
  cycle = _find_cycle(import_graph())
  assert cycle is None, "import cycle: " + " -> ".join(cycle)
