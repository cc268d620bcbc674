"""leader_topk (ScaleCom's cyclic local top-k): a module's users send on
their leader's chunked top-k support, the leader taking turns by round; by
hand on a tiny leaf, equal to chunked topk with one user per module, lossless
with error feedback, its bytes; in the SPMD loop it trains, logs what each
worker sent and read, and resumes exactly; islands refuse it."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dipaco_jax import config_base
from dipaco_jax import testing
from dipaco_jax.diloco import comm as comm_lib
from dipaco_jax.diloco import comm_step
from dipaco_jax.diloco import compress
from dipaco_jax.diloco import compress_apply
from dipaco_jax.diloco import compress_leader
from dipaco_jax.diloco import compress_topk
from dipaco_jax.diloco import outer as outer_lib
from dipaco_jax.diloco import overlap_step
from dipaco_jax.diloco import presets
from dipaco_jax.errors import UserError
from dipaco_jax.islands import units
from dipaco_jax.train import loop
from dipaco_jax.train import metrics as metrics_lib

# Chunks of 4 keeping 3 (2-bit indices): 8 values are two chunks.
SPEC = compress.CompressionSpec(name="leader_topk", topk_chunk=4,
                                topk_fraction=0.75, error_feedback=True)


def _round(spec, c_W, residual, round_W, a_WxK, experts_W):
  return jax.jit(functools.partial(compress_leader.compress_leaf, spec))(
      c_W, residual, round_W, a_WxK, experts_W)


def _weights(experts_W, weights_W):
  """The slot's mixing weights a[w, k] (outer.mixing_matrices)."""
  experts_W = np.asarray(experts_W, np.int32)
  return np.asarray(outer_lib.mixing_matrices(
      experts_W[:, None], jnp.asarray(weights_W, jnp.float32),
      [int(experts_W.max()) + 1])[0])


def test_two_users_by_hand():
  # One module, two users; round 0: worker 0 leads.
  c_W = np.array([[4, -1, 3, 0.5, 0, 2, -6, 1],
                  [1, 5, -2, 7, 3, -1, 0.5, 4]], np.float32)
  a_WxK = _weights([0, 0], [1, 1])
  sent, residual, next_round, sent_bytes, read_bytes = _round(
      SPEC, c_W, None, jnp.zeros(2, jnp.int32), a_WxK, np.zeros(2, int))
  # The leader's top 3 per chunk: |4|, |3|, |-1| (indices 0, 2, 1) and
  # |-6|, |2|, |1| (6, 5, 7). Magnitudes: the larger half's mean (2 of 3),
  # the smaller one's: (4 + 3) / 2 = 3.5 and 1; (6 + 2) / 2 = 4 and 1.
  np.testing.assert_allclose(sent[0], [3.5, -1, 3.5, 0, 0, 1, -4, 1])
  # Worker 1 sends its own values there: [1, 5, -2] -> 3.5, 1 (5 large;
  # 1 and -2 small, the midpoint 2.25); [-1, 0.5, 4] at 5, 6, 7 -> 2.5,
  # 0.5 (the midpoint 1.5: only 4 large).
  np.testing.assert_allclose(sent[1], [1, 3.5, -1, 0, 0, -0.5, 0.5, 2.5])
  np.testing.assert_allclose(residual, c_W - np.asarray(sent))
  np.testing.assert_array_equal(next_round, [1, 1])
  # 6 indices of 2 bits (2 B), 6 codes of 2 bits (2 B), 2 x 2 scales
  # (16 B): the leader sends 20, the other 18 and reads the 2 of indices.
  np.testing.assert_array_equal(sent_bytes, [20, 18])
  np.testing.assert_array_equal(read_bytes, [0, 2])
  # Round 1: worker 1 leads, on its own top 3 (7, 5, -2 | 4, 3, -1, at
  # 3, 1, 2 | 7, 4, 5): 7, 5 -> 6, -2 -> -2; 4, 3 -> 3.5, -1 -> -1.
  sent, *_ = _round(SPEC, c_W, None, jnp.ones(2, jnp.int32), a_WxK,
                    np.zeros(2, int))
  np.testing.assert_allclose(sent[1], [0, 6, -2, 6, 3.5, -1, 0, 3.5])
  # Worker 0 there: 0.5, -1, 3 -> 0.5, -0.5, 2; 1, 0, 2 -> 1.5, 0, 1.5:
  # its 0 is coded as the small magnitude, 0 too (the one place where
  # sparse_aggregate=senders would differ from the mean).
  np.testing.assert_allclose(sent[0], [0, -0.5, 2, 0.5, 0, 1.5, 0, 1.5])


def test_one_user_per_module_is_chunked_topk_bit_for_bit():
  spec = dataclasses.replace(SPEC, topk_chunk=8, topk_fraction=0.25,
                             feedback_decay=0.9)
  topk = compress.make_codec(dataclasses.replace(spec, name="topk"))
  experts_W = np.arange(3)
  a_WxK = _weights(experts_W, [1, 1, 1])
  rng = np.random.default_rng(0)
  mine = theirs = None
  round_W = jnp.zeros(3, jnp.int32)
  for _ in range(3):
    c = {"w": jnp.asarray(rng.standard_normal((3, 5, 7)), jnp.float32)}
    sent, mine, _, bytes_W, read_W = compress_leader.compress_tree(
        spec, c, mine, {"w": {"round": round_W}}, a_WxK, experts_W)
    want, theirs, _, want_bytes_W = compress_apply.compress_tree(
        topk, c, theirs, None)
    np.testing.assert_array_equal(sent["w"], want["w"])
    np.testing.assert_array_equal(mine["w"], theirs["w"])
    np.testing.assert_array_equal(bytes_W, want_bytes_W)
    np.testing.assert_array_equal(read_W, 0.0)


def test_users_share_the_leaders_support_and_take_turns():
  # Module 0: workers 0, 1 and 3, but 3 has weight 0 (never a leader);
  # module 1: workers 2 and 4.
  experts_W = np.array([0, 0, 1, 0, 1])
  a_WxK = _weights(experts_W, [1, 1, 1, 0, 1])
  spec = dataclasses.replace(SPEC, topk_chunk=8, topk_fraction=0.25)
  rng = np.random.default_rng(1)
  c_W = rng.standard_normal((5, 6, 5)).astype(np.float32)
  leaders = []
  residual = None
  state = {"round": jnp.zeros(5, jnp.int32)}
  for _ in range(4):
    leader_W = compress_leader.leaders(state["round"], a_WxK, experts_W)
    leaders.append(np.asarray(leader_W).tolist())
    y_W = c_W if residual is None else c_W + np.asarray(residual)
    sent, residual, round_W, sent_bytes, read_bytes = _round(
        spec, c_W, residual, state["round"], a_WxK, experts_W)
    state = {"round": round_W}
    for w in range(5):
      own = compress_topk.encode(jnp.asarray(y_W[leader_W[w]].reshape(-1)),
                                 8, 0.25)
      want = compress_topk.decode(own, 30, 8).reshape(6, 5)
      np.testing.assert_array_equal(np.asarray(sent[w]) != 0, want != 0)
    # Only leaders send indices (ceil(8 x 3 bits / 8) = 3 B); the others
    # read them.
    leads = np.asarray(leader_W) == np.arange(5)
    np.testing.assert_array_equal(np.asarray(sent_bytes) - sent_bytes[3],
                                  3.0 * leads)
    np.testing.assert_array_equal(read_bytes, 3.0 * ~leads)
  assert leaders == [[0, 0, 2, 0, 2], [1, 1, 4, 1, 4]] * 2


def test_error_feedback_loses_nothing_over_rounds():
  experts_W = np.array([0, 0, 0, 1])
  a_WxK = _weights(experts_W, [1, 2, 1, 1])
  rng = np.random.default_rng(2)
  residual, round_W = None, jnp.zeros(4, jnp.int32)
  total_sent = total_contrib = 0.0
  for _ in range(5):
    c_W = rng.standard_normal((4, 3, 7)).astype(np.float32)
    sent, residual, round_W, _, _ = _round(SPEC, c_W, residual, round_W,
                                           a_WxK, experts_W)
    total_sent, total_contrib = total_sent + np.asarray(sent), (
        total_contrib + c_W)
  np.testing.assert_allclose(total_sent + np.asarray(residual),
                             total_contrib, atol=1e-5)


def test_bytes_at_sparseloco_settings():
  # 64 of 4096: the leader sends topk's 120 B per chunk, every other user
  # 16 B of codes and 8 of scales, and reads the 96 B of indices.
  assert compress_leader.leaf_bytes(4 * 4096, 4096, 64 / 4096) == (
      4 * 96, 4 * 24)
  assert compress_topk.payload_bytes(4 * 4096, 4096, 64 / 4096) == 4 * 120
  # The leader's indices as Elias-Fano streams: 512 bits a chunk.
  assert compress_leader.leaf_bytes(4 * 4096, 4096, 64 / 4096,
                                    "elias_fano") == (4 * 64, 4 * 24)


def test_overlap_counts_the_indices_read_at_the_handover():
  # One module of 8 values, two users, float32 downloads: the handover of
  # round 0 adds worker 1's read of the leader's indices (2 B) to what it
  # read before; the apply then counts the module read whole (32 B).
  comms = {"s": comm_lib.SlotComm(delay="overlap", spec=SPEC)}
  tx = optax.sgd(1.0)
  bank = {"s": {"w": jnp.zeros((1, 8))}}
  params = {"s": {"w": jnp.zeros((2, 8))}}
  inner_extra, outer_extra = comm_step.init_extra(comms, params, bank, tx)
  outer = {"params": bank, "opt_state": {"s": tx.init(bank["s"])},
           **outer_extra}
  x_W = jnp.asarray(np.random.default_rng(3).standard_normal((2, 8)),
                    jnp.float32)
  inner = dict(inner_extra, params={"s": {"w": x_W}})
  kw = dict(assignment_WxS=np.zeros((2, 1), np.int32), slot_names=("s",))
  outer, inner = overlap_step.handover(
      outer, inner, comms=comms, weights_W=jnp.ones(2),
      rescale_by_sqrt_users=False, **kw)
  np.testing.assert_array_equal(inner["sent_bytes_W"], [20, 18])
  np.testing.assert_array_equal(inner["recv_bytes_W"], [0, 2])
  outer, inner = overlap_step.apply(outer, inner, tx, comms=comms, **kw)
  np.testing.assert_array_equal(inner["recv_bytes_W"], [32, 32])
  outer, inner = overlap_step.handover(
      outer, inner, comms=comms, weights_W=jnp.ones(2),
      rescale_by_sqrt_users=False, **kw)
  np.testing.assert_array_equal(inner["recv_bytes_W"], [34, 32])


class _Cycles:
  """A learnable stream: every row a short cycle, shifted by step and
  worker."""

  def __init__(self, num_workers, seq_len):
    self.num_workers, self.seq_len = num_workers, seq_len

  def batch(self, step, streams=None):
    streams = range(self.num_workers) if streams is None else streams
    rows = [np.roll(np.tile(np.arange(4, 14), 6)[:self.seq_len + 1],
                    step + w) for w in streams]
    return np.broadcast_to(np.stack(rows)[:, None],
                           (len(rows), 8, self.seq_len + 1)).astype(np.int32)


def _train(config, losses, run_dir, hooks=()):
  runtime = testing.tiny_runtime(config)
  record = lambda step, state, l: losses.append(float(np.mean(l)))
  return loop.train(runtime, _Cycles(runtime.topology.num_workers,
                                     config.data.seq_len), str(run_dir),
                    {"h": "1"}, "t", hooks=[*hooks, record])


def test_spmd_run_trains_resumes_exactly_and_logs_what_was_read(tmp_path):
  # DiPaCo 2x2, H = 2 over 8 steps: the shared slots have 4 users, the
  # level slots 2; outer averaging as SparseLoCo's.
  config = testing.comm_config(
      compression="leader_topk", compression_topk_chunk=64,
      compression_topk_fraction=0.125, error_feedback=True,
      error_feedback_decay=0.95, outer_optimizer="sgd", outer_lr=1.0,
      outer_momentum=0.0)
  config.inner_opt.learning_rate = 1e-2
  losses = []
  state = testing.assert_resume_is_exact(
      functools.partial(_train, config, losses), tmp_path, die_after=5,
      resumed_from=4)
  assert losses[7] < losses[0] - 0.3, losses  # The straight run's.
  path = testing.tiny_runtime(config).path_params(state["outer"]["params"],
                                                  0)
  topk = sum(compress_topk.payload_bytes(x.size, 64, 0.125)
             for x in jax.tree.leaves(path))
  f32 = 4 * sum(x.size for x in jax.tree.leaves(path))
  rows = metrics_lib.read_jsonl(tmp_path / "straight" / "logs" / "train" /
                                metrics_lib.COMM_LOG)
  assert [r["step"] for r in rows] == [2, 4, 6, 8]
  for r in rows:
    sent_W, read_W = np.array(r["sent_bytes_W"]), np.array(r["recv_bytes_W"])
    # Each worker either sends a leaf's indices or reads them, and reads
    # its modules whole (float32 downloads).
    np.testing.assert_array_equal(sent_W + read_W - f32, topk)
    assert (sent_W < topk).any()


def test_refused_on_islands_and_without_chunks():
  config = testing.comm_config(compression="leader_topk",
                               compression_topk_chunk=4096)
  with pytest.raises(UserError, match=r"^config.diloco.compression: "
                     r"leader_topk needs the leader's indices[^\n]*$"):
    units.check_codecs(config)
  config.diloco.compression_topk_chunk = 0
  with pytest.raises(UserError, match="diloco.compression_topk_chunk: must "
                     "be > 0 with compression=leader_topk"):
    config_base.validate(config, 8)


def test_no_thin_download_warning_on_one_support():
  # The warning's reason, a change covering its users' top-k together,
  # does not hold when every user sends on the leader's support.
  config = testing.comm_config(
      compression="leader_topk", compression_topk_chunk=64,
      error_feedback=True, download_compression="topk",
      outer_optimizer="sgd", outer_lr=1.0, outer_momentum=0.0)
  assert not any("thinner" in w for w in presets.warnings(config))
  config.diloco.compression = "topk"
  assert any("thinner" in w for w in presets.warnings(config))
