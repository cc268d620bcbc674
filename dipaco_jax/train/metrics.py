"""Metrics: TensorBoard summaries, `metrics.jsonl`, and progress lines."""

import json
import time

from absl import logging
from etils import epath
import numpy as np


class MetricWriter:
  """Writes scalars to TensorBoard (tensorboardX) and a JSON-lines file."""

  def __init__(self, workdir: str, subdir: str = "train"):
    self.directory = epath.Path(workdir) / "logs" / subdir
    self.directory.mkdir(parents=True, exist_ok=True)
    self._jsonl = (self.directory / "metrics.jsonl").open("a")
    try:
      from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
      self._tb = SummaryWriter(str(self.directory))
    except ImportError:  # TensorBoard output is optional; jsonl is not.
      self._tb = None

  def write(self, step: int, scalars: dict) -> None:
    clean = {k: float(v) for k, v in scalars.items()}
    self._jsonl.write(json.dumps({"step": step, **clean}) + "\n")
    self._jsonl.flush()
    if self._tb is not None:
      for k, v in clean.items():
        self._tb.add_scalar(k, v, step)

  def close(self) -> None:
    self._jsonl.close()
    if self._tb is not None:
      self._tb.close()


def drop_rows_after(path, step: int) -> None:
  """Removes rows logged after `step` (a resumed run logs them again)."""
  rows = read_jsonl(path)
  if any(r["step"] > step for r in rows):
    epath.Path(path).write_text("".join(
        json.dumps(r) + "\n" for r in rows if r["step"] <= step))


def read_jsonl(path) -> list[dict]:
  path = epath.Path(path)
  if not path.exists():
    return []
  return [json.loads(line) for line in path.read_text().splitlines() if line]


class Progress:
  """Step, loss, tokens/s and ETA, measured between log points."""

  def __init__(self, name: str, first_step: int, last_step: int,
               tokens_per_step: int):
    self.name, self.last_step = name, last_step
    self.tokens_per_step = tokens_per_step
    self._t0, self._s0 = time.perf_counter(), first_step
    self._start_time, self._start_step = self._t0, first_step

  def report(self, step: int, loss: float, show: bool = True) -> dict:
    """Tokens/s since the last report; prints the progress line if `show`."""
    now = time.perf_counter()
    steps = max(step - self._s0, 1)
    seconds = max(now - self._t0, 1e-9)
    tokens_per_s = steps * self.tokens_per_step / seconds
    eta = (self.last_step - step) * seconds / steps
    self._t0, self._s0 = now, step
    if not show:
      return {"tokens_per_s": tokens_per_s}
    logging.info("[%s] step %d/%d  loss %.4f  %.0f tokens/s  ETA %s",
                 self.name, step, self.last_step, loss, tokens_per_s,
                 format_seconds(eta))
    print(f"[{self.name}] step {step:>6}/{self.last_step}  loss {loss:.4f}  "
          f"{tokens_per_s:>10,.0f} tokens/s  ETA {format_seconds(eta)}",
          flush=True)
    return {"tokens_per_s": tokens_per_s}

  def average_tokens_per_s(self, step: int) -> float:
    seconds = time.perf_counter() - self._start_time
    return (step - self._start_step) * self.tokens_per_step / max(seconds,
                                                                  1e-9)


def format_seconds(seconds: float) -> str:
  seconds = int(round(seconds))
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def finite_or_raise(step: int, losses_W: np.ndarray) -> None:
  if not np.all(np.isfinite(losses_W)):
    bad = np.flatnonzero(~np.isfinite(losses_W)).tolist()
    raise FloatingPointError(
        f"Non-finite loss at step {step} on workers {bad}: {losses_W}. "
        "Lower config.inner_opt.learning_rate or check the data.")
