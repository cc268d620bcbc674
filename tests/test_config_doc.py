"""docs/configs.md is what dipaco_jax/tools/config_doc.py writes today."""

import pathlib

import pytest

from dipaco_jax import config_base
from dipaco_jax.tools import config_doc

_PAGE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "configs.md"


def test_configs_page_is_current():
  if _PAGE.read_text() != config_doc.render():
    pytest.fail(f"docs/configs.md is stale: run `{config_doc.COMMAND}`",
                pytrace=False)


def _flat(config, prefix=""):
  for key, value in config.items():
    if hasattr(value, "items"):
      yield from _flat(value, f"{prefix}{key}.")
    else:
      yield f"{prefix}{key}"


def test_every_field_has_a_row_and_a_meaning():
  page = config_doc.render()
  sections = config_doc._sections(config_doc._CONFIG_BASE.read_text())  # pylint: disable=protected-access
  fields = {field: text for s in sections for field, text in s.fields}
  assert sorted(fields) == sorted(_flat(config_base.base_config()))
  for field, text in fields.items():
    assert f"| `{field}` |" in page
    assert text, f"config_base.py: {field} has no comment"
