"""Compressed downloads (`diloco.download_compression`, comm_step.py): the
workers' copy p of the modules follows p <- p + C(g - p), rounds start
from it, against a hand-computed example; in the SPMD loop a kill
resumes exactly and each round's bytes read back are logged."""

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
from dipaco_jax.diloco import outer as outer_lib
from dipaco_jax.diloco import overlap_step
from dipaco_jax.errors import UserError
from dipaco_jax.train import metrics as metrics_lib

# Outer SGD at lr 1 without momentum: the global module is the workers'
# mean, g <- g - mean(c) with c = p - x.
TX = optax.sgd(1.0)


def _outer_step(comms, outer, inner, x_W):
  inner = dict(inner, params={"s": {"w": x_W}})
  return comm_step.outer_update(
      outer, inner, TX, comms=comms,
      assignment_WxS=np.zeros((2, 1), np.int32), slot_names=("s",),
      weights_W=jnp.ones(2), rescale_by_sqrt_users=False)


def _start(comms, num_workers, num_values):
  """(outer, inner) of one slot "s" with one module of `num_values` zeros
  and `num_workers` users, before the first round."""
  bank = {"s": {"w": jnp.zeros((1, num_values))}}
  inner_extra, outer_extra = comm_step.init_extra(
      comms, {"s": {"w": jnp.zeros((num_workers, num_values))}}, bank, TX)
  return ({"params": bank, "opt_state": {"s": TX.init(bank["s"])},
           **outer_extra}, dict(inner_extra))


def test_int4_downloads_by_hand():
  # One slot, one module of 4 values (one int4 block), two workers.
  comms = {"s": comm_lib.SlotComm(download="int4")}
  outer, inner = _start(comms, 2, 4)
  # Round 0: both workers end at x, so g = x = [0.7, 0.1, -0.33, 0.2]. Its
  # change from p = 0 in int4: scale 0.7 / 7 = 0.1, codes [7, 1, -3, 2],
  # so p = [0.7, 0.1, -0.3, 0.2]: -0.03 stays in g - p.
  x = jnp.array([[0.7, 0.1, -0.33, 0.2]] * 2)
  outer, inner = _outer_step(comms, outer, inner, x)
  np.testing.assert_allclose(outer["params"]["s"]["w"], [[0.7, 0.1, -0.33,
                                                          0.2]], atol=1e-6)
  np.testing.assert_allclose(outer["published"]["s"]["w"],
                             [[0.7, 0.1, -0.3, 0.2]], atol=1e-6)
  # Every worker starts round 1 from the copy, not from g.
  np.testing.assert_allclose(inner["params"]["s"]["w"],
                             [[0.7, 0.1, -0.3, 0.2]] * 2, atol=1e-6)
  # 4 values as int4 (2 bytes) and one float32 scale, per worker.
  np.testing.assert_array_equal(inner["recv_bytes_W"], [6.0, 6.0])
  # Round 1: each worker moves its first value by +0.1 from the copy:
  # c = p - x = [-0.1, 0, 0, 0], g = [0.8, 0.1, -0.33, 0.2]. The change
  # g - p = [0.1, 0, -0.03, 0] (the residual of round 0 rides along):
  # scale 0.1 / 7, codes [7, 0, round(-2.1) = -2, 0].
  x = inner["params"]["s"]["w"] + jnp.array([[0.1, 0.0, 0.0, 0.0]])
  outer, inner = _outer_step(comms, outer, inner, x)
  np.testing.assert_allclose(outer["params"]["s"]["w"],
                             [[0.8, 0.1, -0.33, 0.2]], atol=1e-6)
  np.testing.assert_allclose(outer["published"]["s"]["w"],
                             [[0.8, 0.1, -0.3 - 0.2 / 7, 0.2]], atol=1e-6)
  # Round 2: nobody moves, g stays; the copy's lag -0.03 + 0.2 / 7 is one
  # block's absmax, sent exactly: the copy reaches g.
  outer, inner = _outer_step(comms, outer, inner, inner["params"]["s"]["w"])
  np.testing.assert_allclose(outer["published"]["s"]["w"],
                             outer["params"]["s"]["w"], atol=1e-7)


def test_topk_downloads_by_hand():
  # delay none, chunked top-k down: chunks of 4, 1 kept in each (fraction
  # 0.25), a kept value sent exactly (k = 1: both magnitudes are its own).
  # Nothing is lost: the change g - p keeps what was not sent, so the copy
  # reaches g within 4 rounds of nobody moving.
  spec = compress.CompressionSpec(topk_fraction=0.25, topk_chunk=4)
  comms = {"s": comm_lib.SlotComm(spec=spec, download="topk")}
  outer, inner = _start(comms, 2, 8)
  g = [0.5, 0.1, -0.2, 0.05, 0.0, -0.3, 0.1, 0.2]
  copies = [[0.5, 0, 0, 0, 0, -0.3, 0, 0],           # the largest per chunk
            [0.5, 0, -0.2, 0, 0, -0.3, 0, 0.2],       # then the next ...
            [0.5, 0.1, -0.2, 0, 0, -0.3, 0.1, 0.2],
            g]
  x = jnp.array([g] * 2)  # Round 0: both workers end at g.
  for want in copies:
    outer, inner = _outer_step(comms, outer, inner, x)
    np.testing.assert_allclose(outer["params"]["s"]["w"], [g], atol=1e-6)
    np.testing.assert_allclose(outer["published"]["s"]["w"], [want],
                               atol=1e-6)
    np.testing.assert_allclose(inner["params"]["s"]["w"], [want] * 2,
                               atol=1e-6)
    # Per worker: 2 indices of 2 bits and 2 codes of 2 bits (a byte each)
    # and two float32 magnitudes per chunk.
    np.testing.assert_array_equal(inner["recv_bytes_W"], [18.0, 18.0])
    x = inner["params"]["s"]["w"]  # Then nobody moves: c = 0.


def test_topk_downloads_read_their_own_share():
  # diloco.download_topk_fraction: 2 of every 4 entries read back (the
  # upload keeps its 1), so the copy takes each chunk's two largest.
  config = _config(compression="topk", compression_topk_fraction=0.25,
                   compression_topk_chunk=4, download_compression="topk",
                   download_topk_fraction=0.5)
  slots = testing.tiny_runtime(config).topology.slots
  comm = comm_lib.comm_by_slot(config, slots)[slots[0].name]
  assert (comm.spec.topk_fraction, comm.download_spec.topk_fraction,
          comm.download_spec.topk_chunk) == (0.25, 0.5, 4)
  comms = {"s": comm_lib.SlotComm(spec=comm.spec, download="topk",
                                  download_topk_fraction=0.5)}
  outer, inner = _start(comms, 2, 8)
  # Each worker moves one entry per chunk, sent exactly (k = 1), each by
  # one sender: g = [0.5, 0.2, 0, 0, 0, -0.3, 0, 0.4].
  x = jnp.array([[0.5, 0, 0, 0, 0, -0.3, 0, 0], [0, 0.2, 0, 0, 0, 0, 0, 0.4]])
  g = [[0.5, 0.2, 0, 0, 0, -0.3, 0, 0.4]]
  outer, _ = _outer_step(comms, outer, inner, x)
  np.testing.assert_allclose(outer["params"]["s"]["w"], g, atol=1e-6)
  # The change g - p = g read back 2 per chunk (each half of the kept two
  # at its own magnitude): the copy is g. At the upload's 1 per chunk it
  # would have been [0.5, 0, 0, 0, 0, 0, 0, 0.4].
  np.testing.assert_allclose(outer["published"]["s"]["w"], g, atol=1e-6)
  with pytest.raises(UserError, match=r"diloco.download_topk_fraction: 0.5 "
                     r"is used only with diloco.download_compression=topk"):
    config_base.validate(_config(download_compression="int4",
                                 download_topk_fraction=0.5), 8)


def test_strided_both_ways_by_hand():
  # compression=strided up (error feedback) and down, stride 2, one block
  # of 4 per phase: round r sends and reads back the entries of phase
  # r mod 2 (even, then odd indices) on both ends. Each worker's even
  # entries take two magnitudes (sent exactly); their odd ones wait in its
  # residual for round 1; what the download's 2 bits dropped of the even
  # entries waits in g - p for round 2.
  spec = compress.CompressionSpec(name="strided", stride=2, block_size=4,
                                  error_feedback=True)
  comms = {"s": comm_lib.SlotComm(spec=spec, download="strided")}
  outer, inner = _start(comms, 2, 8)
  x = jnp.array([[1, 9, -1, 9, 3, 9, -3, 9], [3, 9, 1, 9, -1, 9, 3, 9]])
  # Round 0: c = 0 - x; g = the workers' even entries' mean [2, 0, 1, 0],
  # read back as 1.5 (the two above the mean |.| 0.75), 0, 1.5, 0.
  # Round 1 (nobody moves): the odd entries' 9s from the residuals, sent
  # and read back exactly. Round 2: g - p's even entries 0.5, 0, -0.5, 0.
  want = [([2, 0, 0, 0, 1, 0, 0, 0], [1.5, 0, 0, 0, 1.5, 0, 0, 0]),
          ([2, 9, 0, 9, 1, 9, 0, 9], [1.5, 9, 0, 9, 1.5, 9, 0, 9]),
          ([2, 9, 0, 9, 1, 9, 0, 9], [2, 9, 0, 9, 1, 9, 0, 9])]
  for g, p in want:
    outer, inner = _outer_step(comms, outer, inner, x)
    np.testing.assert_allclose(outer["params"]["s"]["w"], [g], atol=1e-6)
    np.testing.assert_allclose(outer["published"]["s"]["w"], [p], atol=1e-6)
    np.testing.assert_allclose(inner["params"]["s"]["w"], [p] * 2, atol=1e-6)
    # 4 entries of 2 bits, two float32 magnitudes and the phase, each way.
    np.testing.assert_array_equal(inner["sent_bytes_W"], [13.0, 13.0])
    np.testing.assert_array_equal(inner["recv_bytes_W"], [13.0, 13.0])
    x = inner["params"]["s"]["w"]
  assert int(outer["published_state"]["s"]["w"]["round"][0]) == 3


def test_int4_downloads_with_overlap_by_hand():
  # delay=overlap: the apply, tau steps after the handover, reads the
  # workers' copy in the global's place: x <- x + (p - h), a <- p.
  comms = {"s": comm_lib.SlotComm("overlap", download="int4")}
  outer, inner = _start(comms, 2, 4)
  inner = dict(inner, params={"s": {"w": jnp.zeros((2, 4))}})
  kw = dict(assignment_WxS=np.zeros((2, 1), np.int32), slot_names=("s",))

  def move(inner, by):
    return dict(inner, params={"s": {"w": inner["params"]["s"]["w"] +
                                     jnp.array([by], jnp.float32)}})

  # Round 0 ends at h = x = [0.7, 0.1, -0.33, 0.2]: c = -x, D0 = -x.
  outer, inner = overlap_step.handover(
      outer, move(inner, [0.7, 0.1, -0.33, 0.2]), comms=comms,
      weights_W=jnp.ones(2), rescale_by_sqrt_users=False, **kw)
  # tau steps move the first value by 0.1. Apply: g = 0 - D0 = h, its
  # change read back in int4 as p = [0.7, 0.1, -0.3, 0.2] (by hand above);
  # x + (p - h) = [0.8, 0.1, -0.3, 0.2], a = p.
  outer, inner = overlap_step.apply(outer, move(inner, [0.1, 0, 0, 0]), TX,
                                    comms=comms, **kw)
  np.testing.assert_allclose(outer["params"]["s"]["w"],
                             [[0.7, 0.1, -0.33, 0.2]], atol=1e-6)
  np.testing.assert_allclose(outer["published"]["s"]["w"],
                             [[0.7, 0.1, -0.3, 0.2]], atol=1e-6)
  np.testing.assert_allclose(inner["params"]["s"]["w"],
                             [[0.8, 0.1, -0.3, 0.2]] * 2, atol=1e-6)
  np.testing.assert_allclose(inner["anchor"]["s"]["w"],
                             [[0.7, 0.1, -0.3, 0.2]] * 2, atol=1e-6)
  np.testing.assert_array_equal(inner["recv_bytes_W"], [6.0, 6.0])
  # A second apply with nothing in flight changes nothing.
  again, _ = overlap_step.apply(outer, inner, TX, comms=comms, **kw)
  np.testing.assert_array_equal(again["published"]["s"]["w"],
                                outer["published"]["s"]["w"])
  # The flush at the end restarts everyone from g, and the copy is g.
  outer, inner = overlap_step.handover(
      outer, inner, comms=comms, weights_W=jnp.ones(2),
      rescale_by_sqrt_users=False, **kw)
  outer, inner = comm_step.flush(outer, inner, TX, comms=comms, **kw)
  np.testing.assert_array_equal(outer["published"]["s"]["w"],
                                outer["params"]["s"]["w"])
  np.testing.assert_array_equal(inner["params"]["s"]["w"][0],
                                outer["params"]["s"]["w"][0])


_config = testing.comm_config
_train = testing.train_on_random_batches


def test_compressed_downloads_resume_exactly_and_log_their_bytes(tmp_path):
  config = _config(download_compression="int4", compression="int4",
                   error_feedback=True)
  runtime = testing.tiny_runtime(config)
  assert not runtime.comm_plain
  assert "published" in runtime.abstract_state["outer"]
  state = testing.assert_resume_is_exact(functools.partial(_train, config),
                                         tmp_path, die_after=5,
                                         resumed_from=4)
  # The workers hold the copy, which trails the global modules a little.
  bank, copy = state["outer"]["params"], state["outer"]["published"]
  from_copy = outer_lib.gather_workers(copy, runtime.topology.assignment_WxS,
                                       runtime.slot_names)
  for a, b in zip(jax.tree.leaves(from_copy),
                  jax.tree.leaves(state["inner"]["params"]), strict=True):
    np.testing.assert_array_equal(a, b)
  lag = max(float(np.abs(g - p).max()) for g, p in zip(
      jax.tree.leaves(bank), jax.tree.leaves(copy)))
  assert 0 < lag < 0.1 * max(float(np.abs(g).max())
                             for g in jax.tree.leaves(bank))
  # Each round's bytes read back: each worker's modules in int4, about
  # 7.8x fewer than float32 (block 256), as `payload_bytes` counts them.
  rows = metrics_lib.read_jsonl(tmp_path / "straight" / "logs" / "train" /
                                metrics_lib.COMM_LOG)
  assert [r["step"] for r in rows] == [2, 4, 6, 8]
  codec = compress.make_codec(compress.CompressionSpec(name="int4"))
  path = runtime.path_params(bank, 0)
  want = sum(float(codec.payload_bytes(codec.encode(x, {})[0], x.shape))
             for x in jax.tree.leaves(path))
  f32 = 4 * sum(x.size for x in jax.tree.leaves(path))
  for r in rows:
    np.testing.assert_allclose(r["recv_bytes_W"], [want] * 4)
    assert f32 / 8 < want < f32 / 7


@pytest.mark.parametrize("codec", ["int4", "strided"])
def test_compressed_downloads_with_overlap_resume_exactly(tmp_path, codec):
  # tau = 1 of H = 2: the checkpoint of step 4 holds round 1 in flight,
  # its apply (and download) at step 5, after the kill. strided both ways
  # with error feedback: the rounds its phases count, up and down, resume
  # too.
  strided = (dict(compression="strided", compression_stride=2,
                  error_feedback=True) if codec == "strided" else {})
  config = _config(delay="overlap", overlap_steps=1,
                   download_compression=codec, **strided)
  state = testing.assert_resume_is_exact(functools.partial(_train, config),
                                         tmp_path, die_after=5,
                                         resumed_from=4)
  # The flush ended on the global modules, read whole.
  for g, p in zip(jax.tree.leaves(state["outer"]["params"]),
                  jax.tree.leaves(state["outer"]["published"]), strict=True):
    np.testing.assert_array_equal(g, p)
  rows = metrics_lib.read_jsonl(tmp_path / "straight" / "logs" / "train" /
                                metrics_lib.COMM_LOG)
  # A row's download is the previous round's apply: none before round 0's.
  assert [r["recv_bytes_W"][0] > 0 for r in rows] == [False, True, True,
                                                      True]


def test_compressed_downloads_are_refused_with_a_delay_and_on_pipelined_islands(
    tmp_path):
  with pytest.raises(UserError, match=r"diloco.download_compression: 'int8'"
                     r" runs with delay none or overlap only"):
    config_base.validate(_config(download_compression="int8",
                                 delay="one_round"), 8)
  with pytest.raises(UserError, match="diloco.download_compression"):
    config_base.validate(_config(download_compression="lowrank"), 8)
  from dipaco_jax import pipeline  # pylint: disable=g-import-not-at-top
  from dipaco_jax.islands import launcher  # pylint: disable=g-import-not-at-top
  config = _config(download_compression="int4")
  config.pipeline.stages = config.pipeline.microbatches = 2
  with pytest.raises(UserError, match="diloco.download_compression: islands "
                     "with pipeline stages"):
    pipeline.run(config, str(tmp_path),
                 islands=launcher.IslandOptions(num_workers=1))
  assert not any(tmp_path.iterdir())
