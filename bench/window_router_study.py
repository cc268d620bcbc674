r"""Which learned window router? Cross-validated on the router documents.

  python bench/window_router_study.py WORKDIR [OUT.json]

WORKDIR is a DiPaCo run made with --config.eval.dump_reroute_data=True (it
holds router/reroute_data_{router,validation}.npz: chunk features and every
path's NLL on every chunk). Each variant (objective, router inputs, L2) is
scored by 5-fold cross-validation over the router documents -- excess NLL
per token of the chosen path over each chunk's best path, folds as in
`routing/window_cv.py` -- and the variant with the lowest is the pick. The
same cross-validation of keeping each document's path says what the
pipeline would decide for each variant. Validation perplexity is reported
for every variant too, but is not used to choose.
"""

import itertools
import json
import math
import sys

import numpy as np

from dipaco_jax.eval import routed
from dipaco_jax.routing import router as router_lib
from dipaco_jax.routing import window_cv

_FOLDS = window_cv.NUM_FOLDS
_FEATURES = {"everything so far + previous chunk + prefix path":
             dict(context="both", prefix_path=True),
             "everything so far + prefix path":
             dict(context="cumulative", prefix_path=True),
             "everything so far + previous chunk":
             dict(context="both", prefix_path=False)}


def load(workdir, split):
  with open(f"{workdir}/router/reroute_data_{split}.npz", "rb") as f:
    z = dict(np.load(f))
  chunks = routed.Chunks(int(z["prefix_len"]), int(z["every"]),
                         int(z["num_chunks"]), z["sums_NxGxD"],
                         z["counts_NxG"])
  return chunks, z["doc_paths_N"], z["nll_NxCxP"], z["scored_NxC"]


def fit(inputs, nll, tokens, num_paths, objective, l2):
  router, _ = router_lib.fit_window_router(0, inputs, nll, tokens,
                                           (num_paths,), objective, l2)
  return router


def excess(nll, chosen):
  return float((nll[np.arange(len(chosen)), chosen] - nll.min(1)).sum())


def main(workdir, out_path=None):
  router_data, val_data = load(workdir, "router"), load(workdir, "validation")
  num_paths = router_data[2].shape[-1]
  val_nll, val_scored, val_paths = val_data[2], val_data[3], val_data[1]
  count = val_scored.sum()
  once = val_nll[np.arange(len(val_nll)), :, val_paths].sum()
  chunk0 = val_nll[np.arange(len(val_nll)), 0, val_paths].sum()
  ppl = lambda total: math.exp(total / count)
  rows = []
  for (name, kw), objective, l2 in itertools.product(
      _FEATURES.items(), ("expected_nll", "best_path"), (1e-4, 1e-2)):
    inputs, nll, tokens, prefix, doc = routed.window_router_examples(
        *router_data[:2], router_data[2], router_data[3], **kw)
    chosen = window_cv.held_out_paths(
        lambda train: fit(inputs[train], nll[train], tokens[train],
                          num_paths, objective, l2), inputs, doc, _FOLDS)
    cv = excess(nll, chosen) / tokens.sum()
    keep = excess(nll, prefix) / tokens.sum()
    router = fit(inputs, nll, tokens, num_paths, objective, l2)
    v_inputs, v_nll, _, _, _ = routed.window_router_examples(
        *val_data[:2], val_nll, val_scored, **kw)
    chosen = router.top_k(v_inputs, 1)[:, 0]
    total = chunk0 + v_nll[np.arange(len(chosen)), chosen].sum()
    rows.append({"inputs": name, "objective": objective, "l2": l2,
                 "cv_excess_nll_per_token": cv,
                 "cv_excess_nll_per_token_document_path": keep,
                 "cv_decision": (window_cv.REROUTE if cv < keep else
                                 window_cv.KEEP_DOCUMENT_PATH),
                 "validation_perplexity": ppl(total)})
    print(f"{name:52s} {objective:12s} l2={l2:g}  cv excess {cv:.4f} "
          f"(document path {keep:.4f})  validation {ppl(total):.3f}",
          flush=True)
  pick = min(rows, key=lambda r: r["cv_excess_nll_per_token"])
  summary = {"workdir": str(workdir), "variants": rows, "pick": pick,
             "validation_routed_once": ppl(once),
             "validation_best_chunk_oracle": ppl(val_nll.min(-1).sum())}
  print(f"pick (lowest cv): {pick}\nrouted once {ppl(once):.3f}, "
        f"chunk oracle {summary['validation_best_chunk_oracle']:.3f}")
  if out_path:
    with open(out_path, "w") as f:
      json.dump(summary, f, indent=1)


if __name__ == "__main__":
  main(*sys.argv[1:])
