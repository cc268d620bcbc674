"""Communication recipes by name (`diloco.preset`), and one-line warnings
for settings measured to do badly.

A preset fills the `config.diloco` fields it names that are still at their
defaults; a field the config or the command line set to anything else is
kept (and said so), so `--config.diloco.preset=sparseloco
--config.diloco.compression_topk_fraction=0.03` is SparseLoCo at 3%. It is
a shorthand: once applied, `preset` is cleared and the run is what the
fields say (they are what config.json and the run's hash hold), so a
derived run (the dense baseline) never fills its fields again.
What each sets, and why (the measurements: docs/communication.md):

  streaming   Streaming DiLoCo's overlap: the outer step lands a tenth of a
              round late (tau = H / 10), int4 + error feedback up, int4
              changes down. DiLoCo x8: +0.36% at 7.8x fewer bytes both ways
              (1 x H200).
  dilocox     DiLoCoX's one-round delay at the outer lr measured best for
              the round length: 1.0 (at H = 50 lr 0.7 cost 18.6% and more),
              but 0.7, the default, at H <= 15 (there lr 1.0 cost +26.61%
              against +9.58%), int4 + error feedback. DiLoCoX's low rank is
              left out: it cost +300% at 305x fewer bytes.
  sparseloco  SparseLoCo: top 64 of every 4096 entries with 2-bit values,
              error feedback decayed by 0.95, outer averaging (SGD lr 1, no
              momentum: the feedback acts as momentum), each coordinate
              averaged over its senders, each chunk's indices as an
              Elias-Fano stream (lossless, not hashed: the same training in
              186.2x fewer bytes up instead of 136.5x). DiLoCo x8 on
              one H200 over 150 rounds of H = 15: +2.53% at 126M, +4.23% at
              42M, +7.14% at 8.4M; +10.50% and
              +22.65% at 42M and 8.4M with H = 50 (30 rounds; +73% and
              +200% with the mean). Shorter rounds are the lever: set H
              yourself (diloco.inner_steps), the preset does not. Nor does
              it compress downloads (a preset that changed its fields would
              change the hash of runs made with it, which would then refuse
              to resume): download_compression=topk with
              download_topk_fraction = the users x 64/4096 (0.125 for 8)
              cost nothing more at 8.4M, for 32x fewer bytes both ways
              (+3.67% at 126M with delay=overlap, tau = 2).
"""

import sys

import jax.numpy as jnp
import numpy as np

from dipaco_jax import config_fields

# Rounds of at most this many inner steps are "short": the delays' outer lrs
# were measured at H = 15 and at H = 50, and the best one_round lr flips
# between them (0.7 at H = 15, 1.0 at H = 50; docs/communication.md).
SHORT_ROUNDS = 15
ONE_ROUND_LR_SHORT = 0.7
# eager's outer lr by the round lengths it was measured at (42M, 2
# replicas): (rounds up to H, warn above lr, the lr to set, the evidence).
# Above the last H nothing was measured, so nothing is said.
EAGER_LR_BY_ROUNDS = (
    (SHORT_ROUNDS, 0.35, 0.35,
     "at H = 15 outer lr 0.7 cost +17.68% against +3.81% at 0.35 (42M, 2 "
     "replicas; +19.26% against +11.90% at 8.4M)"),
    (30, 0.45, 0.4,
     "at H = 30 outer lr 0.55 cost +3.43% against +2.47% at 0.4 (42M, 2 "
     "replicas; 0.35 to 0.45 about the same)"),
)
# eager's outer momentum at short rounds: at H = 15 (126M, 2 replicas, lr
# 0.35) 0.9 cost +6.84% and 0.7 +0.98% against 0.8; at H = 30 (42M) 0.8
# and 0.9 scored alike, so nothing is said there.
EAGER_MOMENTUM_SHORT = 0.8

# Field -> value, or a function of config.diloco for values that follow H.
PRESETS = {
    "streaming": {
        "delay": "overlap",
        "overlap_steps": lambda d: max(1, d.inner_steps // 10),
        "compression": "int4", "error_feedback": True,
        "download_compression": "int4"},
    "dilocox": {
        "delay": "one_round",
        "outer_lr": lambda d: ONE_ROUND_LR_SHORT if (
            d.inner_steps <= SHORT_ROUNDS) else 1.0,
        "compression": "int4", "error_feedback": True},
    "sparseloco": {
        "compression": "topk", "compression_topk_chunk": 4096,
        "compression_topk_fraction": 64 / 4096,
        "compression_index_code": "elias_fano", "error_feedback": True,
        "error_feedback_decay": 0.95, "sparse_aggregate": "senders",
        "outer_optimizer": "sgd", "outer_lr": 1.0, "outer_momentum": 0.0},
}
NAMES = ("",) + tuple(PRESETS)


def apply(config) -> list[str]:
  """Fills `config.diloco` (in place) from its preset; returns what it did,
  one line each ([] without a preset, or when it was applied already)."""
  d = config.diloco
  name = d.get("preset", "")
  if not name:
    return []
  if name not in PRESETS:
    config_fields.fail("diloco.preset", f"{name!r} is not one of "
                       f"{', '.join(PRESETS)} (or '' for none).")
  if d.inner_steps < 1:
    config_fields.fail("diloco.preset", f"{name} sets how outer steps "
                       "communicate; set diloco.inner_steps > 0 (H).")
  from dipaco_jax import config_base  # pylint: disable=g-import-not-at-top
  defaults = config_base.base_config().diloco
  filled, kept = [], []
  for field, value in PRESETS[name].items():
    value = value(d) if callable(value) else value
    if d[field] == value:
      continue
    if d[field] == defaults[field]:
      d[field] = value
      filled.append(f"{field}={value:g}" if isinstance(value, float)
                    else f"{field}={value}")
    else:
      kept.append(f"{field}={d[field]}")
  d.preset = ""
  if not filled:
    return []
  line = f"diloco.preset={name}: set {', '.join(filled)}"
  return [line + (f"; kept your {', '.join(kept)}" if kept else "")]


def warnings(config) -> list[str]:
  """One line per setting measured to do badly, with the fix."""
  from dipaco_jax import paths as paths_lib  # pylint: disable=g-import-not-at-top
  from dipaco_jax.diloco import comm as comm_lib  # pylint: disable=g-import-not-at-top
  from dipaco_jax.diloco import outer as outer_lib  # pylint: disable=g-import-not-at-top
  d = config.diloco
  if d.inner_steps < 1:
    return []
  topology = paths_lib.topology_from_config(config)
  comms = comm_lib.comm_by_slot(config, topology.slots).values()
  delays = {c.delay for c in comms}
  codecs = {c.spec.name for c in comms}
  nesterov = d.outer_optimizer == "nesterov" and d.outer_momentum > 0
  out = []
  # The most users of one module (8 for DiLoCo x8, 4 for DiPaCo 2x2's
  # shared module).
  users = int(max(float(jnp.max(u)) for u in outer_lib.users_per_module(
      topology.assignment_WxS, np.ones(topology.num_workers),
      [slot.num_experts for slot in topology.slots])))
  late = delays & {"one_round", "lookahead", "eager"}
  if late and nesterov and d.inner_steps >= 500:
    out.append(f"delay {'/'.join(sorted(late))} with outer Nesterov at H = "
               f"{d.inner_steps} diverged at H = 500 and 1000; use outer "
               "averaging (diloco.outer_optimizer=sgd, outer_lr=1.0, "
               "outer_momentum=0).")
  else:
    out += _late_delay_warnings(d, late, nesterov, users)
  if "naive" in delays:
    out.append("delay naive is the eager paper's lower bound (workers drop "
               "their own round); train with overlap or one_round.")
  if "topk" in codecs and any(c.spec.name == "topk"
                              and c.spec.aggregate == "mean" for c in comms):
    out.append("compression topk with sparse_aggregate=mean cost +47% at "
               "126M (zeros averaged in); set diloco.sparse_aggregate="
               "senders (diloco.preset=sparseloco).")
  if "topk" in codecs and nesterov:
    out.append("compression topk under outer Nesterov cost +123% (DiLoCo "
               "x8, 8.4M, with the mean) and +14% to +170% over its senders "
               "(DiPaCo 2x2 toy); SparseLoCo averages instead: set diloco."
               "outer_optimizer=sgd, outer_lr=1.0, outer_momentum=0 "
               "(diloco.preset=sparseloco).")
  if any(c.spec.name == "lowrank" and c.spec.error_feedback
         for c in comms) and nesterov:
    out.append("compression lowrank with error feedback under outer "
               "Nesterov diverged at rank 1-2 and cost +300% at rank 20; "
               "use int4 (diloco.preset=dilocox) or topk "
               "(diloco.preset=sparseloco).")
  if "lowrank_shared" in codecs:
    out.append("compression lowrank_shared cost +130% at 118x fewer bytes "
               "at 8.4M and +37% at 42M (150 rounds; top-k: +4% at 136x): "
               "a round's change is only mildly low rank (an eighth of its "
               "rank holds half of it); use topk (diloco.preset=sparseloco).")
  if "strided" in codecs or any(c.download == "strided" for c in comms):
    out.append("compression strided cost +207% at 113.8x fewer bytes both "
               "ways (8.4M, 150 rounds): a round needs each worker's own "
               "largest entries, not a share fixed in advance; use topk "
               "(diloco.preset=sparseloco).")
  if "leader_topk" in codecs:
    out.append("compression leader_topk cost +248% at 136.5x fewer bytes "
               "both ways (8.4M, 150 rounds): one worker's top-k is not "
               "what the others need; use topk (diloco.preset=sparseloco).")
  is_dipaco = any(slot.num_experts > 1 for slot in topology.slots)
  if is_dipaco and nesterov and d.inner_steps <= SHORT_ROUNDS:
    # Measured, not derived (one GPU run; DiLoCo x8's toy went the other
    # way): a guess at why is momentum 0.9 carrying each round's step ~10
    # rounds on while a module's average over its few users is noisy.
    out.append(f"DiPaCo at H = {d.inner_steps} under outer Nesterov: at "
               "H = 15 it was 23% worse in perplexity than outer SGD at lr "
               "1.4 without momentum (DiPaCo 2x2, 1 x H200, 100 rounds); "
               "set diloco.outer_optimizer=sgd, outer_lr=1.4, "
               "outer_momentum=0.")
  # leader_topk's users send on one support: not their top-k together.
  topk_down = [c for c in comms if c.download == "topk"
               and c.spec.name != "leader_topk"]
  if topk_down:
    # A module's change after the outer step covers up to its users' top-k
    # entries together: a download thinner than that trails far behind.
    thin = [c for c in topk_down if c.download_spec.topk_fraction
            < min(1.0, users * c.spec.topk_fraction) - 1e-12]
    if thin:
      want = min(1.0, users * thin[0].spec.topk_fraction)
      out.append(
          f"download_compression topk thinner than its {users} users' "
          "top-k together cost +54% (8.4M) and +1080% (CPU toy) at the "
          "upload's share; at the users' share it cost nothing over float32 "
          "downloads (8.4M, 32x fewer bytes both ways): set "
          f"diloco.download_topk_fraction={want:g}.")
  return out


def _late_delay_warnings(d, late: set, nesterov: bool, users: int
                         ) -> list[str]:
  """The late delays' outer lr, by the round length it was measured at
  (DiLoCo x8 of 8.4M unless said; one_round between H = 15 and 50, eager
  above H = 30 and a lookahead at short rounds were not measured, so
  nothing is said of them),
  and eager at many replicas, where it is far behind one_round."""
  out = []
  rounds = sorted(late - {"eager"})
  short = d.inner_steps <= SHORT_ROUNDS
  if rounds and nesterov and d.inner_steps >= 50 and d.outer_lr < 1.0:
    out.append(f"delay {'/'.join(rounds)} at outer lr {d.outer_lr:g} "
               "cost 18.6% and more in perplexity at H = 50 (DiLoCo x8; "
               "+45% on DiPaCo 2x2); set diloco.outer_lr=1.0 "
               "(diloco.preset=dilocox), or use delay=overlap "
               "(diloco.preset=streaming).")
  if ("one_round" in late and nesterov and short
      and d.outer_lr > ONE_ROUND_LR_SHORT):
    out.append(f"delay one_round at outer lr {d.outer_lr:g} with rounds of "
               f"H = {d.inner_steps}: at H = 15 outer lr 1.0 cost +26.61% "
               "against +9.58% at 0.7 (DiLoCo x8; +34.48% against +15.59% "
               f"at 2 replicas); set diloco.outer_lr={ONE_ROUND_LR_SHORT:g}.")
  if "eager" in late and users >= 8:
    out.append(f"delay eager with {users} users of a module cost +42.30% at "
               "8 replicas against one_round's +9.58% (H = 15): a worker's "
               "own fresh round is an eighth of its estimate; use "
               "delay=one_round or overlap, or eager at 2 replicas.")
  elif "eager" in late and nesterov:
    measured = [rule for rule in EAGER_LR_BY_ROUNDS
                if d.inner_steps <= rule[0]]
    if measured and d.outer_lr > measured[0][1]:
      _, _, lr, evidence = measured[0]
      out.append(f"delay eager at outer lr {d.outer_lr:g} with rounds of "
                 f"H = {d.inner_steps}: {evidence}; set "
                 f"diloco.outer_lr={lr:g}.")
    if short and d.outer_momentum > EAGER_MOMENTUM_SHORT:
      out.append(f"delay eager at outer momentum {d.outer_momentum:g} with "
                 f"rounds of H = {d.inner_steps}: at H = 15 momentum 0.9 "
                 "cost +6.84% against 0.8 (126M, 2 replicas, outer lr 0.35; "
                 "+8.9% on a CPU toy); set diloco.outer_momentum="
                 f"{EAGER_MOMENTUM_SHORT:g}.")
  return out


def announce(config) -> None:
  """Applies the preset and prints what it did, one line each, on stderr
  (the job's own output stays on stdout)."""
  for line in apply(config):
    print(line, file=sys.stderr, flush=True)


def warn(config) -> None:
  """Prints every warning of a validated config, one line each, on
  stderr."""
  for line in warnings(config):
    print(f"warning: {line}", file=sys.stderr, flush=True)
