"""lowrank_shared (PowerSGD's subspace shared by a module's users): against
a numpy transcription of PowerSGD's algorithm, exact on contributions of a
common rank-r column space, equal to the per-worker codec when each module
has one user, lossless over rounds with error feedback, and its bytes
counted both ways."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dipaco_jax.diloco import comm as comm_lib
from dipaco_jax.diloco import comm_step
from dipaco_jax.diloco import compress
from dipaco_jax.diloco import compress_apply
from dipaco_jax.diloco import compress_lowrank as lowrank
from dipaco_jax.diloco import compress_shared

SPEC = compress.CompressionSpec(name="lowrank_shared", rank_max=2,
                                error_feedback=True)
# Workers 0 and 1 use module 0 (weights 1 and 3: a = 1/4, 3/4), worker 2
# module 1 alone.
EXPERTS_W = np.array([0, 0, 1])
A_WxK = np.array([[0.25, 0.0], [0.75, 0.0], [0.0, 1.0]], np.float32)


def _gram_schmidt(a):
  """PowerSGD's orthogonalization, column by column, in float64."""
  q = np.zeros_like(a)
  for j in range(a.shape[1]):
    v = a[:, j] - q[:, :j] @ (q[:, :j].T @ a[:, j])
    q[:, j] = v / np.linalg.norm(v)
  return q


def _powersgd(m_WxMxN, q_KxNxR):
  """One round of PowerSGD per module, by its users' weights: (what each
  worker's contribution is taken to be, each module's next warm start)."""
  sent = np.zeros_like(m_WxMxN)
  q_next = np.zeros_like(q_KxNxR)
  for k in range(A_WxK.shape[1]):
    users = np.flatnonzero(EXPERTS_W == k)
    p = sum(A_WxK[w, k] * m_WxMxN[w] @ q_KxNxR[k] for w in users)
    basis = _gram_schmidt(p)
    for w in users:
      q_w = m_WxMxN[w].T @ basis
      sent[w] = basis @ q_w.T
      q_next[k] += A_WxK[w, k] * q_w
  return sent, q_next


def _rng_matrices(seed, shape=(3, 6, 5)):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _start_q(shape=(6, 5)):
  return np.broadcast_to(lowrank.init_q(shape[1], SPEC.rank_max),
                         (3, shape[1], SPEC.rank_max))


def test_one_round_is_powersgd_by_numpy():
  m = _rng_matrices(0)
  sent, residual, q_next, bytes_W = compress_shared.compress_leaf(
      SPEC, m, None, jnp.asarray(_start_q()), A_WxK, EXPERTS_W)
  want_sent, want_q_K = _powersgd(m.astype(np.float64),
                                  _start_q()[[0, 2]].astype(np.float64))
  np.testing.assert_allclose(sent, want_sent, atol=2e-5)
  np.testing.assert_allclose(residual, m - want_sent, atol=2e-5)
  # Every user receives its module's mean Q as the next warm start.
  np.testing.assert_allclose(q_next, want_q_K[EXPERTS_W], atol=2e-5)
  # (m + n) r float32 values per worker.
  np.testing.assert_array_equal(bytes_W, np.full(3, 4.0 * (6 + 5) * 2))
  # The module's mix is the rank-2 approximation in the shared basis:
  # rank 2, though its two users' contributions differ.
  mixed = A_WxK[0, 0] * np.asarray(sent[0]) + A_WxK[1, 0] * np.asarray(
      sent[1])
  assert np.linalg.matrix_rank(mixed, tol=1e-4) == 2


def test_a_common_column_space_is_sent_exactly():
  # M_w = U V_w^T with U shared by the users: the basis spans U, nothing
  # is lost, whatever each worker's V_w.
  rng = np.random.default_rng(1)
  u = rng.standard_normal((6, 2))
  m = np.stack([u @ rng.standard_normal((5, 2)).T for _ in range(2)]
               + [rng.standard_normal((6, 2)) @ rng.standard_normal((2, 5))]
               ).astype(np.float32)
  sent, residual, _, _ = compress_shared.compress_leaf(
      SPEC, m, None, jnp.asarray(_start_q()), A_WxK, EXPERTS_W)
  np.testing.assert_allclose(sent, m, atol=1e-5)
  np.testing.assert_allclose(residual, 0.0, atol=1e-5)


def test_one_user_per_module_is_the_per_worker_codec():
  # Alone in its module, a worker's basis is its own: the per-worker codec
  # at a fixed rank (energy 1) sends the same, round after round (the warm
  # starts differ by a rotation of the same span).
  experts_W = np.arange(3)
  a_WxK = np.eye(3, dtype=np.float32)
  per_worker = compress.make_codec(dataclasses.replace(
      SPEC, name="lowrank", rank_min=SPEC.rank_max, energy=1.0))
  shared_q = jnp.asarray(_start_q())
  shared_res = own_res = None
  own_state = {"q": jnp.asarray(_start_q())}
  for r in range(3):
    m = _rng_matrices(10 + r)
    shared_sent, shared_res, shared_q, _ = compress_shared.compress_leaf(
        SPEC, m, shared_res, shared_q, a_WxK, experts_W)
    own_sent, own_res, own_state, _ = compress_apply.compress_tree(
        per_worker, jnp.asarray(m), own_res, own_state)
    np.testing.assert_allclose(shared_sent, own_sent, atol=2e-5)


def test_error_feedback_loses_nothing_over_rounds():
  q, residual = jnp.asarray(_start_q()), None
  total_sent = np.zeros((3, 6, 5))
  total_contrib = np.zeros((3, 6, 5))
  for r in range(4):
    m = _rng_matrices(20 + r)
    sent, residual, q, _ = compress_shared.compress_leaf(
        SPEC, m, residual, q, A_WxK, EXPERTS_W)
    total_sent += np.asarray(sent)
    total_contrib += m
  np.testing.assert_allclose(total_sent + np.asarray(residual),
                             total_contrib, atol=1e-4)


@pytest.mark.parametrize("bits", [8, 4])
def test_integer_factors_are_what_the_bytes_count(bits):
  spec = dataclasses.replace(SPEC, factor_bits=bits, block_size=4)
  m = _rng_matrices(30)
  sent, residual, _, bytes_W = compress_shared.compress_leaf(
      spec, m, None, jnp.asarray(_start_q()), A_WxK, EXPERTS_W)
  # Per factor: r columns of codes (bits each, packed) and a scale per
  # block of 4 values of a column: P 6 x 2, Q 5 x 2.
  want = sum(-(-2 * n * bits // 8) + 4 * 2 * -(-n // 4) for n in (6, 5))
  np.testing.assert_array_equal(bytes_W, np.full(3, float(want)))
  np.testing.assert_allclose(np.asarray(sent) + np.asarray(residual), m,
                             atol=1e-5)
  # Rounded factors: close to the float32 factors' result, not equal.
  exact, _, _, _ = compress_shared.compress_leaf(
      SPEC, m, None, jnp.asarray(_start_q()), A_WxK, EXPERTS_W)
  err = np.abs(np.asarray(sent) - np.asarray(exact)).max()
  assert 0 < err < (0.05 if bits == 8 else 0.8) * np.abs(exact).max()


def test_a_vector_goes_whole():
  v = _rng_matrices(40, (3, 7))
  sent, residual, q, bytes_W = compress_shared.compress_leaf(
      SPEC, v, None, None, A_WxK, EXPERTS_W)
  np.testing.assert_array_equal(sent, v)
  np.testing.assert_array_equal(residual, 0.0)
  assert q is None
  np.testing.assert_array_equal(bytes_W, np.full(3, 28.0))


def test_a_round_counts_the_means_read_inside_it():
  # One module of a 6 x 5 matrix and a 7-vector, two users, float32
  # downloads. A user sends both factors, (6 + 5) 2 float32 values, and the
  # vector; it reads its module's mean P and Q, (6 + 5) 2 float32 values,
  # inside the round, then the module whole (30 + 7 values).
  comms = {"s": comm_lib.SlotComm(spec=SPEC)}
  tx = optax.sgd(1.0)
  bank = {"s": {"m": jnp.zeros((1, 6, 5)), "v": jnp.zeros((1, 7))}}
  rng = np.random.default_rng(50)
  params = {"s": {"m": jnp.asarray(rng.standard_normal((2, 6, 5)),
                                   jnp.float32),
                  "v": jnp.asarray(rng.standard_normal((2, 7)),
                                   jnp.float32)}}
  inner_extra, outer_extra = comm_step.init_extra(comms, params, bank, tx)
  outer = {"params": bank, "opt_state": {"s": tx.init(bank["s"])},
           **outer_extra}
  inner = dict(inner_extra, params=params)
  _, inner = comm_step.outer_update(
      outer, inner, tx, comms=comms,
      assignment_WxS=np.zeros((2, 1), np.int32), slot_names=("s",),
      weights_W=jnp.ones(2), rescale_by_sqrt_users=False)
  factors = 4.0 * (6 + 5) * SPEC.rank_max
  np.testing.assert_array_equal(inner["sent_bytes_W"], [factors + 28] * 2)
  np.testing.assert_array_equal(inner["recv_bytes_W"],
                                [factors + 4.0 * (30 + 7)] * 2)
