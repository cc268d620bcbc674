"""Writes docs/configs.md: every config field, from the code that defines it.

  python -m dipaco_jax.tools.config_doc > docs/configs.md

Each field's default comes from `config_base.base_config()`; its meaning
from the comments next to it in `config_base.py` (read with tokenize, no
code of it run beyond `base_config()`); its type and allowed values from
`config_fields.py` (`_RANGES` with their `why`, `_CHOICES`, `_BOOL_FIELDS`);
the rules across fields from every `fail("field", ...)` call of the
package (read with ast). No JAX import: it runs in a second.
`tests/test_config_doc.py` fails when the committed page is stale.
"""

import ast
import dataclasses
import io
import pathlib
import sys
import tokenize

from dipaco_jax import config_base
from dipaco_jax import config_fields

COMMAND = "python -m dipaco_jax.tools.config_doc > docs/configs.md"
_PACKAGE_DIR = pathlib.Path(__file__).resolve().parent.parent
_CONFIG_BASE = _PACKAGE_DIR / "config_base.py"
_SECTION_MARK = "# ---"
_LONG_DEFAULT = 60  # Characters; longer defaults go below their table.


@dataclasses.dataclass
class _Section:
  name: str  # "" for the top-level fields.
  title: str
  intro: str = ""
  fields: list = dataclasses.field(default_factory=list)  # (field, text)


def _comment_text(comment: str) -> str:
  return comment.lstrip("#").strip()


def _join(lines) -> str:
  return " ".join(line for line in lines if line).strip()


def _comments(source: str) -> dict[int, tuple[int, str, bool]]:
  """Line -> (column, comment, whether the line holds nothing else)."""
  out = {}
  code_lines = set()
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type == tokenize.COMMENT:
      out[tok.start[0]] = (tok.start[1], tok.string)
    elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                          tokenize.DEDENT, tokenize.ENDMARKER):
      code_lines.update(range(tok.start[0], tok.end[0] + 1))
  return {line: (col, text, line not in code_lines)
          for line, (col, text) in out.items()}


def _target(node) -> str | None:
  """'data.seq_len' for `c.data.seq_len = ...`; None for other statements."""
  if not isinstance(node, ast.Assign) or len(node.targets) != 1:
    return None
  parts, target = [], node.targets[0]
  while isinstance(target, ast.Attribute):
    parts.append(target.attr)
    target = target.value
  if not isinstance(target, ast.Name) or not parts:
    return None
  return ".".join(reversed(parts))


def _block_above(line: int, comments, stop: int) -> list[int]:
  """The comment-only lines right above `line` (none blank), after `stop`."""
  block = []
  line -= 1
  while line > stop and line in comments and comments[line][2]:
    block.append(line)
    line -= 1
  return list(reversed(block))


def _module_comments(tree, comments) -> dict[str, str]:
  """Module constant -> the comment block above its assignment."""
  out = {}
  for node in tree.body:
    if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
      block = _block_above(node.lineno, comments, 0)
      out[node.targets[0].id] = _join(
          _comment_text(comments[i][1]) for i in block)
  return out


def _sections(source: str) -> list[_Section]:
  """base_config()'s fields in order, by section, with their comments."""
  tree = ast.parse(source)
  comments = _comments(source)
  constants = _module_comments(tree, comments)
  function = next(n for n in tree.body if isinstance(n, ast.FunctionDef)
                  and n.name == "base_config")
  body = [n for n in function.body if _target(n) is not None]
  sections = [_Section("", "Top-level fields")]
  by_name = {"": sections[0]}
  previous_end = function.body[0].end_lineno  # The docstring.
  for node in body:
    field = _target(node)
    block = _block_above(node.lineno, comments, previous_end)
    # Comment lines that continue the previous statement's end-of-line
    # comment ("#" then aligned text) belong to it, not to this one.
    block = [i for i in block if _comment_text(comments[i][1]) and
             not comments[i][1].startswith("#  ")]
    texts = [_comment_text(comments[i][1]) for i in block]
    header = next((k for k, i in enumerate(block)
                   if comments[i][1].startswith(_SECTION_MARK)), None)
    is_section = (isinstance(node.value, ast.Call) and
                  ast.unparse(node.value.func).endswith("ConfigDict"))
    if is_section:
      title = texts[header].strip("- ") if header is not None else field
      section = _Section(field, title, _join(texts[header + 1:] if header
                                             is not None else texts))
      sections.append(section)
      by_name[field] = section
    else:
      if header is not None:  # A header without a section (none today).
        texts = texts[header + 1:]
      own = []
      for line in range(node.lineno, node.end_lineno + 1):
        if line in comments and not comments[line][2]:
          own.append(_comment_text(comments[line][1]))
          following = line + 1
          while (following in comments and comments[following][2] and
                 comments[following][1].startswith("#  ")):
            own.append(_comment_text(comments[following][1]))
            following += 1
      text = _join(texts + own)
      if not text and isinstance(node.value, ast.Name):
        text = constants.get(node.value.id, "")
      section_name = field.rpartition(".")[0]
      by_name[section_name].fields.append((field, text))
    previous_end = node.end_lineno
    while previous_end + 1 in comments and comments[previous_end + 1][
        1].startswith("#  "):
      previous_end += 1
  return sections


def _fail_calls() -> dict[str, list[tuple[str, str]]]:
  """Field -> [(module, message)] of every `fail("field", ...)` call."""
  out = {}
  for path in sorted(_PACKAGE_DIR.rglob("*.py")):
    relative = path.relative_to(_PACKAGE_DIR.parent)
    if relative.parts[1].startswith(("testing", "tools")):
      continue
    module = ".".join(relative.with_suffix("").parts)
    for node in ast.walk(ast.parse(path.read_text())):
      if not (isinstance(node, ast.Call) and len(node.args) >= 2):
        continue
      name = ast.unparse(node.func)
      if name.rpartition(".")[2] not in ("fail", "_fail"):
        continue
      field = node.args[0]
      if not (isinstance(field, ast.Constant) and isinstance(field.value,
                                                             str)):
        continue
      out.setdefault(field.value, []).append(
          (module, _message(node.args[1])))
  return out


def _message(node) -> str:
  """A message's text, with each formatted value shown as `…`."""
  if isinstance(node, ast.Constant):
    return str(node.value)
  if isinstance(node, ast.JoinedStr):
    return "".join(_message(v) for v in node.values)
  if isinstance(node, ast.FormattedValue):
    return "…"
  if isinstance(node, ast.BinOp):
    return _message(node.left) + _message(node.right)
  return "…"


def _escape(text: str) -> str:
  """Plain text for a Markdown table cell; `code` spans kept as such."""
  parts = text.split("`")
  if len(parts) % 2 == 0:  # An unpaired backtick: all plain text.
    parts = [text.replace("`", "'")]
  out = []
  for i, part in enumerate(parts):
    if i % 2:
      out.append(_code(part))
    else:
      out.append(part.replace("\\", "\\\\").replace("|", "\\|")
                 .replace("*", "\\*").replace("_", "\\_")
                 .replace("<", "&lt;"))
  return "".join(out)


def _code(text: str) -> str:
  return "`" + text.replace("|", "\\|") + "`"


def _type_and_allowed(field: str, default) -> tuple[str, str]:
  ranges = {r.field: r for r in config_fields._RANGES}  # pylint: disable=protected-access
  choices = config_fields._CHOICES  # pylint: disable=protected-access
  bools = config_fields._BOOL_FIELDS  # pylint: disable=protected-access
  if field in ranges:
    rule = ranges[field]
    allowed = _escape(rule.requirement())
    if rule.why:
      allowed += f" ({_escape(rule.why)})"
    return rule.kind.__name__, allowed
  if field in choices:
    return "str", ", ".join(_code(c) for c in choices[field])
  if field in bools:
    return "bool", "`True`, `False`"
  return type(default).__name__, ""


def _default(value) -> str:
  return _code(repr(value))


def render() -> str:
  """The page's Markdown."""
  config = config_base.base_config()
  sections = _sections(_CONFIG_BASE.read_text())
  rules = _fail_calls()
  out = [
      "<!-- Generated by `" + COMMAND + "`; do not edit by hand. -->",
      "",
      "# Config fields",
      "",
      "Every experiment (`experiments/*.py`) starts from "
      "`config_base.base_config()` and overrides fields; the command line "
      "overrides them again, e.g. `python -m dipaco_jax.main "
      "--config=experiments/quickstart.py --workdir=/tmp/run "
      "--config.train.num_steps=100`. Before any compute, "
      "`config_base.validate` checks each field's type and allowed values "
      "(the tables below) and the rules across fields (the last section); "
      "a config that breaks one fails with a one-line error naming the "
      "field.",
      "",
      "This page is generated from `dipaco_jax/config_base.py` (defaults "
      "and the comments next to them) and `dipaco_jax/config_fields.py` "
      "(types and ranges). Regenerate it after changing either:",
      "",
      "```sh",
      COMMAND,
      "```",
      "",
      "Ranges: `[a, b)` includes a, excludes b; `>= 0` has no upper bound. "
      "Where a sentinel (0, \"\") means off, all or auto, the meaning says "
      "so.",
      "",
  ]
  long_defaults = []
  for section in sections:
    if not section.fields:
      continue
    if section.name:  # The heading is the section's name: its anchor.
      out += [f"## {section.name}", "", _escape(section.title + (
          f". {section.intro}" if section.intro else ".")), ""]
    else:
      out += [f"## {section.title}", ""]
    out += ["| Field | Default | Type | Allowed | Meaning |",
            "| --- | --- | --- | --- | --- |"]
    for field, text in section.fields:
      value = config
      for key in field.split("."):
        value = value[key]
      default = _default(value)
      if len(default) > _LONG_DEFAULT:
        long_defaults.append((field, value))
        default = "(below)"
      kind, allowed = _type_and_allowed(field, value)
      out.append(f"| `{field}` | {default} | {kind} | {allowed} | "
                 f"{_escape(text)} |")
    out.append("")
    for field, value in long_defaults:
      out += [f"Default of `{field}`:", "", "```python"]
      out += [f"{field.rpartition('.')[2]} = ("]
      out += [f"    {item!r}," for item in value]
      out += [")", "```", ""]
    long_defaults = []
  out += [
      "## Rules across fields",
      "",
      "The checks that look at more than one field, or at a field's text, "
      "by the field they name (`…` stands for a value from the config). "
      "The module is where the rule lives.",
      "",
      "| Field | Error when broken | Module |",
      "| --- | --- | --- |",
  ]
  order = [f for s in sections for f, _ in s.fields] + [
      s.name for s in sections if s.name]
  for field in sorted(rules, key=lambda f: (order.index(f) if f in order
                                            else len(order), f)):
    for module, message in rules[field]:
      out.append(f"| `{field}` | {_escape(message)} | `{module}` |")
  out.append("")
  return "\n".join(out)


def main() -> None:
  sys.stdout.write(render())


if __name__ == "__main__":
  main()
