"""bench/contribution_fidelity.py: codec specs from the command line and
the error sums it reports."""

import importlib.util
import json
import os

import jax
import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "contribution_fidelity",
    os.path.join(REPO, "bench", "contribution_fidelity.py"))
fidelity = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fidelity)


def _contribs(seed):
  """{slot: tree} of [W=3, ...] float32 leaves."""
  rng = np.random.default_rng(seed)
  return {"s0": {"w": rng.normal(size=(3, 64, 32)).astype(np.float32),
                 "b": rng.normal(size=(3, 300)).astype(np.float32)}}


def test_parse_codec_fields_and_types():
  spec = fidelity.parse_codec(
      "topk:topk_fraction=0.25,topk_chunk=512,error_feedback=True")
  assert (spec.name, spec.topk_fraction, spec.topk_chunk,
          spec.error_feedback) == ("topk", 0.25, 512, True)
  assert fidelity.parse_codec("int4").error_feedback is False


@pytest.mark.parametrize("text", ["int4:rank=3", "int4:name=topk",
                                  "lowrank:rank_min=9,rank_max=8"])
def test_parse_codec_refuses_bad_specs(text):
  with pytest.raises((SystemExit, ValueError)):
    fidelity.parse_codec(text)


def test_uncompressed_has_no_error_and_ratio_one():
  t = fidelity.Tracker(fidelity.parse_codec("none"))
  for r in range(2):
    t.add(_contribs(r))
  row = t.row("none")
  assert row["err_worker"] == row["err_mean"] == row["err_sum"] == 0.0
  assert row["ratio"] == pytest.approx(1.0)
  assert row["rounds"] == 2


def test_error_feedback_sum_error_is_the_residual():
  """With error feedback, sum of sent + residual = sum of contributions,
  so err_sum is each worker's residual norm over its summed contribution."""
  t = fidelity.Tracker(fidelity.parse_codec("int4:error_feedback=True"))
  rounds = [_contribs(r) for r in range(3)]
  for c in rounds:
    t.add(c)
  total = jax.tree.map(lambda *xs: sum(xs), *rounds)
  norm_W = lambda tree: np.sqrt(sum(
      np.sum(np.square(x), axis=tuple(range(1, x.ndim)))
      for x in jax.tree.leaves(tree)))
  want = np.mean(norm_W(t.residuals) / norm_W(total))
  row = t.row("int4")
  assert row["err_sum"] == pytest.approx(float(want), rel=1e-5)
  # int4 loses something every round, and 4 bits + a scale per 256 values
  # are 7.8x fewer bytes than float32 (the 300-entry leaf pads one block).
  assert 0 < row["err_sum"] < row["err_worker"] < 0.2
  assert 7 < row["ratio"] < 8


def test_saved_rounds_judge_the_same(tmp_path):
  """--save's .npz files, read back by --load, give the same rows."""
  live = fidelity.Tracker(fidelity.parse_codec("int4:error_feedback=True"))
  for r in range(2):
    c = _contribs(r)
    live.add(c)
    np.savez(tmp_path / f"round_{r:04d}.npz", inner_steps=7,
             **fidelity.flatten(c))
  saved = fidelity.Tracker(fidelity.parse_codec("int4:error_feedback=True"))
  assert fidelity.judge_saved(str(tmp_path), [saved]) == (3, 7)
  assert saved.row("x") == live.row("x")


def test_bound_is_the_gaussian_rate_distortion_bound():
  """At 8x fewer bytes (4 bits a value) the i.i.d. Gaussian bound on the
  error's norm is 2^-4; int4 on Gaussian values stays above it."""
  t = fidelity.Tracker(fidelity.parse_codec("int4"))
  t.add(_contribs(0))
  row = t.row("int4")
  assert row["bound"] == pytest.approx(2.0 ** (-32.0 / row["ratio"]))
  assert row["bound"] < row["err_worker"]


def test_shared_low_rank_is_exact_where_a_modules_users_share_a_basis():
  """Workers 0 and 1 move module 0 within one rank-2 column space, worker 2
  alone uses module 1 with another: PowerSGD's shared basis (one power
  step from the warm start) spans each module's space, so what is sent is
  exact, at (64 + 32) x 2 floats for the 64 x 32 matrix (the vector is
  sent whole). Judged as if all three shared one module, rank 2 cannot
  span both spaces."""
  rng = np.random.default_rng(0)
  basis = [rng.normal(size=(64, 2)) for _ in range(2)]
  def contribs():
    return {"s0": {
        "w": np.stack([basis[e] @ rng.normal(size=(2, 32))
                       for e in (0, 0, 1)]).astype(np.float32),
        "b": rng.normal(size=(3, 300)).astype(np.float32)}}
  spec = "lowrank_shared:rank_max=2,error_feedback=True"
  by_module = fidelity.Tracker(fidelity.parse_codec(spec))
  as_one = fidelity.Tracker(fidelity.parse_codec(spec))
  for _ in range(2):
    c = contribs()
    by_module.add(c, np.array([[0], [0], [1]]))
    as_one.add(c)
  row = by_module.row("shared")
  assert row["err_worker"] < 1e-5 and row["err_sum"] < 1e-5, row
  assert row["ratio"] == pytest.approx((64 * 32 + 300) / (96 * 2 + 300))
  assert as_one.row("one")["err_worker"] > 0.3


@pytest.mark.parametrize("name", ["lowrank", "lowrank_shared"])
def test_per_layer_low_rank_codes_each_layer_of_a_layer_slot(name):
  """Three stacked layers, layer i of worker w the rank-1 u_i v_iw^T:
  coded per layer, rank 1 sends every layer exactly; the stack as one
  [48, 8] matrix has rank 3, and rank 1 cannot. The embedding is one
  matrix either way (`layer_axis` holds for layer slots only), rank 1
  there too, so exact."""
  rng = np.random.default_rng(1)
  u_LxM = rng.normal(size=(3, 16))
  a_M = rng.normal(size=32)
  def contribs():
    layers = np.stack([np.stack([np.outer(u_LxM[i], rng.normal(size=8))
                                 for i in range(3)]) for _ in range(3)])
    embed = np.stack([np.outer(a_M, rng.normal(size=8)) for _ in range(3)])
    return {"layers_00_02": {"w": layers.astype(np.float32)},
            "embed_head": {"e": embed.astype(np.float32)}}
  spec = f"{name}:rank_max=1,energy=1.0,error_feedback=True"
  per_layer = fidelity.Tracker(fidelity.parse_codec(spec + ",layer_axis=True"))
  stacked = fidelity.Tracker(fidelity.parse_codec(spec))
  for _ in range(2):
    c = contribs()
    per_layer.add(c)
    stacked.add(c)
  assert per_layer.row("per layer")["err_worker"] < 1e-5
  assert stacked.row("stacked")["err_worker"] > 0.3
  # (m + n) float32 per matrix at rank 1 (lowrank: + 4 bytes of rank).
  rank_bytes = 4 if name == "lowrank" else 0
  sent = 3 * (4 * (16 + 8) + rank_bytes) + 4 * (32 + 8) + rank_bytes
  assert per_layer.row("per layer")["ratio"] == pytest.approx(
      4 * (3 * 16 * 8 + 32 * 8) / sent)


def test_structure_of_gaussian_and_repeated_contributions():
  """Independent Gaussian workers: kurtosis 3, cosines near 0; a round
  repeated: cosine 1 between rounds; an exact top 1/16 of Gaussian
  entries holds 2 (t phi(t) + 1 - Phi(t)) = 32.6% of |c|^2 (t = 1.863)."""
  s = fidelity.Structure()
  c = {"s": {"w": np.random.default_rng(0).normal(
      size=(4, 200_000)).astype(np.float32)}}
  s.add(c)
  s.add(c)
  got = s.summary()
  assert got["kurtosis"] == pytest.approx(3.0, abs=0.05)
  assert abs(got["cos_workers"]) < 0.01
  assert got["cos_rounds"] == pytest.approx(1.0, abs=1e-5)
  assert got["top_1_16"] == pytest.approx(0.3255, abs=0.01)
  assert got["top_1_64"] < got["top_1_16"]


def test_low_rank_share_of_rank_1_and_gaussian_matrices():
  """A rank-1 change keeps all of |c|^2 in its largest singular value; an
  i.i.d. Gaussian 256 x 256 one keeps in its largest 32 about 38% (the
  quarter-circle law's top eighth), its workers' mean the same share
  (independent workers average to another Gaussian matrix)."""
  rng = np.random.default_rng(0)
  rank1 = {"s": {"w": np.einsum("wm,wn->wmn", rng.normal(size=(2, 64)),
                                rng.normal(size=(2, 32))),
                 "b": rng.normal(size=(2, 10))}}
  gauss = {"s": {"w": rng.normal(size=(2, 256, 256))}}
  s1, s2 = fidelity.Structure(), fidelity.Structure()
  s1.add(rank1)
  s2.add(gauss)
  assert s1.summary()["rank_1_8"] == pytest.approx(1.0)
  assert s2.summary()["rank_1_8"] == pytest.approx(0.38, abs=0.03)
  assert s2.summary()["rank_1_8_mean"] == pytest.approx(0.38, abs=0.03)


def test_trains_from_a_base_and_saves_what_it_judged(tmp_path, capsys):
  """End to end on the stdlib corpus with a tiny model: a base, then
  rounds; `none` sends everything; --load of --save gives the same rows."""
  flags = ["--config=experiments/diloco.py", f"--workdir={tmp_path}/w",
           "--set=model.d_model=32", "--set=model.num_heads=2",
           "--set=model.head_dim=16", "--set=model.mlp_dim=64",
           "--set=model.num_layers=2", "--set=data.seq_len=64",
           "--set=data.vocab_size=512", "--set=train.batch_size=8",
           "--set=base.batch_size=8", "--set=diloco.inner_steps=3",
           "--set=paths.num_replicas=2",
           "--set=data.max_corpus_chars=2000000", "--base_steps=4",
           "--rounds=2", "--warm_rounds=1", "--codec=none",
           "--codec=int4:error_feedback=True"]
  fidelity.main(flags + [f"--save={tmp_path}/s", f"--out={tmp_path}/a.json"])
  fidelity.main(["--config=experiments/diloco.py", f"--load={tmp_path}/s",
                 "--codec=none", "--codec=int4:error_feedback=True",
                 f"--out={tmp_path}/b.json"])
  assert "base step 4/4" in capsys.readouterr().out
  trained = json.load(open(f"{tmp_path}/a.json"))
  loaded = json.load(open(f"{tmp_path}/b.json"))
  assert len(list((tmp_path / "s").glob("round_*.npz"))) == 2
  # The same numbers: both judge host copies of the same contributions.
  for got, want in zip(loaded["rows"], trained["rows"]):
    assert got.pop("codec") == want.pop("codec")
    assert got == want
  assert loaded["structure"] == trained["structure"]
  none, int4 = trained["rows"]  # (their "codec" keys popped above)
  assert (none["err_sum"], none["ratio"]) == (0.0, 1.0)
  assert 0 < int4["err_sum"] < 0.2 and int4["rounds"] == 2
  assert trained["workers"] == 2 and trained["inner_steps"] == 3
