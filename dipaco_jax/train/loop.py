"""The training loop of the SPMD runtime: inner steps, outer syncs, hooks.

Deterministic by step: the batch of worker w at step s is a pure function of
(seed, shard, w, s), and the state holds everything else, so resuming from a
checkpoint reproduces an uninterrupted run exactly (DESIGN invariant 3).
"""

import collections
import dataclasses
import functools

from etils import epath
import jax
import jax.numpy as jnp
import numpy as np

from dipaco_jax.data import prefetch
from dipaco_jax.parallel import multihost
from dipaco_jax.train import checkpoint as ckpt_lib
from dipaco_jax.train import dispatch
from dipaco_jax.train import metrics as metrics_lib
from dipaco_jax.train import preemption
from dipaco_jax.train import profiling
from dipaco_jax.train import sync as sync_lib


@dataclasses.dataclass
class TrainResult:
  state: dict
  steps: int
  resumed_from: int | None
  tokens_per_s: float
  final_losses_W: np.ndarray


def train(runtime, batches, run_dir: str, hashes: dict, name: str,
          init_bank=None, hooks=(), after_outer_step=(),
          synchronizer: sync_lib.Synchronizer | None = None) -> TrainResult:
  """Runs (or resumes) `config.train.num_steps` inner steps.

  Args:
    runtime: a `train.state.Runtime`.
    batches: has `batch(step, streams) -> [len(streams), B, L+1]`, the rows
      of those workers (data.batches.StackedBatches); each process asks for
      its `runtime.local_workers`.
    run_dir: this run's directory (checkpoints/, logs/).
    hashes: what the checkpoint must match on resume.
    name: shown in progress lines.
    init_bank: start from these modules instead of a random init.
    hooks: callables `hook(step, state, losses_W)` run for every step, in
      order, once its metrics arrive (`train.metrics_lag` dispatches late,
      so they never stall the device; the state passed is the newest one,
      which may be that many dispatches of `train.steps_per_dispatch`
      steps ahead).
    after_outer_step: callables `fn(step, state)` run right after each outer
      step (e.g. per-path early stopping); with a synchronizer's
      `lag_steps`, after each apply and at the end. One with a `flush()`
      method (writes it left to a background thread) has it called before
      every checkpoint and at the end.
    synchronizer: where outer steps come from (`train.sync`); by default
      the in-process jitted step of `runtime`.
  """
  c = runtime.config
  num_steps, sync_every = c.train.num_steps, c.diloco.inner_steps
  sync = synchronizer or sync_lib.InProcessSync(runtime)
  run_dir = epath.Path(run_dir)
  ckpt = ckpt_lib.Checkpointer(str(run_dir / "checkpoints"), c.ckpt.every,
                               c.ckpt.keep, c.ckpt.async_save)
  meta = {"hashes": hashes, "name": name}
  # The newest checkpoint whose digests check out (damaged ones are
  # reported and set aside); `latest` is the step actually restored.
  latest = None
  restored = ckpt.restore_latest(runtime.abstract_state, hashes)
  if restored is not None:
    state, _, latest = restored
  elif init_bank is not None:
    state = runtime.state_from_bank(init_bank)
  else:
    state = runtime.init_state(jax.random.key(c.seed))
  start = int(jax.device_get(state["step"]))
  if start >= num_steps:
    ckpt.close()
    print(f"[{name}] already trained {start} steps in {run_dir}; reusing.",
          flush=True)
    return TrainResult(state, start, latest, 0.0, np.array([]))

  writes = multihost.is_writer()  # logs come from process 0 alone
  if latest is not None and writes:  # Steps logged after the checkpoint
    metrics_lib.drop_rows_after(     # run again.
        run_dir / "logs" / "train" / "metrics.jsonl", start)
  writer = metrics_lib.MetricWriter(str(run_dir)) if writes else None
  comm_log = run_dir / "logs" / "train" / metrics_lib.COMM_LOG
  if latest is not None and writes:
    metrics_lib.drop_rows_after(comm_log, start)
  tokens_per_step = (runtime.topology.num_workers * c.train.batch_size *
                     c.data.seq_len)
  # A pipelined step's bubble (the share of it idled) closes each line.
  progress = metrics_lib.Progress(
      name, start, num_steps, tokens_per_step,
      note=f"pipeline bubble {runtime.bubble_fraction:.1%}"
      if runtime.pipeline else "")
  if latest is not None:
    print(f"[{name}] resuming from step {latest} in {run_dir}", flush=True)
  # (last step, steps, metrics on device) per dispatch, read
  # `metrics_lag` dispatches late: reading a dispatch's metrics waits for
  # the device to finish it, so with a lag of 1 the host has one
  # dispatch's time to send the next; a larger lag keeps more queued
  # (bench/scaling.py --set=train.metrics_lag=2).
  pending = collections.deque()
  last_losses = np.array([])
  window = []  # Losses since the last log line: logged as their mean.
  # Stops a diverging run before its state is saved (every process alike:
  # it reads the same gathered losses and global norms).
  # With `lag_steps` (delay=overlap) the parameters change tau steps after
  # each round's end, first after round 0's apply.
  guard = metrics_lib.DivergenceGuard(sync_every, start, state,
                                      outer_offset=sync_lib.lag_steps(sync))

  def drain(done, num_steps_run, device_metrics, norm_after, comm_bytes):
    """The metrics of one dispatch: of step `done`, or [K, W] of the K
    steps ending there; when an outer step followed it, `norm_after`: the
    parameters' (norm, finite) after that, and `comm_bytes`: what each
    worker's compressed contribution weighed (`sent_bytes_W`; a low
    rank's adapts: measured, not computed) and, with compressed
    downloads, what it read back (`recv_bytes_W`), or None."""
    if comm_bytes is not None:
      # A collective with several processes: all read, process 0 logs.
      host_bytes = multihost.to_host(comm_bytes)
      if writes:
        metrics_lib.append_jsonl(comm_log, {"step": done, **{
            k: np.asarray(v).tolist() for k, v in host_bytes.items()}})
    host = multihost.to_host(device_metrics)
    if num_steps_run == 1:
      drain_step(done, host, norm_after)
      return
    for i in range(num_steps_run):
      step = done - num_steps_run + 1 + i
      drain_step(step, {key: np.asarray(v)[i] for key, v in host.items()},
                 norm_after if step == done else None)

  def drain_step(step, host, norm_after=None):
    nonlocal last_losses
    losses_W = np.asarray(host["loss"])
    guard.check_losses(step, losses_W)
    if guard.outer_step_at(step):
      # Exploded parameters may show in the loss only steps later: check
      # them as they were right after the outer step.
      if norm_after is None:  # Not measured then: the newest state.
        guard.check_params(step, state)
      else:
        guard.check_norm(step, float(norm_after[0]), bool(norm_after[1]))
    last_losses = losses_W
    window.append(losses_W)
    if step % c.train.log_every == 0 or step == num_steps:
      mean_W = np.mean(window, axis=0)
      window.clear()
      scalars = {"loss": mean_W.mean(), "last_loss": losses_W.mean(),
                 "grad_norm": np.asarray(host["grad_norm"]).mean()}
      for w, loss in enumerate(mean_W):
        scalars[f"loss/worker_{w}"] = loss
      scalars.update(progress.report(step, float(mean_W.mean()),
                                     show=writes))
      if writer is not None:
        writer.write(step, scalars)
    for hook in hooks:
      hook(step, state, losses_W)

  # Dispatches of `train.steps_per_dispatch` steps that end at every
  # outer step and checkpoint (train/dispatch.py).
  dispatches = dispatch.plan(
      start, num_steps, c.train.steps_per_dispatch,
      lambda done: bool(sync_every and done % sync_every == 0)
      or sync_lib.finish_due(sync, done, sync_every) is not None
      or ckpt.should_save(done, num_steps))
  # Each process makes only the rows of the workers its devices hold.
  local_batch = functools.partial(batches.batch,
                                  streams=runtime.local_workers)

  def device_batch(i):
    """Dispatch i's batch, built and put on the devices by the prefetch
    thread, off the loop's critical path."""
    step, n = dispatches[i]
    return step, n, runtime.worker_rows(dispatch.host_rows(local_batch, step,
                                                           n))

  trace_dir = run_dir / "logs" / "profile"
  if jax.process_count() > 1:
    trace_dir = trace_dir / f"process_{jax.process_index()}"
  def save(done):
    # Never checkpoint a diverged state: read this step's losses and
    # check the parameters themselves before saving.
    while pending:
      drain(*pending.popleft())
    guard.check_params(done, state)
    _flush(after_outer_step)
    ckpt.save(done, state, meta)
    if writes:  # The figures a resumed or reused run reports.
      metrics_lib.write_run_summary(run_dir, start, done, progress.elapsed(),
                                    tokens_per_step, last_losses)

  try:
    with prefetch.Prefetcher(device_batch, 0, len(dispatches),
                             c.data.prefetch) as batch_iter, \
        profiling.StepTracer(c.train.profile_steps, trace_dir,
                             c.train.profile_python) as tracer, \
        preemption.saving_on_signal(c.ckpt.get("preemption_grace_s", 30.0)):
      for _, (step, n, batch) in batch_iter:
        comm_bytes = None
        tracer.before(step, n)
        if n == 1:
          state, device_metrics = runtime.inner_step(state, batch)
        else:
          state, device_metrics = runtime.inner_k_steps(state, batch)
        done = step + n
        due = sync_lib.finish_due(sync, done, sync_every)
        if due is not None:  # Before a start at this step (tau = H).
          state = sync.finish(due, state)
          if done % sync_every:  # Else run once, after the start below.
            for fn in after_outer_step:
              fn(done, state)
        if sync_every and done % sync_every == 0:
          state = _sync_round(sync, done // sync_every - 1, state)
          if "sent_bytes_W" in state["inner"]:
            # Logged when this dispatch drains: reading it now would wait
            # for the outer step. A copy, since the next dispatch donates
            # the state's own buffer.
            comm_bytes = {k: jnp.copy(state["inner"][k]) for k in (
                "sent_bytes_W", "recv_bytes_W") if k in state["inner"]}
          if done == num_steps:
            # A delayed synchronizer's open rounds, before the final save.
            state = sync_lib.finish_remaining(sync, done // sync_every - 1,
                                              state)
          # A lag synchronizer's handover leaves the global modules as
          # they were: its hooks run after its applies and at the end.
          if not (sync_lib.lag_steps(sync) and due is None
                  and done != num_steps):
            for fn in after_outer_step:
              fn(done, state)
        tracer.after(step, n, state)
        # The guard's norm of the parameters right after an outer step,
        # dispatched now and read with this dispatch's metrics: reading it
        # from the newest state instead waited for the device to finish
        # everything queued, and left it idle once a round.
        norm_after = (metrics_lib.device_param_norm(state)
                      if guard.outer_step_at(done) else None)
        pending.append((done, n, device_metrics, norm_after, comm_bytes))
        while len(pending) > c.train.metrics_lag:
          drain(*pending.popleft())
        ckpt.check_for_errors()
        saved = ckpt.should_save(done, num_steps)
        if saved:
          save(done)
        if done < num_steps and _preempted(done, sync_every):
          if not saved:
            save(done)
          raise preemption.saved(done)
      while pending:
        drain(*pending.popleft())
      _flush(after_outer_step)
  finally:
    ckpt.close()
    if writer is not None:
      writer.close()
  # What process 0 wrote during training (early-stopping snapshots) is read
  # by every process next.
  multihost.barrier(f"trained {name}")
  return TrainResult(state, num_steps, latest,
                     progress.average_tokens_per_s(num_steps), last_losses)


def _preempted(done: int, sync_every: int) -> bool:
  """Whether a preemption signal arrived: at any dispatch in one process;
  with several, all must stop at the same step, so they agree at round
  ends only (a collective per dispatch would sync the hosts)."""
  if jax.process_count() == 1:
    return preemption.requested() is not None
  if sync_every and done % sync_every:
    return False
  return multihost.any_process(preemption.requested() is not None)


def _flush(after_outer_step) -> None:
  """What the callbacks write in the background reaches the disk before a
  checkpoint does (a resumed run must not find its callbacks' files older
  than its checkpoint)."""
  for fn in after_outer_step:
    if hasattr(fn, "flush"):
      fn.flush()


def _sync_round(sync, round_index: int, state):
  """Ends round `round_index`: hands it over, and applies the round that is
  due (`sync.delay` rounds earlier)."""
  state = sync.start(round_index, state)
  if round_index >= sync.delay and not sync_lib.lag_steps(sync):
    state = sync.finish(round_index - sync.delay, state)
  return state
