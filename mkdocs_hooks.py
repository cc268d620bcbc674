"""mkdocs hooks (mkdocs.yml `hooks:`) for the API pages.

The API pages render the docstrings as written, as Markdown. Plain-text
notation in them such as `c[w][s]` or `[--flag] [--verbose]` reads as a
Markdown reference link, which mkdocs-autorefs then reports as a
cross-reference it cannot find, failing `mkdocs build --strict`. Those
reports, and only those that come from a docstring (they name its .py
file), are dropped; a broken reference in a docs/*.md page still fails.
"""

import logging

_AUTOREFS_LOGGER = "mkdocs.plugins.mkdocs_autorefs._internal.plugin"


class _DocstringReferences(logging.Filter):

  def filter(self, record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return not ("Could not find cross-reference target" in message and
                ".py:" in message)


def on_startup(command, dirty):  # pylint: disable=unused-argument
  logging.getLogger(_AUTOREFS_LOGGER).addFilter(_DocstringReferences())
