"""What a run's store can forget, and its deletion.

The coordinator deletes the keys no task, outer step or rebuild can read
again, so a long run keeps about two rounds on the store (K + 1 rounds
with `inner_state_every` = K, for replays; eager's contributions one round
more). It decides from the frontier it has saved (a restarted coordinator
must not look for what was deleted). Its role deletes in a thread of its
own (`background.OneAtATime`): a round after a commit round at K = 10 it
deletes ten rounds at once, and while its loop did that a worker waited
about 2 s for its next lease (one H200, `docs/islands.md`).
"""

from dipaco_jax.islands import layout
from dipaco_jax.store import atomic


class Collector:
  """A run's deletions so far (`record`, saved with the coordinator's
  state) and the next ones. `record` is replaced, never changed in place,
  and only once its keys are deleted, so the scheduling loop may save it
  while a thread deletes."""

  def __init__(self, run, spec: layout.RunSpec, groups, modules,
               contrib_lag: int, record: dict | None):
    """`modules`: every (unit key, expert); `contrib_lag`: rounds of
    contributions kept beyond their version's; `record`: the saved one."""
    self.run, self.spec, self.groups = run, spec, groups
    self.modules, self.contrib_lag = modules, contrib_lag
    record = record or {"inner": {}, "version": 0}
    # Per worker the first AdamW step kept; the oldest module version kept.
    self.record = {"inner": {int(w): n for w, n in record["inner"].items()},
                   "version": record["version"]}

  def replay_from(self, round_index: int) -> int:
    """The first round a task of `round_index` may read (modules, inner
    state): itself, or with `inner_state_every` = K > 1, the last commit
    round a replay starts from (`islands/replay.py`); a finished group
    needs nothing before its end."""
    if round_index >= self.spec.num_rounds:
      return self.spec.num_rounds
    return self.spec.last_commit_round(round_index)

  def rebuild_from(self, round_index: int) -> int:
    """The first round kept for a rebuild (`islands/repair.py`): the one
    before `round_index`, whose task or outer step made what round
    `round_index` reads; once the run is done, only its last outer step
    can be needed again."""
    if round_index >= self.spec.num_rounds:
      return self.spec.num_rounds - 1
    return self.replay_from(max(round_index - 1, 0))

  def collect(self, frontier: list[int]) -> None:
    """Deletes, given each group's next undone round: a group's AdamW
    states before the state its last round started or replayed from, and
    module versions (with their optimizer states and contributions) before
    the one the newest was made from. A finished run keeps its last two
    versions."""
    h, num_rounds = self.spec.inner_steps, self.spec.num_rounds
    for g, workers in enumerate(self.groups):
      keep = (self.rebuild_from(frontier[g]) if frontier[g] < num_rounds
              else num_rounds) * h
      for w in workers:
        first = self.record["inner"].get(w, 0)
        for step in range(first, keep, h):
          atomic.remove(layout.inner_dir(self.run, w, step))
        self.record = {**self.record, "inner": {**self.record["inner"],
                                                w: max(first, keep)}}
    oldest_round = self.rebuild_from(min(frontier))
    # A record saved before a restart can lag the deletions it describes.
    # A version none of whose modules is committed was deleted (each only
    # once the next was committed; version 0 exists from the start), and
    # the check below would wait on its successor for ever: step over it.
    while self.record["version"] < oldest_round and not any(
        layout.committed(layout.module_dir(
            self.run, name, e, self.record["version"]))
        for name, e in self.modules):
      self.record = {**self.record, "version": self.record["version"] + 1}
    # Version v is read by round v's tasks (and replays) and by round v's
    # outer step (which writes v + 1): done once every group passed round
    # v and every module has v + 1.
    while self.record["version"] < oldest_round and all(
        layout.committed(layout.module_dir(
            self.run, name, e, self.record["version"] + 1))
        for name, e in self.modules):
      v = self.record["version"]
      for name, e in self.modules:
        atomic.remove(layout.module_dir(self.run, name, e, v))
        atomic.remove(layout.outer_state_dir(self.run, name, e, v))
        atomic.remove(layout.download_dir(self.run, name, e, v))
        atomic.remove(layout.published_dir(self.run, name, e, v))
      if v >= self.contrib_lag:
        atomic.remove(layout.contrib_round_dir(self.run, v - self.contrib_lag))
      self.record = {**self.record, "version": v + 1}
