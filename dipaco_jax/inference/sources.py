"""Every path of a trained model with its routers, from a workdir or from
an export of it (`python -m dipaco_jax.export --all`).

An export of everything (`command_export.save_all`) holds one model
directory per path (`exported.save_model`), the dense baseline, the
routing feature model and the routers:

  routing.json         {"format", "paths": ["path_000", ...], "path_names",
                       "dense": "dense", "features": "features",
                       "feature_kind", "document_router": "router/document.npz",
                       "window_router": "router/window.npz" or null,
                       "window_router_info", "prefix_len", "seq_len", "every",
                       "batch_size", "source"}
  path_000/ ...        each path, a standalone dense model
  dense/               DiPaCo's dense baseline
  features/            the model routing features come from (the base
                       model; without one, the initial model's embedding)
  router/*.npz         `routing.router.Router.save` files
"""

import dataclasses
import json

from etils import epath

from dipaco_jax import errors
from dipaco_jax.data import tokenizer as tokenizer_lib
from dipaco_jax.inference import exported
from dipaco_jax.inference import routing as routing_lib
from dipaco_jax.inference import workdir as workdir_lib
from dipaco_jax.model import transformer
from dipaco_jax.routing import router as router_lib

ROUTING_FILE = "routing.json"


@dataclasses.dataclass(frozen=True)
class RoutedModel:
  """What generation needs: every path (one model, P parameter trees) and
  the routers; or a single model (one path, `routing` None)."""
  tokenizer: tokenizer_lib.Tokenizer
  model: transformer.PathTransformer
  path_params: list
  path_names: list  # "path 2 (experts 1/0)"
  routing: routing_lib.Routing | None
  window_router_info: dict | None
  source: str
  prefix_len: int
  seq_len: int


def from_workdir(w) -> RoutedModel:
  """The main run's paths (as evaluation scores them) and routers of a
  workdir (its directory, or a `workdir.TrainedWorkdir`)."""
  if not isinstance(w, workdir_lib.TrainedWorkdir):
    w = workdir_lib.TrainedWorkdir(w)
  directory, c = w.workdir, w.config
  if w.num_paths == 1:  # Dense or DiLoCo: one model, nothing to route.
    model, params = w.dense()
    return RoutedModel(w.tokenizer, model, [params],
                       [f"the model of runs/{w.main_run}"], None, None,
                       f"workdir {directory}", c.data.prefix_len,
                       c.data.seq_len)
  window_router, info = w.window_router()
  feature_model, feature_params = w.feature_model()
  routing = routing_lib.Routing(
      w.document_router(), window_router, c.routing.features, feature_model,
      feature_params, c.data.prefix_len, c.data.seq_len,
      info["every"] if info else 0, c.train.eval_batch_size)
  return RoutedModel(w.tokenizer, w.model,
                     [w.path_params(p) for p in range(w.num_paths)],
                     [w.describe_path(p) for p in range(w.num_paths)],
                     routing, info, f"workdir {directory}, run {w.main_run}",
                     c.data.prefix_len, c.data.seq_len)


def is_export(directory) -> bool:
  return (epath.Path(directory) / ROUTING_FILE).exists()


def from_export(directory) -> RoutedModel:
  """An export of everything (module docstring), or of one model (then
  without routing). A damaged file is one line naming it and the command
  that exports it again (`exported.DamagedExportError`)."""
  directory = epath.Path(directory)
  if exported.is_model_dir(directory):
    one = exported.load_model(directory)
    return RoutedModel(one.tokenizer, one.model, [one.params],
                       [_model_name(one.info["source"])], None, None,
                       f"export {directory}", one.info["prefix_len"],
                       one.info["seq_len"])
  if not is_export(directory):
    raise errors.UserError(
        f"--export={directory} has neither {ROUTING_FILE} nor "
        f"{exported.MODEL_FILE}: give a directory written by python -m "
        "dipaco_jax.export.")
  spec, redo = _read_spec(directory)
  try:
    paths = [exported.load_model(directory / name, redo)
             for name in spec["paths"]]
    features = exported.load_model(directory / spec["features"], redo)
    window = spec["window_router"]
    document_router = _router(directory / spec["document_router"], redo)
    routing = routing_lib.Routing(
        document_router, _router(directory / window, redo) if window else
        None, spec["feature_kind"], features.model, features.params,
        spec["prefix_len"], spec["seq_len"], spec["every"], spec["batch_size"])
    return RoutedModel(paths[0].tokenizer, paths[0].model,
                       [m.params for m in paths], spec["path_names"], routing,
                       spec["window_router_info"], f"export {directory}",
                       spec["prefix_len"], spec["seq_len"])
  except (KeyError, TypeError, IndexError) as e:  # Fields routing.json lacks.
    raise exported.damaged(directory / ROUTING_FILE,
                           f"{type(e).__name__}: {e}", redo) from e


def _read_spec(directory: epath.Path) -> tuple[dict, str]:
  """routing.json, and the command that writes the export again (from
  where its models say they came from)."""
  models = [*sorted(directory.glob("path_*")), directory / "dense"]
  redo = exported.reexport_command(directory, next(
      filter(None, map(exported.source_of, models)), None), "--all")
  try:
    spec = json.loads((directory / ROUTING_FILE).read_text())
    if not isinstance(spec, dict):
      raise ValueError(f"a JSON {type(spec).__name__}, not an object")
  except (OSError, UnicodeDecodeError, ValueError) as e:
    raise exported.damaged(directory / ROUTING_FILE, f"not JSON ({e})",
                           redo) from e
  return spec, redo


def _router(path: epath.Path, redo: str) -> router_lib.Router:
  try:
    return router_lib.Router.load(path)
  except Exception as e:  # pylint: disable=broad-except
    # numpy and zipfile raise many types for a missing or damaged .npz (a
    # flipped bit fails its CRC).
    raise exported.damaged(path, "missing" if not path.exists() else
                           f"{type(e).__name__}: {e}", redo) from e


def _model_name(source: dict) -> str:
  if "path" in source:
    return (f"path {source['path']} (experts "
            f"{'/'.join(map(str, source['level_ids']))}) of runs/"
            f"{source['run']}")
  return f"the model of runs/{source['run']}"
