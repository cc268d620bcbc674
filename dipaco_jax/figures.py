"""Matplotlib figures for runs: headless, and saved where the run lives
(a local directory or gs://, which matplotlib's own `savefig(path)` cannot
open)."""

import io

from etils import epath

from dipaco_jax.store import atomic


def pyplot():
  """matplotlib.pyplot on the Agg backend (no display on a training host)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def save(fig, path, dpi: int = 120) -> epath.Path:
  """Writes `fig` as a PNG at `path` (whole or not at all) and closes it."""
  path = epath.Path(path)
  buffer = io.BytesIO()
  fig.savefig(buffer, format="png", dpi=dpi)
  pyplot().close(fig)
  atomic.write_bytes(path, buffer.getvalue())
  return path
