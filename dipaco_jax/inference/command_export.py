"""What `python -m dipaco_jax.export` does, without its flags (so that
tests and scripts can call it): the choice of what to export, and writing
one path, the dense baseline, or everything (`sources.py` describes an
export of everything, `exported.py` a model directory).

--out must be new or empty; with --overwrite it may hold an earlier export
(nothing but what an export writes), which the new one replaces whole. The
export is written beside it, in `.OUT.partial`, and renamed into place once
complete: a failed or killed export leaves the earlier one as it was, and
never an old file beside a new one.
"""

import re

from etils import epath

from dipaco_jax import errors
from dipaco_jax.inference import exported
from dipaco_jax.inference import sources
from dipaco_jax.inference import workdir as workdir_lib
from dipaco_jax.store import atomic
from dipaco_jax.store import items

_ROUTER_DIR = "router"
# The names an export writes at its top (`exported.py`, `sources.py`).
_EXPORT_NAMES = re.compile(
    rf"{exported.MODEL_FILE}|{exported.PARAMS_DIR}|{exported.TOKENIZER_FILE}"
    rf"|{sources.ROUTING_FILE}|path_\d{{3,}}|dense|features|{_ROUTER_DIR}")


def check_choice(path, dense: bool, everything: bool, num_paths: int) -> None:
  """One of --path, --dense, --all, and a path the workdir has."""
  if (path is not None) + dense + everything != 1:
    raise errors.UserError("give one of --path=P, --dense or --all.")
  if path is not None and not 0 <= path < num_paths:
    raise errors.UserError(
        f"--path={path}: the workdir has {num_paths} paths, 0 to "
        f"{num_paths - 1}; give one of them (or --all).")


def check_out(out, overwrite: bool) -> None:
  """--out is new or empty, or (with --overwrite) holds an export only."""
  out = epath.Path(out)
  names = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
  if not names:
    return
  held = exported.is_model_dir(out) or sources.is_export(out)
  strangers = [n for n in names if not _EXPORT_NAMES.fullmatch(n)]
  if held and not strangers:
    if overwrite:
      return
    raise errors.UserError(f"--out={out} already holds an export; give "
                           "--overwrite to replace it, or another --out.")
  listed = ", ".join(strangers[:3]) + (
      f" and {len(strangers) - 3} more" if len(strangers) > 3 else "")
  what = (f"holds files an export does not write ({listed})" if held else
          f"is not empty ({listed or ', '.join(names[:3])}) and holds no "
          "export")
  raise errors.UserError(
      f"--out={out} {what}; give a new or empty directory (--overwrite "
      "replaces an export, nothing else).")


def export(workdir: str, out: str, path, dense: bool, everything: bool,
           overwrite: bool = False) -> list[str]:
  """Writes the export (module docstring); returns the lines to print."""
  check_out(out, overwrite)
  w = workdir_lib.TrainedWorkdir(workdir)
  check_choice(path, dense, everything, w.num_paths)
  out = epath.Path(out)
  remote = "://" in str(out)
  # A local rename keeps the earlier export whole until the new one is;
  # an object store has no directory rename: the earlier one goes first.
  staging = out if remote else out.parent / f".{out.name}.partial"
  if remote and overwrite and out.exists():
    out.rmtree()
  if staging.exists():
    staging.rmtree()  # A killed export's leftover.
  try:
    if everything:
      lines = save_all(w, staging)
    elif dense:
      lines = [save_dense(w, staging)]
    else:
      lines = [save_path(w, path, staging)]
    if not remote:
      _replace(out, staging)
  except BaseException as e:
    if remote or not staging.exists():
      raise
    written = items.directory_bytes(staging)
    staging.rmtree()
    if errors.disk_full_message(e) is None:
      raise
    # Said here: once the partial export is gone, the disk is no longer
    # full, and the size it reached is the useful figure.
    raise errors.UserError(
        f"disk full writing --out={out} (the export had reached "
        f"{errors.format_bytes(written)}, and is removed); free space or "
        "point --out elsewhere.") from e
  return [line.replace(str(staging), str(out)) for line in lines]


def _replace(out: epath.Path, staging: epath.Path) -> None:
  """Renames the finished `staging` to `out`; an earlier `out` (empty, or
  an export) is renamed aside first and deleted after."""
  old = out.parent / f".{out.name}.old"
  if old.exists():
    old.rmtree()
  if out.exists():
    out.rename(old)
  staging.rename(out)
  if old.exists():
    old.rmtree()


def save_all(w: workdir_lib.TrainedWorkdir, out) -> list[str]:
  """Exports every path of `w`, its dense baseline, the feature model and
  the routers into `out`; returns the lines to print."""
  out = epath.Path(out)
  routed = sources.from_workdir(w)
  lines = []
  names = []
  for p, params in enumerate(routed.path_params):
    names.append(f"path_{p:03d}")
    lines.append(save_path(w, p, out / names[-1], params))
  lines.append(save_dense(w, out / "dense"))
  r = routed.routing
  feature_run = "base" if "base" in w.runs else "initial model"
  exported.save_model(out / "features", r.feature_model, r.feature_params,
                      w.tokenizer, _info(w, {
                          "run": feature_run,
                          "routing_features": w.config.routing.features}))
  lines.append(f"routing features ({w.config.routing.features}) -> "
               f"{out / 'features'}")
  r.document_router.save(out / _ROUTER_DIR / "document.npz")
  window = None
  if r.window_router is not None:
    window = f"{_ROUTER_DIR}/window.npz"
    r.window_router.save(out / window)
  atomic.write_json(out / sources.ROUTING_FILE, {
      "format": exported.FORMAT, "paths": names,
      "path_names": routed.path_names, "dense": "dense",
      "features": "features", "feature_kind": r.feature_kind,
      "document_router": f"{_ROUTER_DIR}/document.npz",
      "window_router": window, "window_router_info": routed.window_router_info,
      "prefix_len": r.prefix_len, "seq_len": r.seq_len, "every": r.every,
      "batch_size": r.batch_size, "source": routed.source})
  lines.append(f"routers ({r.document_router.kind} document router"
               + (", learned window router" if window else "")
               + f") -> {out / _ROUTER_DIR}; {out / sources.ROUTING_FILE}")
  return lines


def _info(w: workdir_lib.TrainedWorkdir, source: dict) -> dict:
  return {"prefix_len": w.config.data.prefix_len,
          "seq_len": w.config.data.seq_len,
          "source": {"workdir": str(w.workdir), **source}}


def save_path(w: workdir_lib.TrainedWorkdir, path: int, out,
              params=None) -> str:
  """Exports one path of the main run as a dense model; returns a line."""
  run = w.run(w.main_run)
  params = w.path_params(path) if params is None else params
  model, params = exported.dense_layout(w.model, params, run.topology)
  stopped = w.early_stopping_step(path)
  exported.save_model(out, model, params, w.tokenizer, _info(w, {
      "run": run.name, "path": path,
      "level_ids": list(w.topology.path_level_ids(path)),
      "step": stopped if stopped is not None else run.step,
      "early_stopping": stopped is not None}))
  return (f"{w.describe_path(path)} of runs/{run.name} at step "
          f"{stopped if stopped is not None else run.step}"
          + (" (early-stopping snapshot)" if stopped is not None else "")
          + f" -> {out}")


def save_dense(w: workdir_lib.TrainedWorkdir, out) -> str:
  """Exports the dense baseline (or a one-path config's model)."""
  model, params = w.dense()
  name = "dense" if "dense" in w.runs else w.main_run
  exported.save_model(out, model, params, w.tokenizer, _info(w, {
      "run": name, "step": w.run(name).step}))
  return f"dense model of runs/{name} at step {w.run(name).step} -> {out}"
