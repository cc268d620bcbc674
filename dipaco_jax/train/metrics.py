"""Metrics: TensorBoard summaries, `metrics.jsonl`, progress lines, the
divergence guard and the run's training figures (`summary.json`)."""

import collections
import json
import time

from absl import logging
from etils import epath
import jax
import jax.numpy as jnp
import numpy as np

from dipaco_jax import errors
from dipaco_jax.store import atomic


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


# Per outer step, the payload bytes each worker sent (DiLoCoX compression)
# and, with compressed downloads, read back: `logs/train/comm.jsonl`, rows
# {"step", "sent_bytes_W"[, "recv_bytes_W"]}.
COMM_LOG = "comm.jsonl"


def append_jsonl(path, row: dict) -> None:
  path = epath.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  with path.open("a") as f:
    f.write(json.dumps(row) + "\n")


def read_jsonl(path) -> list[dict]:
  path = epath.Path(path)
  if not path.exists():
    return []
  return [json.loads(line) for line in path.read_text().splitlines() if line]


class Progress:
  """Step, loss, tokens/s and ETA, measured between log points."""

  def __init__(self, name: str, first_step: int, last_step: int,
               tokens_per_step: int, note: str = ""):
    self.name, self.last_step = name, last_step
    self.note = f"  {note}" if note else ""  # Fixed, e.g. the bubble.
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
          f"{tokens_per_s:>10,.0f} tokens/s  ETA {format_seconds(eta)}"
          f"{self.note}", flush=True)
    return {"tokens_per_s": tokens_per_s}

  def elapsed(self) -> float:
    """Seconds since this process started training (compilation included)."""
    return time.perf_counter() - self._start_time

  def average_tokens_per_s(self, step: int) -> float:
    return (step - self._start_step) * self.tokens_per_step / max(
        self.elapsed(), 1e-9)


def format_seconds(seconds: float) -> str:
  seconds = int(round(seconds))
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


# --- Divergence -------------------------------------------------------------


class DivergenceError(FloatingPointError, errors.UserError):
  """Training diverged; the state was not saved. The message names the step
  and the learning rate to lower."""


def blame(step: int, after_outer_step: bool) -> str:
  """The likely cause of a divergence first seen at `step`, as advice: the
  outer step when it came right after one (at `step`), else the inner one."""
  if after_outer_step:
    return ("Lower config.diloco.outer_lr (diverged right after the outer "
            f"step at step {step})")
  return f"Lower config.inner_opt.learning_rate (diverged at step {step})"


def _some(values) -> str:
  """A few numbers for a one-line message (there may be 256 workers)."""
  values = [float(v) for v in np.ravel(values)]
  shown = ", ".join(f"{v:.4g}" for v in values[:4])
  return f"[{shown}{', ...' if len(values) > 4 else ''}]"


def finite_or_raise(step: int, losses_W: np.ndarray,
                    cause: str | None = None) -> None:
  """Raises `DivergenceError` naming `cause` (default: the inner learning
  rate) when a loss of step `step` is not finite."""
  if not np.all(np.isfinite(losses_W)):
    bad = np.flatnonzero(~np.isfinite(losses_W))
    cause = cause or blame(step, False)
    raise DivergenceError(
        f"Non-finite loss at step {step} on workers {_some(bad)[1:-1]}: "
        f"{_some(np.asarray(losses_W)[bad])}; not saved. {cause}, or check "
        "the data.")


@jax.jit
def _norm_and_finite(params):
  leaves = [x.astype(jnp.float32) for x in jax.tree.leaves(params)]
  norm = jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in leaves))
  finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))
  return norm, finite


def param_norm(state) -> tuple[float, bool]:
  """The global L2 norm of the parameters in `state` (every worker's inner
  copy and, when present, the outer bank), and whether all are finite.

  One jitted reduction: cheap next to a step. Finite parameters above ~1e19
  overflow the float32 norm to inf, which reads as a jump too.
  """
  norm, finite = device_param_norm(state)
  return float(norm), bool(finite)


def device_param_norm(state):
  """`param_norm` left on the device: (norm, finite) as device scalars,
  dispatched after whatever computes `state` and read later, so the host
  need not wait for the device to drain its queue."""
  params = {"inner": state["inner"]["params"]}
  if "outer" in state:
    params["outer"] = state["outer"]["params"]
  return _norm_and_finite(params)


class DivergenceGuard:
  """Stops a run whose loss or parameters blow up, before they are saved.

  Losses: every step, each worker's loss is compared with that worker's
  last `window` losses; more than max(`margin`, `mad_factor` x MAD) nats
  above their median (MAD: median absolute deviation) trips it, as does a
  non-finite loss. Parameters: the global norm is checked right after each
  outer step and before each save; more than `norm_factor` x its value at
  the previous check (the first: where this process started) trips it.
  Exploded parameters need not show in the loss first: after
  `diloco.outer_lr=1e30` the next loss is ln(vocab) (saturated logits,
  uniform predictions), lower than before, and NaN only a step later.

  Why these thresholds never fire on healthy training: a 3-nat jump is 20x
  the perplexity, and step-to-step noise of a loss is ~0.1 nats; a median
  (not a mean or the last value) ignores a single noisy step, and the MAD
  term widens the band while the loss still falls fast from the random
  init (a falling loss never trips: the band is above the median). The
  modest rise right after an outer step (tenths of a nat) stays far
  inside. No "2x the median" rule: at a loss of 0.1 nats that would fire
  on a 0.1-nat bump. A healthy run's parameter norm grows slowly (weight
  decay; RMSNorm scales and embeddings dominate it at init), never 10x
  between checks.
  """

  def __init__(self, sync_every: int, start_step: int, state, window=20,
               margin=3.0, mad_factor=10.0, norm_factor=10.0,
               outer_offset=0):
    self.sync_every = sync_every
    self.outer_offset = outer_offset  # tau of delay=overlap's applies.
    self.margin, self.mad_factor = margin, mad_factor
    self.norm_factor = norm_factor
    self._recent = collections.deque(maxlen=window)  # losses_W per step
    self._norm_step = start_step
    self._norm, finite = param_norm(state)
    if not finite:
      raise DivergenceError(
          f"The parameters this run starts from (step {start_step}) are not "
          "finite: a diverged checkpoint. Use a fresh --workdir, or delete "
          "that checkpoint and lower the learning rate.")

  def outer_step_at(self, step: int) -> bool:
    """Whether an outer step ran right after inner step `step`."""
    step -= self.outer_offset
    return bool(self.sync_every) and step > 0 and step % self.sync_every == 0

  def check_losses(self, step: int, losses_W) -> None:
    """The losses of step `step`, computed on the parameters after step
    `step - 1` (and so after the outer step there, if any)."""
    losses_W = np.asarray(losses_W, np.float64)
    cause = blame(step - 1, True) if self.outer_step_at(step - 1) else (
        blame(step, False))
    finite_or_raise(step, losses_W, cause)
    if self._recent:
      recent = np.stack(self._recent)
      median = np.median(recent, axis=0)
      mad = np.median(np.abs(recent - median), axis=0)
      limit = median + np.maximum(self.margin, self.mad_factor * mad)
      bad = np.flatnonzero(losses_W > limit)
      if bad.size:
        raise DivergenceError(
            f"Loss jumped at step {step} on workers {_some(bad)[1:-1]}: "
            f"{_some(losses_W[bad])} against a median of "
            f"{_some(median[bad])} over the previous {len(recent)} steps; "
            f"not saved. {cause}.")
    self._recent.append(losses_W)

  def check_params(self, step: int, state) -> None:
    """`state`, the state after step `step` (and its outer step)."""
    if step == self._norm_step:
      return  # This state was checked already.
    self.check_norm(step, *param_norm(state))

  def check_norm(self, step: int, norm: float, finite: bool) -> None:
    """The same check on the norm of the state after step `step`, measured
    earlier (`device_param_norm`)."""
    if step == self._norm_step:
      return
    cause = blame(step, self.outer_step_at(step))
    if not finite:
      raise DivergenceError(f"Non-finite parameters after step {step}; not "
                            f"saved. {cause}.")
    if not norm <= self.norm_factor * self._norm:  # inf included
      raise DivergenceError(
          f"Parameter norm {norm:.3g} after step {step} is more than "
          f"{self.norm_factor:g}x its {self._norm:.3g} at step "
          f"{self._norm_step}; not saved. {cause}.")
    self._norm, self._norm_step = norm, step


# --- The run's training figures ---------------------------------------------

SUMMARY = "summary.json"


def read_run_summary(run_dir) -> dict | None:
  path = epath.Path(run_dir) / SUMMARY
  return json.loads(path.read_text()) if path.exists() else None


def write_run_summary(run_dir, start: int, step: int, seconds: float,
                      tokens_per_step: int, losses_W) -> None:
  """Saves the run's training figures at `step` in `{run_dir}/summary.json`
  (at every checkpoint: a resumed run adds to them, a reused one reports
  them instead of nothing).

  Each process that trained the run is one segment: the steps from where it
  started (`start`) to its last save, and the seconds since it started
  (compilation included) at that save. Steps it ran after its last save are
  redone by the next process, so neither they nor their seconds count.
  tokens/s = all segments' tokens / all segments' seconds.
  """
  previous = read_run_summary(run_dir) or {}
  # Earlier processes' segments up to where this one resumed; this
  # process's own segment is replaced at each save.
  segments = [s for s in previous.get("segments", []) if s["to"] <= start]
  segments.append({"from": start, "to": step, "seconds": seconds,
                   "tokens": (step - start) * tokens_per_step})
  train_seconds = sum(s["seconds"] for s in segments)
  losses_W = [float(x) for x in np.ravel(losses_W)]
  atomic.write_json(epath.Path(run_dir) / SUMMARY, {
      "steps": step, "segments": segments,
      "train_seconds": train_seconds,
      "tokens_per_s": sum(s["tokens"] for s in segments) / max(
          train_seconds, 1e-9),
      "final_losses": losses_W,
      "final_loss": float(np.mean(losses_W)) if losses_W else None})
