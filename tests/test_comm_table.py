"""bench/comm_table.py on hand-made arms: perplexity against the baseline,
bytes both ways, and a larger batch's arms against their own baseline."""

import importlib.util
import json
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "comm_table", os.path.join(REPO, "bench", "comm_table.py"))
comm_table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(comm_table)


def _write(arms, name, perplexity, sent=4e8):
  result = {"models": {"diloco x8": {"perplexity": perplexity}},
            "runs": [{"name": "main", "bytes_sent": {
                "float32_per_worker_round": 4e8,
                "per_worker_round": sent}}]}
  (arms / f"{name}.json").write_text(json.dumps(result))


def test_each_batch_is_compared_with_its_own_baseline(tmp_path):
  _write(tmp_path, "diloco_x8", 8.0)
  _write(tmp_path, "sparseloco", 9.0, sent=4e6)
  _write(tmp_path, "b128_diloco_x8", 6.0)
  _write(tmp_path, "b128_sparseloco", 6.3, sent=4e6)
  rows = [line.split(" | ")[:5]
          for line in comm_table.table(tmp_path).splitlines()[2:]]
  # Unbatched arms first, each batch's baseline before its arms.
  assert rows == [
      ["| diloco_x8", "8.000", "+0.00%", "400.00 MB", "1.0x"],
      ["| sparseloco", "9.000", "+12.50%", "4.00 MB", "100.0x"],
      ["| b128_diloco_x8", "6.000", "+0.00%", "400.00 MB", "1.0x"],
      ["| b128_sparseloco", "6.300", "+5.00%", "4.00 MB", "100.0x"]]
  # --prefix keeps one batch; the baseline is still that batch's.
  prefixed = comm_table.table(tmp_path, "diloco_x8", "b128_").splitlines()
  assert [line.split(" | ")[2] for line in prefixed[2:]] == ["+0.00%",
                                                              "+5.00%"]
