r"""Command line: generate text with a trained DiPaCo model, routed.

  python -m dipaco_jax.generate --workdir=DIR --prompt='def parse('
  python -m dipaco_jax.generate --export=OUT --prompts=FILE \
      [--max_new_tokens=64] [--temperature=0.8 --top_p=0.95 --seed=0] \
      [--reroute_every=64 [--reroute_with=learned|previous_chunk|cumulative]]

--workdir reads a finished main job; --export an export of it (`python -m
dipaco_jax.export`): of every path (--all), routed as from the workdir,
or of one model (--path, --dense), which generates without routing. A
prompt is a document ([BOS] + its tokens). It goes to the path the
document router picks from its first 32 tokens (data.prefix_len), on the
routing feature evaluation uses (`inference/routing.py`); a prompt
shorter than that is routed on the tokens it has, and the output says so.
--path=P skips routing.

Decoding keeps a KV cache per prompt; every prompt of --prompts decodes in
one batch (right-padded, each row at its own position) with one compiled
step (`inference/generation.py`): greedy at --temperature=0 (the
default), else sampled, cut to --top_p. A completion ends at
--max_new_tokens or where the model starts a new document (BOS) or emits
EOS.

--reroute_every=64 re-routes before each chunk of 64 tokens after the
prefix, reading the text so far as evaluation does: with the learned
window router (which, like evaluation, keeps each prompt's path when
cross-validation on the router documents found no gain; --force_reroute
uses its choices anyway), or with the document router on the previous
chunk or on everything so far. When a prompt changes path, the new path
reads the whole text so far into its cache first. The output names the
path that produced each span.

--unescape reads \n, \t and \\ in prompts as a newline, a tab and a
backslash (code prompts on one line). Mistakes are one line, `error:
<message>`, exit status 2; `--verbose` shows the traceback.
"""

from absl import app
from absl import flags
from absl import logging

from dipaco_jax import cli_errors
from dipaco_jax import errors
from dipaco_jax.inference import cli

_REROUTERS = ("learned", "previous_chunk", "cumulative")

_WORKDIR = flags.DEFINE_string(
    "workdir", None, "The workdir of a finished python -m dipaco_jax.main "
    "job (or give --export).")
_EXPORT = flags.DEFINE_string(
    "export", None, "A directory written by python -m dipaco_jax.export "
    "(--all: every path, routed; else one model, unrouted).")
_PROMPT = flags.DEFINE_string("prompt", None, "The prompt.")
_PROMPTS = flags.DEFINE_string("prompts", None,
                               "A text file of prompts, one per line.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64,
                                "Tokens to generate per prompt, at most.",
                                lower_bound=1)
_TEMPERATURE = flags.DEFINE_float(
    "temperature", 0.0, "0: greedy; else sample at this temperature.",
    lower_bound=0.0)
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass (0, 1].")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the random draws.")
_PATH = flags.DEFINE_integer("path", None,
                             "Generate with this path; no routing.")
_REROUTE_EVERY = flags.DEFINE_integer(
    "reroute_every", 0, "Re-route before every chunk of this many tokens "
    "after the prefix; 0: route once per prompt.", lower_bound=0)
_REROUTE_WITH = flags.DEFINE_enum(
    "reroute_with", "learned", _REROUTERS, "learned: the learned window "
    "router; previous_chunk, cumulative: the document router on that "
    "feature.")
_FORCE_REROUTE = flags.DEFINE_bool(
    "force_reroute", False, "Use the learned window router's choices even "
    "where its cross-validation said to keep each document's path.")
_UNESCAPE = flags.DEFINE_bool("unescape", False,
                              r"Read \n, \t and \\ in prompts.")
_VERBOSE = flags.DEFINE_bool(
    "verbose", False, "On an error meant for the user, print the full "
    "traceback instead of one line.")


def read_prompts(prompt, prompts_file, unescape: bool) -> list[str]:
  if (prompt is None) == (prompts_file is None):
    raise errors.UserError("give one of --prompt=TEXT or --prompts=FILE.")
  if prompt is not None:
    texts = [prompt]
  else:
    try:
      with open(prompts_file, encoding="utf-8") as f:
        texts = [line.rstrip("\n") for line in f if line.strip()]
    except OSError as e:
      raise errors.UserError(f"--prompts={prompts_file}: cannot read it "
                             f"({e.strerror}).") from e
    if not texts:
      raise errors.UserError(f"--prompts={prompts_file} has no prompt; "
                             "write one per line.")
  if unescape:
    texts = [t.replace("\\\\", "\0").replace("\\n", "\n").replace(
        "\\t", "\t").replace("\0", "\\") for t in texts]
  return texts


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  with cli_errors.user_errors(verbose=_VERBOSE.value):
    texts = read_prompts(_PROMPT.value, _PROMPTS.value, _UNESCAPE.value)
    if (_WORKDIR.value is None) == (_EXPORT.value is None):
      raise errors.UserError("give one of --workdir=DIR or --export=DIR.")
    if not 0.0 < _TOP_P.value <= 1.0:
      raise errors.UserError(f"--top_p={_TOP_P.value}: give a mass in "
                             "(0, 1].")
    # Imported here: a mistake on the command line costs no JAX start-up.
    from dipaco_jax.inference import command_generate  # pylint: disable=g-import-not-at-top
    command_generate.run(command_generate.Options(
        workdir=_WORKDIR.value, export=_EXPORT.value, texts=texts,
        max_new_tokens=_MAX_NEW.value, temperature=_TEMPERATURE.value,
        top_p=_TOP_P.value, seed=_SEED.value, path=_PATH.value,
        reroute_every=_REROUTE_EVERY.value, reroute_with=_REROUTE_WITH.value,
        force_reroute=_FORCE_REROUTE.value))


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
