"""The final table on stdout and the plots a person would rather look at."""

from etils import epath

from dipaco_jax.train import metrics as metrics_lib


def _table(header, rows) -> str:
  cells = [header] + [[str(c) for c in row] for row in rows]
  widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
  line = "+-" + "-+-".join("-" * w for w in widths) + "-+"
  fmt = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
  return "\n".join([line, fmt(cells[0]), line] + [fmt(r) for r in cells[1:]]
                   + [line])


def dense_table(results: dict) -> str:
  v, t = results["validation"], results["train"]
  rows = [["dense", t["workers"], t["steps"], f"{v['loss']:.4f}",
           f"{v['perplexity']:.2f}", f"{v['tokens']:,}",
           f"{t['tokens_per_s']:,.0f}"]]
  return "\n" + _table(["model", "workers", "steps", "val loss", "val ppl",
                        "scored tokens", "train tokens/s"], rows) + (
                            f"\nwall time {results['wall_seconds']:.0f} s")


def plot_losses(workdir, run_names, filename="loss.png") -> str | None:
  """Training loss (mean over workers) of each run against its steps."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  workdir = epath.Path(workdir)
  fig, ax = plt.subplots(figsize=(7, 4.5))
  plotted = False
  for name in run_names:
    rows = metrics_lib.read_jsonl(workdir / "runs" / name / "logs" / "train"
                                  / "metrics.jsonl")
    if rows:
      ax.plot([r["step"] for r in rows], [r["loss"] for r in rows],
              label=name)
      plotted = True
  if not plotted:
    plt.close(fig)
    return None
  ax.set_xlabel("inner step")
  ax.set_ylabel("training loss (mean over workers)")
  ax.grid(alpha=0.3)
  ax.legend()
  out = workdir / "plots"
  out.mkdir(parents=True, exist_ok=True)
  fig.tight_layout()
  fig.savefig(out / filename, dpi=120)
  plt.close(fig)
  return str(out / filename)
