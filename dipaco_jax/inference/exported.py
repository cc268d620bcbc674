"""A trained path (or the dense baseline) as a standalone dense model.

A model directory holds

  model.json   {"format", "model": the `ModelDims` fields, "segments":
               [[slot, layers], ...], "embed_slot", "tokenizer":
               "spm.model", "bos_id", "prefix_len", "seq_len", "source":
               where it came from}
  params/      the parameters: an orbax PyTree checkpoint of plain nested
               dicts of float32 arrays, the tree of
               `transformer.PathTransformer` (`store.items`: the item in
               params/item/, then its commit marker)
  spm.model    the SentencePiece tokenizer it was trained with

`load_model(DIR)` reads it back; without this loader,
`orbax.checkpoint.PyTreeCheckpointer().restore(DIR/params/item)` gives the
parameter tree, and `PathTransformer(ModelDims(**model), segments)` the
model. With stacked layers (`model.scan_layers`, the default) a path's
layer slots are gathered into one stack, the dense model's layout; with
unstacked layers they keep their slots.
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
from dipaco_jax.store import items

FORMAT = "dipaco_jax.export.v1"
MODEL_FILE = "model.json"
PARAMS_DIR = "params"
TOKENIZER_FILE = "spm.model"


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
  items.save_tree(directory / PARAMS_DIR, jax.device_get(params),
                  {"format": FORMAT})
  atomic.write_bytes(directory / TOKENIZER_FILE, tokenizer.model_proto)
  atomic.write_json(directory / MODEL_FILE, {
      "format": FORMAT, "model": dims,
      "segments": [list(s) for s in model.segments],
      "embed_slot": model.embed_slot, "tokenizer": TOKENIZER_FILE,
      "bos_id": tokenizer.bos_id, **info})


def load_model(directory) -> ExportedModel:
  """A model directory written by `save_model`."""
  directory = epath.Path(directory)
  if not is_model_dir(directory):
    raise errors.UserError(f"{directory} has no {MODEL_FILE}: not a "
                           "directory written by python -m dipaco_jax.export.")
  info = json.loads((directory / MODEL_FILE).read_text())
  if info.get("format") != FORMAT:
    raise errors.UserError(f"{directory / MODEL_FILE}: format "
                           f"{info.get('format')!r}, this code reads {FORMAT}.")
  dims = dict(info["model"])
  if dims["attention"] == "auto":
    dims["attention"] = "cudnn" if jax.default_backend() == "gpu" else "xla"
  model = transformer.PathTransformer(
      layers.ModelDims(**dims), tuple((n, k) for n, k in info["segments"]),
      info["embed_slot"])
  like = nn.unbox(jax.eval_shape(model.init, jax.random.key(0),
                                 jnp.zeros((1, 8), jnp.int32))["params"])
  params, _ = items.load_tree(directory / PARAMS_DIR, like)
  tokenizer = tokenizer_lib.Tokenizer.load(directory / info["tokenizer"])
  return ExportedModel(model, params, tokenizer, info)
