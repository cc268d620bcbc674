"""SparseLoCo's outer step (top-k per chunk, 2-bit values, error feedback
with decay, each coordinate averaged over the workers that sent it, outer
averaging) against a plain numpy transcription of the algorithm, round
after round: what the gap to the paper leaves to the regime is not in the
implementation (docs/communication_topk.md)."""

import jax.numpy as jnp
import numpy as np
import optax

from dipaco_jax.diloco import comm as comm_lib
from dipaco_jax.diloco import comm_step
from dipaco_jax.diloco import compress

_W, _N, _CHUNK, _FRACTION, _DECAY = 4, 40, 16, 0.125, 0.95


def _reference_topk_2bit(e_N):
  """Per chunk of _CHUNK entries (the last one shorter, zero-padded): the k
  largest |e|, each sent as its sign times one of two magnitudes, the mean
  |e| of the larger half of the kept entries or of the smaller half,
  whichever is nearer (the larger from the midpoint up)."""
  k = int(np.floor(_FRACTION * _CHUNK + 0.5))
  padded = np.zeros(-(-e_N.size // _CHUNK) * _CHUNK)
  padded[:e_N.size] = e_N
  sent = np.zeros_like(padded)
  for start in range(0, padded.size, _CHUNK):
    chunk = padded[start:start + _CHUNK]
    kept = np.argsort(-np.abs(chunk), kind="stable")[:k]
    magnitudes = np.abs(chunk[kept])  # descending
    large, small = magnitudes[:k - k // 2].mean(), magnitudes[k - k // 2:].mean()
    level = np.where(magnitudes >= (large + small) / 2, large, small)
    sent[start + kept] = np.sign(chunk[kept]) * level
  return sent[:e_N.size]


def _reference_round(theta_N, e_WxN, delta_WxN):
  """One outer step as SparseLoCo's reference code does it: e <- decay e +
  delta; send Q(topk(e)); e <- e - sent; theta <- theta - (the mean over
  the senders of each coordinate)."""
  e_WxN = _DECAY * e_WxN + delta_WxN
  sent_WxN = np.stack([_reference_topk_2bit(e) for e in e_WxN])
  e_WxN = e_WxN - sent_WxN
  senders_N = (sent_WxN != 0).sum(0)
  mean_N = np.where(senders_N > 0, sent_WxN.sum(0) / np.maximum(senders_N, 1),
                    0.0)
  return theta_N - mean_N, e_WxN


def test_sparseloco_equals_a_numpy_transcription_over_rounds():
  spec = compress.CompressionSpec(
      name="topk", error_feedback=True, topk_fraction=_FRACTION,
      topk_chunk=_CHUNK, feedback_decay=_DECAY, aggregate="senders")
  comms = {"s": comm_lib.SlotComm(spec=spec)}
  tx = optax.sgd(1.0)  # Outer averaging: SGD at lr 1, no momentum.
  rng = np.random.default_rng(0)
  theta_N = rng.normal(size=_N)
  bank = {"s": {"w": jnp.asarray(theta_N[None], jnp.float32)}}
  inner_extra, outer_extra = comm_step.init_extra(
      comms, {"s": {"w": jnp.zeros((_W, _N))}}, bank, tx)
  outer = {"params": bank, "opt_state": {"s": tx.init(bank["s"])},
           **outer_extra}
  inner = dict(inner_extra)
  e_WxN = np.zeros((_W, _N))
  for _ in range(6):
    # The workers' rounds: each moves by its own delta, correlated with
    # the others' (a shared direction plus its own noise).
    delta_WxN = rng.normal(size=_N) + 0.7 * rng.normal(size=(_W, _N))
    delta_WxN = delta_WxN.astype(np.float32).astype(np.float64)
    start_N = np.asarray(outer["params"]["s"]["w"][0], np.float64)
    x_WxN = jnp.asarray(start_N - delta_WxN, jnp.float32)
    outer, inner = comm_step.outer_update(
        outer, dict(inner, params={"s": {"w": x_WxN}}), tx, comms=comms,
        assignment_WxS=np.zeros((_W, 1), np.int32), slot_names=("s",),
        weights_W=jnp.ones(_W), rescale_by_sqrt_users=False)
    theta_N, e_WxN = _reference_round(theta_N, e_WxN, delta_WxN)
    np.testing.assert_allclose(outer["params"]["s"]["w"][0], theta_N,
                               atol=2e-5)
    np.testing.assert_allclose(inner["residual"]["s"]["w"], e_WxN,
                               atol=2e-5)
  # Every worker restarts the next round from the new global modules.
  np.testing.assert_array_equal(inner["params"]["s"]["w"],
                                np.broadcast_to(outer["params"]["s"]["w"],
                                                (_W, _N)))
