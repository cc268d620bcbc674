"""What `python -m dipaco_jax.generate` does, without its flags (so that
tests and scripts can call it): load every path and the routers, check the
options against them, route, generate and print each completion with the
path that produced each span (`generation.py`, `routing.py`)."""

import dataclasses

import numpy as np

from dipaco_jax import errors
from dipaco_jax.inference import generation
from dipaco_jax.inference import sources


@dataclasses.dataclass(frozen=True)
class Options:
  """The command's flags (`dipaco_jax/generate.py` documents them)."""
  workdir: str | None
  export: str | None
  texts: list
  max_new_tokens: int = 64
  temperature: float = 0.0
  top_p: float = 1.0
  seed: int = 0
  path: int | None = None
  reroute_every: int = 0
  reroute_with: str = "learned"
  force_reroute: bool = False


def check_flags(routed, path, every: int, how: str) -> None:
  """The flags against what the model has; one line each."""
  num_paths = len(routed.path_params)
  if path is not None and not 0 <= path < num_paths:
    raise errors.UserError(f"--path={path}: the model has {num_paths} paths, "
                           f"0 to {num_paths - 1}.")
  if path is not None and every:
    raise errors.UserError(f"--reroute_every={every} with --path={path}: a "
                           "pinned path is never re-routed; drop one.")
  if every and routed.routing is None:
    raise errors.UserError(
        f"--reroute_every={every}: {routed.source} is one model, without "
        "routers; export every path (python -m dipaco_jax.export --all).")
  if not every or how != "learned":
    return
  if routed.routing.window_router is None:
    raise errors.UserError(
        "--reroute_with=learned: this model has no learned window router "
        "(config.eval.learned_reroute was off); use --reroute_with="
        "previous_chunk or cumulative.")
  if every != routed.routing.every:
    raise errors.UserError(
        f"--reroute_every={every}: the learned window router was fit on "
        f"chunks of {routed.routing.every} tokens; use "
        f"--reroute_every={routed.routing.every}, or --reroute_with="
        "previous_chunk or cumulative (any length).")


def routing_line(routed, every, how, force) -> str:
  r = routed.routing
  if r is None:
    return f"{routed.path_names[0]} from {routed.source}; no routing"
  line = (f"{len(routed.path_params)} paths from {routed.source}; routed "
          f"on the first {r.prefix_len} tokens ({r.feature_kind} features, "
          f"{r.document_router.kind} document router)")
  if not every:
    return line + "; no re-routing"
  if how != "learned":
    return line + (f"; re-routed every {every} tokens by the document "
                   f"router on the {how.replace('_', ' ')} feature")
  line += f"; re-routed every {every} tokens by the learned window router"
  if r.window_router.keep_document_path and not force:
    line += (" (which keeps each prompt's path: cross-validation on the "
             "router documents found no gain; --force_reroute overrides)")
  elif r.window_router.keep_document_path:
    line += (" (forced: cross-validation on the router documents found no "
             "gain, and evaluation keeps each document's path)")
  return line


def report(routed, tokenizer, completions, prefix_len, seq_len,
           pinned) -> None:
  """Prints each completion: how its prompt was routed, then each span of
  the completion under the path that produced it (repr, so whitespace
  shows), then the whole text."""
  for i, c in enumerate(completions):
    n = len(c.prompt)
    how = (f"the document router read its first {prefix_len}"
           if n >= prefix_len else
           f"the document router read all {n} (fewer than {prefix_len}: "
           "routed on what there is)")
    if pinned or routed.routing is None:
      how = "pinned by --path" if pinned else "no routing"
    print(f"=== prompt {i + 1}/{len(completions)}: {n} tokens with BOS; "
          f"{how} -> {routed.path_names[c.document_path]}")
    print(repr(tokenizer.decode(c.prompt[1:])))
    for path, first, end in c.spans():
      tokens = c.tokens[first - n:end - n]
      print(f"--- {routed.path_names[path]}: tokens {first}-{end - 1}")
      print(repr(tokenizer.decode(tokens)))
    print("--- prompt + completion:")
    print(tokenizer.decode(c.prompt[1:]) + tokenizer.decode(c.tokens))
    if n + len(c.tokens) > seq_len:
      print(f"(note: the text reaches {n + len(c.tokens)} tokens, past "
            f"data.seq_len={seq_len}: the model never trained on positions "
            "past that, and evaluation never gives it more context)")
  print(flush=True)


def run(o: Options) -> list:
  """Generates a completion of each of `o.texts` and prints them; returns
  the `generation.Completion`s."""
  routed = (sources.from_workdir(o.workdir) if o.workdir
            else sources.from_export(o.export))
  every, how = o.reroute_every, o.reroute_with
  check_flags(routed, o.path, every, how)
  tok, r = routed.tokenizer, routed.routing
  prompts = [np.concatenate([[tok.bos_id], tok.encode(t)]).astype(np.int32)
             for t in o.texts]
  print(f"[generate] {routing_line(routed, every, how, o.force_reroute)}",
        flush=True)
  if o.path is not None or r is None:
    doc_paths = np.full(len(prompts), o.path or 0)
  else:
    doc_paths = r.route_prompts(prompts)
  rerouting = None
  if every:
    rerouting = generation.Rerouting(
        every, r.prefix_len, lambda texts, chunks, paths: r.route_chunks(
            texts, chunks, paths, every, how, o.force_reroute))
  # Documents are packed BOS-first: a BOS starts the next document.
  stop_ids = tuple(i for i in (tok.bos_id, tok.eos_id) if i >= 0)
  completions = generation.generate(
      routed.model, routed.path_params, prompts, doc_paths,
      generation.Sampling(o.max_new_tokens, o.temperature, o.top_p, o.seed,
                          stop_ids), rerouting)
  report(routed, tok, completions, routed.prefix_len, routed.seq_len,
         o.path is not None)
  return completions
