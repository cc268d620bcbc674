"""A trace of a range of inner steps (`config.train.profile_steps`).

`train.profile_steps = "START:COUNT"` traces the dispatches that run inner
steps START .. START + COUNT - 1, numbered as the progress lines number
them (the first step is 1), with `jax.profiler` (device kernels, the
host's Python threads, transfers) into a folder of the run's logs, written
as TensorBoard's profile (`tensorboard --logdir DIR`) and as a Perfetto
trace (`perfetto_trace.json.gz`, ui.perfetto.dev; `bench/profile_categories.py`
sorts its device ops given the step's HLO). A dispatch of
`train.steps_per_dispatch` steps is traced whole, so the trace may start
before START and end after the range. The SPMD loop (`train/loop.py`) and
each island worker (`islands/task_runner.py`, whose round r runs steps
r x H + 1 .. (r + 1) x H) use it; tracing changes timing, never a number.
`train.profile_python = False` leaves the host's Python calls out of the
trace: their tracing slows the host, so gaps that the host causes look
longer with it.
"""

from etils import epath
import jax

from dipaco_jax import config_fields

FIELD = "train.profile_steps"


def parse_window(text: str) -> tuple[int, int] | None:
  """'START:COUNT' -> (START, START + COUNT): steps START .. START + COUNT
  - 1 (the first step is 1) are traced; '' -> None.

  Raises ConfigError naming the field on anything else."""
  if not text:
    return None
  start, sep, count = text.partition(":")
  try:
    first, n = int(start), int(count)
  except ValueError:
    first = n = -1
  if not sep or first < 1 or n < 1:
    config_fields.fail(FIELD, f"{text!r} is not START:COUNT (COUNT inner "
                       "steps from step START >= 1, e.g. '100:5'); '' = off.")
  return first, first + n


class StepTracer:
  """Starts `jax.profiler` before the first dispatch that runs a step of
  the window, stops it once a dispatch reaches its end (after the device
  has finished it, so the trace holds the kernels), at most once per
  process. Use as a context manager: an interrupted loop still closes the
  trace."""

  def __init__(self, profile_steps: str, trace_dir, python: bool = True):
    self.window = parse_window(profile_steps)
    self.trace_dir = epath.Path(trace_dir)
    # `train.profile_python`: the host's Python calls traced too (level 1)
    # or only XLA's and the runtime's own host events (level 0).
    self.options = jax.profiler.ProfileOptions()
    self.options.python_tracer_level = int(python)
    self.active = False
    self.finished = False

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    if self.active:
      jax.profiler.stop_trace()
      self.active = False

  def before(self, done: int, n: int) -> None:
    """Called before a dispatch that runs steps done + 1 .. done + n."""
    if self.window is None or self.active or self.finished:
      return
    first, stop = self.window
    if done + 1 < stop and done + n >= first:
      self.trace_dir.mkdir(parents=True, exist_ok=True)
      jax.profiler.start_trace(str(self.trace_dir),
                               create_perfetto_trace=True,
                               profiler_options=self.options)
      self.active = True

  def after(self, done: int, n: int, state) -> None:
    """Called once the dispatch of steps done + 1 .. done + n is queued;
    `state` is its result."""
    if self.active and done + n >= self.window[1] - 1:
      jax.block_until_ready(state)
      jax.profiler.stop_trace()
      self.active, self.finished = False, True
      print(f"[profile] steps {self.window[0]}-{self.window[1] - 1} traced "
            f"into {self.trace_dir}", flush=True)
