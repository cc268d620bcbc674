"""The job's report: results.json, the final table on stdout and the plots
a person would rather look at."""

import json

from absl import logging
from etils import epath
import numpy as np

from dipaco_jax import figures
from dipaco_jax.parallel import multihost
from dipaco_jax.store import atomic
from dipaco_jax.train import metrics as metrics_lib


def _table(header, rows) -> str:
  cells = [header] + [[str(c) for c in row] for row in rows]
  widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
  line = "+-" + "-+-".join("-" * w for w in widths) + "-+"
  fmt = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)
                                    ) + " |"
  return "\n".join([line, fmt(cells[0]), line] + [fmt(r) for r in cells[1:]]
                   + [line])


def _bytes(n: int) -> str:
  for unit in ("B", "KB", "MB", "GB", "TB"):
    if n < 1024 or unit == "TB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024


def _speed(run: dict) -> str:
  """Tokens/s of a run, marked when this invocation reused its
  checkpoint (the figure is then the one it trained at)."""
  speed = f"{run['tokens_per_s']:,.0f}" if run["tokens_per_s"] else ""
  return f"{speed} (reused)".strip() if run.get("reused") else speed


def final_table(results: dict) -> str:
  """Validation perplexity of every model on the same tokens, and costs."""
  rows = [[name, f"{m['loss']:.4f}", f"{m['perplexity']:.2f}",
           f"{m['tokens']:,}"] for name, m in results["models"].items()]
  out = ["", f"Validation (first {results['prefix_len']} tokens of each "
         "document not scored):",
         _table(["model", "loss", "perplexity", "scored tokens"], rows)]
  train = results["runs"]
  out.append(_table(
      ["run", "workers", "steps", "train tokens/s", "bytes communicated"],
      [[t["name"], t["workers"], t["steps"], _speed(t),
        _bytes(t["bytes_communicated"])] for t in train]))
  if results.get("paths"):
    ppl = lambda m: f"{m['perplexity']:.2f}" if m["tokens"] else "-"
    out.append(_table(
        ["path", "experts", "train docs", "train tokens", "val docs",
         "val ppl: path", "val ppl: dense"],
        [[p["path"], "/".join(map(str, p["level_ids"])),
          f"{p['train_documents']:,}", f"{p['train_tokens']:,}",
          p["validation_documents"], ppl(p["validation"]),
          ppl(p["validation_dense"])] for p in results["paths"]]))
  scaling = scaling_rows(results)
  if scaling:
    out.append(_table(
        ["model (training compute)", "non-embedding params", "steps",
         "training FLOPs", "val ppl"],
        [[short, f"{c['non_embedding_params']:,}", f"{c['steps']:,}",
          f"{c['train_flops']:.3g}", f"{m['perplexity']:.2f}"]
         for short, c, m in scaling]))
  out += reading(results)
  out.append(f"wall time {results['wall_seconds']:.0f} s (every invocation "
             "on this workdir)")
  return "\n".join(out)


_ROUTED_ONCE = "dipaco routed once per document"
_DENSE = "dense baseline (one path's size)"


def reading(results: dict) -> list[str]:
  """What a DiPaCo run's tables compare, in words, with its own figures
  ([] for other runs)."""
  models, compute = results["models"], results.get("compute", {})
  if _ROUTED_ONCE not in models or _DENSE not in models:
    return []
  dipaco, dense = (models[n]["perplexity"] for n in (_ROUTED_ONCE, _DENSE))
  verdict = "ahead of" if dipaco < dense else "behind"
  lines = [
      "How to read it (lower perplexity is better, every row on the same "
      "tokens):",
      f"- DiPaCo routed once runs ONE of its {len(results['paths'])} paths "
      f"per document, chosen from its first {results['prefix_len']} tokens: "
      "the dense baseline's size and inference cost.",
      "- The dense baseline trained as many steps on all the documents, "
      "from the same base.",
      f"- DiPaCo routed once is {verdict} it: {dipaco:.2f} against "
      f"{dense:.2f} ({dipaco / dense - 1:+.1%}). The oracle rows pick each "
      "document's best path in hindsight: bounds, not models."]
  if _ROUTED_ONCE in compute and _DENSE in compute:
    ratio = (compute[_ROUTED_ONCE]["train_flops"]
             / compute[_DENSE]["train_flops"])
    same_flops = [m for n, m in models.items()
                  if compute.get(n, {}).get("role") == "dense same_flops"]
    lines.append(
        f"- Training cost: DiPaCo spent {ratio:.1f}x the dense baseline's "
        "FLOPs (its paths train in parallel, exchanging modules only every "
        "H steps); " + (
            f"the dense model given as many FLOPs reaches "
            f"{same_flops[0]['perplexity']:.2f}." if same_flops else
            "--config.eval.dense_same_flops=True adds the dense model "
            "given as many."))
  return lines


def _short_name(name: str, compute: dict) -> str | None:
  """The scaling plot's label of a model row, or None to leave it out: the
  oracles and the feature re-routers are not models one could train."""
  role = compute["role"]
  if role == "dipaco":
    if name == "dipaco routed once per document":
      return "DiPaCo, routed once"
    if "learned window router" in name:
      return "DiPaCo, learned re-router"
    return None
  return {"dense baseline": "dense 1x, baseline",
          "dense same_flops": "dense 1x, DiPaCo's FLOPs",
          }.get(role, f"dense {compute['scale']:g}x, from scratch")


def scaling_rows(results) -> list[tuple[str, dict, dict]]:
  """(label, results["compute"] entry, results["models"] entry) of every
  model the scaling plot shows."""
  rows = []
  for name, c in results.get("compute", {}).items():
    short = _short_name(name, c)
    if short is not None and name in results["models"]:
      rows.append((short, c, results["models"][name]))
  return rows


def _plt():
  return figures.pyplot()


def _save(fig, workdir, filename) -> str:
  fig.tight_layout()
  return str(figures.save(fig, epath.Path(workdir) / "plots" / filename))


def plot_losses(workdir, run_names, filename="loss.png",
                from_scratch=()) -> str | None:
  """Training loss (mean over workers) of each run against its steps; runs
  in `from_scratch` start at step 0 like the base."""
  plt = _plt()
  workdir = epath.Path(workdir)
  fig, ax = plt.subplots(figsize=(7, 4.5))
  plotted = False
  offset = 0
  for name in run_names:
    rows = metrics_lib.read_jsonl(workdir / "runs" / name / "logs" / "train"
                                  / "metrics.jsonl")
    if rows:
      # Forked runs continue from the base: draw them after it.
      shift = offset if name != "base" and name not in from_scratch else 0
      ax.plot([r["step"] + shift for r in rows], [r["loss"] for r in rows],
              label=name)
      if name == "base":
        offset = rows[-1]["step"]
      plotted = True
  if not plotted:
    plt.close(fig)
    return None
  ax.set_xlabel("inner step (forked runs start where the base ends)")
  ax.set_ylabel("training loss (mean over workers)")
  ax.grid(alpha=0.3)
  ax.legend()
  return _save(fig, workdir, filename)


def plot_paths(workdir, results, filename="paths.png") -> str:
  """Per path: training tokens and routed validation perplexity."""
  plt = _plt()
  paths = results["paths"]
  fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(6, len(paths) * 0.5), 6),
                                 sharex=True)
  xs = [p["path"] for p in paths]
  ax1.bar(xs, [p["train_tokens"] for p in paths], color="tab:blue")
  ax1.set_ylabel("training tokens")
  ax1.set_title("Shards and routed validation perplexity per path")
  value = lambda m: m["perplexity"] if m["tokens"] else 0
  offsets = [x - 0.2 for x in xs], [x + 0.2 for x in xs]
  ax2.bar(offsets[0], [value(p["validation"]) for p in paths], width=0.4,
          color="tab:orange", label="the path")
  ax2.bar(offsets[1], [value(p["validation_dense"]) for p in paths],
          width=0.4, color="tab:gray", label="dense baseline")
  ax2.set_ylabel("perplexity on the path's\nrouted validation docs")
  ax2.set_xlabel("path")
  ax2.set_xticks(xs)
  tallest = max([value(p["validation"]) for p in paths]
                + [value(p["validation_dense"]) for p in paths] + [1.0])
  ax2.set_ylim(0, 1.3 * tallest)  # Room for the legend above the bars.
  ax2.legend(loc="upper right", ncol=2)
  return _save(fig, workdir, filename)


def _count(n: float) -> str:
  for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
    if n >= div:
      return f"{n / div:.3g}{unit}"
  return f"{n:.0f}"


def plot_scaling(workdir, results, filename="scaling.png") -> str:
  """Validation perplexity of DiPaCo and every dense model against training
  FLOPs (all runs, base included) and against the steps one model (or one
  path) took, base included."""
  plt = _plt()
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
  for i, (short, c, m) in enumerate(scaling_rows(results)):
    dipaco = c["role"] == "dipaco"
    for ax, key in zip(axes, ("train_flops", "steps")):
      ax.scatter(c[key], m["perplexity"], s=120 if dipaco else 60,
                 marker="*" if dipaco else "o", color=f"C{i}", zorder=3,
                 label=(f"{short} ({_count(c['non_embedding_params'])} "
                        "non-embedding params)"))
  axes[0].set_xscale("log")
  axes[0].set_xlabel("training FLOPs (6 x matmul params x tokens, all runs, "
                     "base included)")
  axes[1].set_xlabel("training steps of one model (or one path), base "
                     "included")
  axes[0].set_ylabel("validation perplexity (same tokens)")
  axes[0].set_title("DiPaCo vs dense models: training compute")
  axes[1].set_title("... and steps")
  axes[1].margins(x=0.2)
  for ax in axes:
    ax.grid(alpha=0.3, which="both")
  axes[0].legend(fontsize=8)
  return _save(fig, workdir, filename)


def train_summary(run) -> dict:
  """The results.json entry of a `stages.experiment.TrainedRun`.

  Its training figures come from the run's `summary.json`
  (`metrics.write_run_summary`), the same whether this invocation trained
  the run, resumed it or reused it; without one (a run trained before it
  existed) from what this invocation measured.
  """
  exp, result = run.experiment, run.result
  # A run trained by an earlier invocation comes back with no losses.
  reused = not result.final_losses_W.size
  out = {"name": exp.name, "workers": exp.topology.num_workers,
         "steps": result.steps, "tokens_per_s": result.tokens_per_s,
         "resumed_from": result.resumed_from, "reused": reused,
         "bytes_communicated": exp.bytes_communicated(),
         "train_seconds": None,
         "final_loss": None if reused else float(
             np.mean(result.final_losses_W))}
  if getattr(exp, "store_bytes", None) is not None:  # Islands: measured.
    out["store_bytes"] = exp.store_bytes
  sent = (exp.bytes_sent() if getattr(exp, "store_bytes", None) is None
          else None)
  if sent is not None:  # DiLoCoX compression: measured payloads.
    out["bytes_sent"] = sent
  saved = metrics_lib.read_run_summary(exp.run_dir)
  if saved is not None and saved["steps"] == result.steps:
    out.update({k: saved[k] for k in ("tokens_per_s", "train_seconds",
                                      "final_loss")})
  return out


WALL_TIME = "wall_time.json"


def wall_seconds_before(workdir) -> float:
  """Wall time of the earlier invocations that worked on `workdir`."""
  path = epath.Path(workdir) / WALL_TIME
  return json.loads(path.read_text())["seconds"] if path.exists() else 0.0


def add_wall_seconds(workdir, seconds: float) -> None:
  """Adds one invocation's wall time to `{workdir}/wall_time.json`
  (process 0; the workdir lock keeps it the only writer)."""
  if not multihost.is_writer():
    return
  path = epath.Path(workdir) / WALL_TIME
  old = json.loads(path.read_text()) if path.exists() else {}
  atomic.write_json(path, {
      "seconds": old.get("seconds", 0.0) + seconds,
      "invocations": old.get("invocations", 0) + 1})


def data_summary(data) -> dict:
  """Documents and tokens per split, for results.json."""
  return {s: {"documents": len(d), "tokens": d.num_tokens}
          for s, d in data.docs.items()}


def write_results(workdir, results, runs, from_scratch=()) -> None:
  """results.json, the plots of `runs` (those in `from_scratch` not forked
  from the base) and the table (process 0 only)."""
  if not multihost.is_writer():
    return
  # Not `write_json`: sorted keys would reorder the table's models.
  atomic.write_text(workdir / "results.json", json.dumps(results, indent=1))
  plots = [plot_losses(workdir, runs, from_scratch=from_scratch)]
  if results.get("paths"):
    plots.append(plot_paths(workdir, results))
  if any(c["role"] in ("dense scaled", "dense same_flops")
         for c in results.get("compute", {}).values()):
    plots.append(plot_scaling(workdir, results))
  print(final_table(results), flush=True)
  for p in plots:
    if p:
      print(f"plot: {p}")
  print(f"results: {workdir / 'results.json'}", flush=True)
  logging.info("Wrote %s", workdir / "results.json")
