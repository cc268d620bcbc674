"""Scoring trained models on validation tokens: one model, every DiPaCo
path, and the routed, re-routed and oracle perplexities of the paths next
to the dense baseline's, all on the same tokens."""

import numpy as np

from dipaco_jax.eval import routed
from dipaco_jax.eval import sharded
from dipaco_jax.model import bank as bank_lib
from dipaco_jax.parallel import multihost
from dipaco_jax.stages import experiment as experiment_lib
from dipaco_jax.stages import feature_source as feature_source_lib
from dipaco_jax.store import atomic

DENSE_BASELINE_ROW = "dense baseline (one path's size)"


def score(layout, model, params, config) -> dict:
  """Loss and perplexity of one model's `params` on `layout`'s tokens."""
  nll = routed.token_nll(model, params, layout, config.train.eval_batch_size)
  return routed.summary(nll.sum(), layout.windows["weights"].sum())


def _path_params_for_eval(exp, bank, stopper, path):
  params = bank_lib.bank_path(bank, exp.topology, path)
  if stopper is not None and str(path) in stopper.best:
    return stopper.best_params(path, params)
  return params


def score_paths(trained: experiment_lib.TrainedPaths, layout, config,
                on_path):
  """Scores `layout` under every path, `eval.path_group` paths at a time
  sharded over this process's devices (`eval/sharded.py`), so memory stays
  at one group's [windows, L] NLLs: calls `on_path(p, nll_MxL)` in path
  order."""
  exp = trained.experiment
  bank = exp.host_bank(trained.result.state)
  sharded.score_paths(
      exp.model, lambda p: _path_params_for_eval(exp, bank, trained.stopper, p),
      exp.topology.num_paths, layout, config.train.eval_batch_size, on_path,
      config.eval.path_group)


def per_doc_nll(layout, nll_MxL):
  """Summed NLL per document of `layout`, from its windows' token NLLs."""
  return np.bincount(layout.windows["doc_index"], weights=nll_MxL.sum(1),
                     minlength=layout.num_docs)


def dump_reroute_data(exp, split, chunks, doc_paths, nll_NxCxP, layout):
  """`eval.dump_reroute_data`: the chunk features and per-path chunk NLLs of
  a split, to study re-routers offline (bench/window_router_study.py)."""
  path = exp.run_dir.parent.parent / "router" / f"reroute_data_{split}.npz"
  if not multihost.is_writer():
    return
  atomic.write_npz(
      path, sums_NxGxD=chunks.sums_NxGxD, counts_NxG=chunks.counts_NxG,
      prefix_len=chunks.prefix_len, every=chunks.every,
      num_chunks=chunks.num_chunks, doc_paths_N=doc_paths,
      nll_NxCxP=nll_NxCxP, scored_NxC=routed.chunk_nll(
          layout, chunks, layout.windows["weights"]))
  print(f"[router] wrote {path}", flush=True)


def window_router_label(every: int, window_router) -> str:
  """The table row of the learned window router, saying whether it
  re-routed or kept each document's path (`routing/window_cv.py`)."""
  if window_router.keep_document_path:
    # Why is in results.json (router.window_router: the CV numbers).
    return (f"dipaco re-routed every {every} tokens (learned window router; "
            "kept each document's path)")
  return f"dipaco re-routed every {every} tokens (learned window router)"


def window_router_routes(layout, chunks, doc_paths_N, window_router,
                         num_paths: int) -> np.ndarray:
  """The path of every token under the learned window router. One that
  keeps each document's path routes exactly as routing once does: the same
  array, so the same sums to the last bit."""
  if window_router.keep_document_path:
    return routed.route_once(layout, doc_paths_N)
  return routed.route_by_features(
      layout, chunks, doc_paths_N, lambda f: window_router.top_k(f, 1)[:, 0],
      routed.window_router_features(chunks, doc_paths_N, num_paths))


def evaluate_dipaco(config, data, trained: experiment_lib.TrainedPaths,
                    router, val_feats,
                    source: feature_source_lib.FeatureSource, window_router,
                    dense: experiment_lib.TrainedRun) -> dict:
  """Routed perplexity (once per document, re-routed, oracle) and the dense
  baseline, all on exactly the same tokens."""
  exp, stopper = trained.experiment, trained.stopper
  val = data.docs["validation"]
  layout = routed.make_layout(val, config.data.seq_len,
                              config.data.prefix_len)
  count = layout.windows["weights"].sum()
  doc_M = layout.windows["doc_index"]
  doc_paths = router.top_k(val_feats, 1)[:, 0]
  # Which path scores each token, per routing scheme; then one pass over
  # the paths adds up the tokens each scheme gave to that path.
  routes = {"dipaco routed once per document":
            routed.route_once(layout, doc_paths)}
  every = config.eval.reroute_every
  if every > 0:
    chunks = routed.chunk_features(
        layout, config.data.prefix_len, every,
        feature_source_lib.group_sums_fn(config, layout, source))
    route = lambda f: router.top_k(f, 1)[:, 0]
    for context, label in (("previous_chunk", "the previous chunk"),
                           ("cumulative", "all tokens so far")):
      routes[f"dipaco re-routed every {every} tokens ({label})"] = (
          routed.route_by_features(layout, chunks, doc_paths, route,
                                   chunks.features(context)))
    if window_router is not None:
      routes[window_router_label(every, window_router)] = (
          window_router_routes(layout, chunks, doc_paths, window_router,
                               exp.topology.num_paths))
  totals = routed.RoutedTotals(routes)
  num_paths = exp.topology.num_paths
  per_doc_PxN = np.zeros((num_paths, len(val)))
  own_nll_P = np.zeros(num_paths)
  # Per chunk: the best path's NLL (an oracle bound for re-routing), and
  # every path's when the data is dumped for study.
  best_chunk_NxC = np.full((len(val), chunks.num_chunks), np.inf) if (
      every > 0) else None
  dump = every > 0 and config.eval.dump_reroute_data
  chunk_NxCxP = np.zeros(best_chunk_NxC.shape + (num_paths,)) if dump else None

  def on_path(p, nll_MxL):
    totals.add(p, nll_MxL)
    per_doc_PxN[p] = per_doc_nll(layout, nll_MxL)
    own_nll_P[p] = per_doc_PxN[p][doc_paths == p].sum()
    if every > 0:
      nll_NxC = routed.chunk_nll(layout, chunks, nll_MxL)
      np.minimum(best_chunk_NxC, nll_NxC, out=best_chunk_NxC)
      if dump:
        chunk_NxCxP[:, :, p] = nll_NxC

  score_paths(trained, layout, config, on_path)
  if dump:
    dump_reroute_data(exp, "validation", chunks, doc_paths, chunk_NxCxP,
                      layout)
  out = {"models": {name: routed.summary(nll, count)
                    for name, nll in totals.nll.items()}}
  out["models"]["dipaco best path per document (oracle)"] = routed.summary(
      per_doc_PxN.min(0).sum(), count)
  if every > 0:
    out["models"][f"dipaco best path per {every}-token chunk (oracle)"] = (
        routed.summary(best_chunk_NxC.sum(), count))
  dense_nll = routed.token_nll(dense.experiment.model, dense.path_params(),
                               layout, config.train.eval_batch_size)
  out["models"][DENSE_BASELINE_ROW] = routed.summary(
      dense_nll.sum(), count)
  tokens_N = np.bincount(doc_M, weights=layout.windows["weights"].sum(1),
                         minlength=len(val))
  dense_N = per_doc_nll(layout, dense_nll)
  out["paths"] = []
  for p in range(exp.topology.num_paths):
    mine = doc_paths == p
    out["paths"].append({
        "path": p, "level_ids": list(exp.topology.path_level_ids(p)),
        "train_documents": exp.manifest["shards"][p]["num_documents"],
        "train_tokens": exp.manifest["shards"][p]["num_tokens"],
        "validation_documents": int(mine.sum()),
        "validation_tokens": int(tokens_N[mine].sum()),
        "validation": routed.summary(own_nll_P[p], tokens_N[mine].sum()),
        "validation_dense": routed.summary(dense_N[mine].sum(),
                                           tokens_N[mine].sum()),
        "early_stopping_step": (stopper.best.get(str(p), {}).get("step")
                                if stopper else None)})
  return out
