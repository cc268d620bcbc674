"""A trained path (or the dense baseline) as a standalone dense model.

A model directory holds

  model.json   {"format", "model": the `ModelDims` fields, "segments":
               [[slot, layers], ...], "embed_slot", "tokenizer":
               "spm.model", "tokenizer_sha256", "bos_id", "prefix_len",
               "seq_len", "source": where it came from}
  params/      the parameters: an orbax PyTree checkpoint of plain nested
               dicts of float32 arrays, the tree of
               `transformer.PathTransformer` (`store.items`: the item in
               params/writer-PID-TOKEN/item/, then its commit marker
               params/COMMITTED.json, which names that writer and holds
               the sha256 of every array's bytes)
  spm.model    the SentencePiece tokenizer it was trained with

`load_model(DIR)` reads it back; without this loader,
`orbax.checkpoint.PyTreeCheckpointer().restore(DIR/params/WRITER/item)`
(WRITER: the marker's "writer"; exports before writer directories:
`DIR/params/item`) gives the parameter tree, and `PathTransformer(ModelDims(**model), segments)` the
model. With stacked layers (`model.scan_layers`, the default) a path's
layer slots are gathered into one stack, the dense model's layout; with
unstacked layers they keep their slots.

`load_model` checks what it reads: a missing, truncated or unreadable
file, an array whose bytes differ from its sha256, or a tokenizer whose
sha256 differs raises `DamagedExportError`, one line naming the file and
the command that exports it again. Exports written before the digests
(no "digests" in params/COMMITTED.json, no "tokenizer_sha256") load
unverified.
"""

import dataclasses
import json

from etils import epath
import flax.linen as nn
import jax
import jax.numpy as jnp

from dipaco_jax import errors
from dipaco_jax import paths as paths_lib
from dipaco_jax.data import tokenizer as tokenizer_lib
from dipaco_jax.model import bank as bank_lib
from dipaco_jax.model import layers
from dipaco_jax.model import transformer
from dipaco_jax.store import atomic
from dipaco_jax.store import integrity
from dipaco_jax.store import items

FORMAT = "dipaco_jax.export.v1"
MODEL_FILE = "model.json"
PARAMS_DIR = "params"
TOKENIZER_FILE = "spm.model"


class DamagedExportError(errors.UserError):
  """A file of an export that is missing, unreadable or not what was
  written; the message names it and the command to export it again."""


@dataclasses.dataclass(frozen=True)
class ExportedModel:
  model: transformer.PathTransformer
  params: dict
  tokenizer: tokenizer_lib.Tokenizer
  info: dict  # model.json


def is_model_dir(directory) -> bool:
  return (epath.Path(directory) / MODEL_FILE).exists()


def dense_layout(model: transformer.PathTransformer, params: dict, topology):
  """(model, params) of one path as a dense model: its layer slots
  gathered into one stack (`bank.path_params_to_bank` onto the one-path
  topology), when layers are stacked."""
  if not model.dims.scan_layers or len(model.segments) == 1:
    return model, params
  dense = paths_lib.build_topology(model.dims.num_layers, (1,))
  params = bank_lib.bank_path(
      bank_lib.path_params_to_bank(params, topology, dense), dense, 0)
  return transformer.build_model(model.dims, dense), params


def save_model(directory, model: transformer.PathTransformer, params: dict,
               tokenizer: tokenizer_lib.Tokenizer, info: dict) -> None:
  """Writes a model directory (module docstring); `info` (prefix_len,
  seq_len, source) goes into model.json."""
  directory = epath.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  dims = dataclasses.asdict(model.dims)
  # Resolved again where it is loaded: cuDNN attention is GPU-only.
  dims["attention"] = "auto"
  # The source again, so that a damaged model.json still names it.
  items.save_tree(directory / PARAMS_DIR, jax.device_get(params),
                  {"format": FORMAT, "source": info.get("source")})
  atomic.write_bytes(directory / TOKENIZER_FILE, tokenizer.model_proto)
  atomic.write_json(directory / MODEL_FILE, {
      "format": FORMAT, "model": dims,
      "segments": [list(s) for s in model.segments],
      "embed_slot": model.embed_slot, "tokenizer": TOKENIZER_FILE,
      "tokenizer_sha256": tokenizer.sha256, "bos_id": tokenizer.bos_id,
      **info})


def reexport_command(out, source: dict | None, choice: str | None = None):
  """The command that writes the export at `out` again, from what its
  model.json says it came from (`choice`: --all for an export of
  everything)."""
  source = source or {}
  if choice is None:
    choice = (f"--path={source['path']}" if "path" in source else "--dense"
              if source else "--path=P|--dense|--all")
  return (f"python -m dipaco_jax.export --workdir="
          f"{source.get('workdir', 'WORKDIR')} {choice} --out={out} "
          "--overwrite")


def damaged(file, reason: str, command: str) -> DamagedExportError:
  return DamagedExportError(f"{file} is damaged: {reason}; export it again: "
                            f"{command}")


def load_model(directory, redo: str | None = None) -> ExportedModel:
  """A model directory written by `save_model`, checked (module
  docstring); `redo` is the command named when a file is damaged (by
  default, one that exports this directory alone again)."""
  directory = epath.Path(directory)
  if not is_model_dir(directory):
    if redo is not None:  # Part of an export of everything.
      raise damaged(directory / MODEL_FILE, "missing", redo)
    raise errors.UserError(f"{directory} has no {MODEL_FILE}: not a "
                           "directory written by python -m dipaco_jax.export.")
  try:
    info = json.loads((directory / MODEL_FILE).read_text())
    if not isinstance(info, dict):
      raise ValueError(f"a JSON {type(info).__name__}, not an object")
  except (OSError, UnicodeDecodeError, ValueError) as e:
    raise damaged(directory / MODEL_FILE, f"not JSON ({e})", redo or (
        reexport_command(directory, source_of(directory)))) from e
  redo = redo or reexport_command(directory, info.get("source"))
  if info.get("format") != FORMAT:
    raise errors.UserError(f"{directory / MODEL_FILE}: format "
                           f"{info.get('format')!r}, this code reads {FORMAT}.")
  try:
    model = _model_of(info)
  except (KeyError, TypeError, ValueError) as e:
    raise damaged(directory / MODEL_FILE, f"{type(e).__name__}: {e}",
                  redo) from e
  like = nn.unbox(jax.eval_shape(model.init, jax.random.key(0),
                                 jnp.zeros((1, 8), jnp.int32))["params"])
  try:
    params, _ = items.load_tree(directory / PARAMS_DIR, like)
  except integrity.DamagedKeyError as e:
    raise damaged(e.key, e.reason, redo) from e
  except items.NotCommittedError as e:
    reason = (f"no {atomic.COMMIT_MARKER}" if (directory / PARAMS_DIR).exists()
              else "missing")
    raise damaged(directory / PARAMS_DIR, reason, redo) from e
  except ValueError as e:  # Arrays of other shapes than model.json says.
    raise damaged(directory / PARAMS_DIR, integrity.first_line(e),
                  redo) from e
  return ExportedModel(model, params, _tokenizer(directory, info, redo), info)


def source_of(directory) -> dict | None:
  """Where the model directory's export came from: its model.json, else
  its params' commit marker; None when neither can be read."""
  directory = epath.Path(directory)
  for read in (lambda: json.loads((directory / MODEL_FILE).read_text()),
               lambda: items.read_meta(directory / PARAMS_DIR)):
    try:
      source = read().get("source")
    except Exception:  # pylint: disable=broad-except
      continue  # Damaged too: reported when it is read.
    if isinstance(source, dict):
      return source
  return None


def _model_of(info: dict) -> transformer.PathTransformer:
  dims = dict(info["model"])
  if dims["attention"] == "auto":
    dims["attention"] = "cudnn" if jax.default_backend() == "gpu" else "xla"
  return transformer.PathTransformer(
      layers.ModelDims(**dims), tuple((n, k) for n, k in info["segments"]),
      info["embed_slot"])


def _tokenizer(directory: epath.Path, info: dict, redo: str):
  path = directory / info.get("tokenizer", TOKENIZER_FILE)
  try:
    tokenizer = tokenizer_lib.Tokenizer.load(path)
  except ValueError as e:  # Missing, unreadable, not SentencePiece.
    cause = e.__cause__
    reason = ("missing" if not path.exists() else
              f"not a SentencePiece model ({cause})"
              if isinstance(cause, RuntimeError) else
              f"unreadable ({cause or e})")
    raise damaged(path, reason, redo) from e
  want = info.get("tokenizer_sha256")  # Older exports: unchecked.
  if want is not None and tokenizer.sha256 != want:
    raise damaged(path, f"sha256 {tokenizer.sha256[:16]}..., written with "
                  f"{want[:16]}...", redo)
  return tokenizer
