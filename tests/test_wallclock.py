"""bench/wallclock.py: its formulas against hand-computed cases, and its CLI
(the DiLoCoX preset and a --measured file) end to end."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "bench", "wallclock.py")
GB = 1e9


def _load_wallclock():
  # bench/ is not a package: load the script as a module by its path.
  spec = importlib.util.spec_from_file_location("wallclock", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


wallclock = _load_wallclock()


def _run_cli(*flags) -> str:
  run = subprocess.run([sys.executable, SCRIPT, *flags], capture_output=True,
                       text=True, check=False, cwd=REPO, timeout=30)
  assert run.returncode == 0, run.stderr[-3000:]
  return run.stdout


def _table_rows(stdout: str) -> dict[str, list[str]]:
  """Arm name -> its other cells, from the markdown table."""
  rows = {}
  for line in stdout.splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if line.startswith("| ") and cells[0] != "arm":
      rows[cells[0]] = cells[1:]
  return rows


def test_gbps_is_bits():
  assert wallclock.gbps_to_bytes_per_s(8) == GB


def test_two_worker_ring_allreduce_of_1gb_at_1gb_per_s():
  # Each worker sends 2 (W-1)/W = 1 payload: 1 s, plus 2 (W-1) latencies.
  assert wallclock.ring_allreduce_s(GB, 2, GB, 0.0) == pytest.approx(1.0)
  assert wallclock.ring_allreduce_s(GB, 2, GB, 0.01) == pytest.approx(1.02)
  assert wallclock.ring_allreduce_s(GB, 8, GB, 0.0) == pytest.approx(1.75)
  assert wallclock.ring_allreduce_s(GB, 1, GB, 0.5) == 0.0


def test_allgather_sends_every_other_workers_payload():
  # W = 4: (W-1)/W * W * 1 GB = 3 GB at 1 GB/s, 3 hops of latency.
  assert wallclock.ring_allgather_s(GB, 4, GB, 0.1) == pytest.approx(3.3)


def test_store_link_carries_all_uploads_and_downloads():
  # 4 workers x (1 GB up + 4 GB down) over one 1 GB/s link + 2 latencies.
  assert wallclock.store_exchange_s(GB, 4 * GB, 4, GB, 0.1) == (
      pytest.approx(20.2))
  # The default download is the float32 module: 4 B/param.
  assert wallclock.exchange_s(1e9, GB, 4, GB, 0.1, "store") == (
      pytest.approx(20.2))


def test_float32_payload_is_all_reduced_compressed_is_all_gathered():
  params, workers = 0.25e9, 4  # float32 payload: 1 GB.
  summed = wallclock.exchange_s(params, GB, workers, GB, 0.0, "allreduce")
  assert summed == pytest.approx(1.5)  # 2 * 3/4 GB.
  gathered = wallclock.exchange_s(params, GB / 8, workers, GB, 0.0,
                                  "allreduce")
  assert gathered == pytest.approx(3 / 8)  # 3 * (1/8) GB.


def test_delay_hides_exchange_only_when_it_fits_under_compute():
  common = dict(params=0.25e9, step_time_s=1.0, H=10, workers=2,
                bandwidth_bytes_s=GB, latency_s=0.0, topology="allreduce")
  fits = dict(common, bytes_per_round=5 * GB)  # Exchange 5 s < 10 s.
  assert wallclock.predict_round_s(**fits, delay="none") == (
      pytest.approx(15.0))
  for delay in ("one_round", "eager"):
    assert wallclock.predict_round_s(**fits, delay=delay) == (
        pytest.approx(10.0))
  too_big = dict(common, bytes_per_round=30 * GB)  # Exchange 30 s > 10 s.
  assert wallclock.predict_round_s(**too_big, delay="none") == (
      pytest.approx(40.0))
  assert wallclock.predict_round_s(**too_big, delay="one_round") == (
      pytest.approx(30.0))


def test_overlap_hides_the_exchange_under_tau_steps_only():
  # Exchange 5 s, steps of 1 s, H = 10.
  common = dict(params=0.25e9, step_time_s=1.0, H=10, workers=2,
                bandwidth_bytes_s=GB, latency_s=0.0, topology="allreduce",
                bytes_per_round=5 * GB, delay="overlap")
  # tau = 2: 3 s of the exchange stay on the round; tau = 5 hides it all.
  assert wallclock.predict_round_s(**common, tau=2) == pytest.approx(13.0)
  assert wallclock.predict_round_s(**common, tau=5) == pytest.approx(10.0)
  # tau = H is one_round, also when the exchange is longer than a round.
  for exchange in (5.0, 30.0):
    assert wallclock.round_s_from_exchange(1.0, 10, exchange, "overlap",
                                           tau=10) == pytest.approx(
        wallclock.round_s_from_exchange(1.0, 10, exchange, "one_round"))
  # 10 rounds: 9 wait 3 s each, then the last exchange drains.
  assert wallclock.comm_wait_s(100, 1.0, 10, 5.0, "overlap", tau=2) == 32.0
  with pytest.raises(ValueError, match="tau"):
    wallclock.round_s_from_exchange(1.0, 10, 5.0, "overlap", tau=0)
  # The CLI prints the overlap arms only when asked.
  args = ["--params=1e6", "--step_time_s=1", "--tokens_per_step=1",
          "--workers=2", "--H=10", "--compressors=none"]
  setting, payloads = wallclock.setting_from_flags(
      wallclock.build_parser().parse_args(args + ["--overlap_steps=2"]),
      None)
  names = [a.name for a in wallclock.all_arms(setting, payloads)]
  assert "DiLoCo overlap tau=2 [none]" in names
  setting, payloads = wallclock.setting_from_flags(
      wallclock.build_parser().parse_args(args), None)
  assert not any("overlap" in a.name
                 for a in wallclock.all_arms(setting, payloads))


def test_compression_shortens_the_exchange_proportionally():
  params = 1e9
  full = wallclock.exchange_s(params, 4 * params, 2, GB, 0.0, "allreduce")
  int4 = wallclock.exchange_s(params, 0.5 * params, 2, GB, 0.0,
                              "allreduce", summable=False)
  assert full == pytest.approx(4.0)
  assert int4 == pytest.approx(full / 8)
  topk = wallclock.exchange_s(params, 0.05 * params, 8, GB, 0.0,
                              "allreduce")
  assert topk == pytest.approx(
      10 * wallclock.exchange_s(params, 0.005 * params, 8, GB, 0.0,
                                "allreduce"))


def test_communication_wait_over_a_run():
  # 100 steps of 1 s, H = 10: 10 rounds.
  assert wallclock.comm_wait_s(100, 1.0, 10, 2.0, "none") == 20.0
  # Hidden but the last exchange, which has no next round to hide under.
  assert wallclock.comm_wait_s(100, 1.0, 10, 2.0, "one_round") == 2.0
  # 30 s exchanges: 9 rounds wait 20 s each, then the drain.
  assert wallclock.comm_wait_s(100, 1.0, 10, 30.0, "eager") == 210.0


def test_allreduce_every_step():
  # 0.25e9 float32 params = 1 GB; 2 workers at 1 GB/s: 1 s of ring.
  assert wallclock.allreduce_step_s(0.25e9, 0.5, 2, GB, 0.0) == (
      pytest.approx(1.5))
  assert wallclock.allreduce_step_s(0.25e9, 0.5, 2, GB, 0.0,
                                    wallclock.BF16_BYTES) == (
                                        pytest.approx(1.0))


def test_compressor_bytes_per_param():
  defaults = dict(lowrank_rank=32, matrix_shape=(4096, 4096),
                  topk_fraction=0.01)
  got = wallclock.parse_compressors(
      "none,int8,int4,e3m0,lowrank,topk,lowrank:0.02", **defaults)
  assert got == pytest.approx({
      "none": 4.0, "int8": 1 + 4 / 256, "int4": 0.5 + 4 / 256,
      "e3m0": 0.5 + 4 / 256, "lowrank": 0.02, "topk": 0.01 * 4.25})
  # (m + n) r 4 bytes per m x n matrix.
  assert wallclock.parse_compressors("lowrank", **defaults)["lowrank"] == (
      pytest.approx(8192 * 32 * 4 / 4096**2))
  with pytest.raises(ValueError, match="unknown compressor"):
    wallclock.parse_compressors("gzip", **defaults)
  with pytest.raises(ValueError, match="delay"):
    wallclock.round_s_from_exchange(1.0, 10, 1.0, "two_rounds")


def test_cli_preset_prints_table_assumptions_and_paper_comparison():
  out = _run_cli("--preset=diloco_x_107b")
  rows = _table_rows(out)
  assert "AllReduce every step (fp32 grads; round = 1 step)" in rows
  for delay in ("sync", "one_round/eager"):
    for compressor in ("none", "int4", "lowrank+int4"):
      assert f"DiLoCo {delay} [{compressor}]" in rows
  assert "107e9 parameters; 1 Gbps" in out
  assert "[assumption] MFU" in out and "H = 125" in out
  assert "paper: 357x" in out and "Why they differ" in out


def test_cli_measured_file(tmp_path):
  measured = tmp_path / "measured.json"
  measured.write_text(json.dumps({
      "params": 1e6, "step_time_s": 0.1, "tokens_per_step": 1000,
      "workers": 2, "H": 10,
      "bytes_per_round": {"none": 4e6, "int4": 0.5e6}}))
  # 0.008 Gbps = 1e6 B/s: the float32 payload takes 4 s, int4 0.5 s.
  out = _run_cli(f"--measured={measured}", "--bandwidth_gbps=0.008",
                 "--latency_ms=0", "--steps=100")
  rows = _table_rows(out)
  round_s = {arm: float(cells[1].replace(",", ""))
             for arm, cells in rows.items()}
  assert round_s == pytest.approx({
      "AllReduce every step (fp32 grads; round = 1 step)": 4.1,
      "DiLoCo sync [none]": 5.0, "DiLoCo sync [int4]": 1.5,
      "DiLoCo one_round/eager [none]": 4.0,
      "DiLoCo one_round/eager [int4]": 1.0})
  # AllReduce: 100 x 4.1 s; one_round none: 10 s compute + 9 x 3 + 4 waits.
  assert rows["DiLoCo one_round/eager [none]"][4] == "10x"
  assert rows["DiLoCo one_round/eager [none]"][0] == "4 MB"
