"""results.json of a rerun (every stage reused) keeps the first run's
training figures, and its wall time counts every invocation."""

import json
import os
import subprocess
import sys

import test_pipeline

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# As tests/test_pipeline.py's DiLoCo job, without the k-means shards.
FLAGS = [
    "--config=experiments/quickstart.py",
    *test_pipeline.TINY_FLAGS,
    "--config.paths.shape=1",
    "--config.paths.num_replicas=2",
    "--config.base.num_steps=0",
    "--config.train.num_steps=4",
    "--config.diloco.inner_steps=2",
    "--config.routing.features=token_embedding",
]


def _run(workdir) -> dict:
  run = subprocess.run(
      [sys.executable, "-m", "dipaco_jax.main", f"--workdir={workdir}",
       *FLAGS], capture_output=True, text=True, check=False, cwd=REPO,
      timeout=900, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert run.returncode == 0, run.stderr[-3000:]
  return json.loads((workdir / "results.json").read_text()), run.stdout


def test_a_rerun_reports_the_first_runs_figures(tmp_path):
  first, _ = _run(tmp_path)
  again, stdout = _run(tmp_path)
  assert "[main] already trained 4 steps" in stdout
  assert "(reused)" in stdout  # The table says the figures are not new.
  (run1,), (run2,) = first["runs"], again["runs"]
  assert run1["final_loss"] is not None and run1["tokens_per_s"] > 0
  assert run1["train_seconds"] > 0 and not run1["reused"]
  assert run2["reused"]
  for key in ("final_loss", "tokens_per_s", "train_seconds", "steps"):
    assert run2[key] == run1[key], key
  assert again["models"] == first["models"]
  # The rerun's wall time adds its own seconds to the first invocation's.
  wall = json.loads((tmp_path / "wall_time.json").read_text())
  assert wall["invocations"] == 2
  assert again["wall_seconds"] > first["wall_seconds"] > 0
  assert wall["seconds"] >= again["wall_seconds"]
