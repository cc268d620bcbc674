r"""Command line: a trained model as a standalone dense model.

  python -m dipaco_jax.export --workdir=DIR --path=P --out=OUT
  python -m dipaco_jax.export --workdir=DIR --dense --out=OUT
  python -m dipaco_jax.export --workdir=DIR --all --out=OUT [--overwrite]

--path=P writes path P of the workdir's main DiPaCo run: the parameters
evaluation scores for it (its final modules, or its early-stopping
snapshot), gathered from the bank into one dense parameter tree.
--dense writes DiPaCo's dense baseline (or, for a one-path config, its
model). Either gives OUT/model.json (model dims, vocabulary, tokenizer
file), OUT/params/ (an orbax checkpoint of plain Flax parameters) and
OUT/spm.model (`inference/exported.py`), loadable without the bank, the
routers or the workdir: `inference.exported.load_model(OUT)`.

--all writes every path (OUT/path_000, ...), the dense baseline, the
model routing features come from and the routers (the document router and
the learned window router, if fit), so that `python -m dipaco_jax.generate
--export=OUT` routes as it does from the workdir (`inference/sources.py`).

OUT must be new or empty: an export is refused over anything, unless
--overwrite, which replaces an earlier export whole (never leaving an old
file beside a new one) and nothing else (`inference/command_export.py`).

Mistakes (a bad flag, a path the workdir does not have, an unfinished
workdir, an occupied OUT) are one line, `error: <message>`, exit status 2;
`--verbose` shows the traceback.
"""

from absl import app
from absl import flags
from absl import logging

from dipaco_jax import cli_errors
from dipaco_jax import errors
from dipaco_jax.inference import cli

_WORKDIR = flags.DEFINE_string(
    "workdir", None, "The workdir of a finished python -m dipaco_jax.main job.")
_OUT = flags.DEFINE_string(
    "out", None, "Directory to write (new or empty; --overwrite replaces an "
    "export there).")
_OVERWRITE = flags.DEFINE_bool(
    "overwrite", False, "Replace the export already in --out (only an "
    "export: any other file there is refused).")
_PATH = flags.DEFINE_integer("path", None, "Export this path (0 .. P - 1).")
_DENSE = flags.DEFINE_bool("dense", False, "Export the dense baseline.")
_ALL = flags.DEFINE_bool(
    "all", False, "Export every path, the dense baseline and the routers.")
_VERBOSE = flags.DEFINE_bool(
    "verbose", False, "On an error meant for the user, print the full "
    "traceback instead of one line.")
flags.mark_flags_as_required(["workdir", "out"])
flags.register_validator("out", cli_errors.check_workdir)


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:
    # Orbax warns on every save of a non-OCDBT item (store.items writes
    # those) that it skips merging OCDBT files: noise here.
    logging.set_verbosity(logging.ERROR)
  with cli_errors.user_errors(verbose=_VERBOSE.value, disk_flag="--out"):
    # Before the workdir is read: the choice itself needs no JAX.
    if (_PATH.value is not None) + _DENSE.value + _ALL.value != 1:
      raise errors.UserError("give one of --path=P, --dense or --all.")
    # Imported here: a mistake on the command line costs no JAX start-up.
    from dipaco_jax.inference import command_export  # pylint: disable=g-import-not-at-top
    for line in command_export.export(_WORKDIR.value, _OUT.value,
                                      _PATH.value, _DENSE.value, _ALL.value,
                                      _OVERWRITE.value):
      print(f"[export] {line}", flush=True)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
