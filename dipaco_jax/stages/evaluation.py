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


def score(docs, model, params, config) -> dict:
  """Loss and perplexity of one model's `params` on `docs`' scored tokens,
  a block of documents at a time (`routed.document_blocks`)."""
  nll, count = 0.0, 0.0
  for first, stop in routed.document_blocks(docs, config.eval.block_tokens):
    layout = routed.make_layout(docs.subset(np.arange(first, stop)),
                                config.data.seq_len, config.data.prefix_len)
    nll += routed.token_nll(model, params, layout,
                            config.train.eval_batch_size).sum()
    count += layout.windows["weights"].sum()
  return routed.summary(nll, count)


def _path_params_for_eval(exp, bank, stopper, path):
  params = bank_lib.bank_path(bank, exp.topology, path)
  if stopper is not None and str(path) in stopper.best:
    return stopper.best_params(path, params)
  return params


def score_paths(trained: experiment_lib.TrainedPaths, layout, config,
                on_path, bank=None):
  """Scores `layout` under every path, `eval.path_group` paths at a time
  sharded over this process's devices (`eval/sharded.py`), so memory stays
  at one group's [windows, L] NLLs: calls `on_path(p, nll_MxL)` in path
  order. `bank`: the trained bank on the host, if already there."""
  exp = trained.experiment
  if bank is None:
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
  baseline, all on exactly the same tokens; the validation split is scored
  a block of documents at a time (`routed.document_blocks`), so memory
  stays at one block's windows whatever its size."""
  exp, stopper = trained.experiment, trained.stopper
  val = data.docs["validation"]
  num_paths = exp.topology.num_paths
  doc_paths = router.top_k(val_feats, 1)[:, 0]
  every = config.eval.reroute_every
  dump = every > 0 and config.eval.dump_reroute_data
  bank = exp.host_bank(trained.result.state)
  dense_params = dense.path_params()
  totals = {}
  count = 0.0
  per_doc_PxN = np.zeros((num_paths, len(val)))
  dense_N = np.zeros(len(val))
  tokens_N = np.zeros(len(val))
  best_chunks = 0.0
  # The study dump needs every document's chunks in one array: one block.
  blocks = routed.document_blocks(
      val, 0 if dump else config.eval.block_tokens)
  for first, stop in blocks:
    docs = np.arange(first, stop)
    layout = routed.make_layout(val.subset(docs), config.data.seq_len,
                                config.data.prefix_len)
    block = _score_block(config, exp, trained, layout, doc_paths[docs],
                         source, window_router, router, bank, dump)
    for name, nll in block["routes"].items():
      totals[name] = totals.get(name, 0.0) + nll
    per_doc_PxN[:, docs] = block["per_doc_PxN"]
    best_chunks += block["best_chunks"]
    count += layout.windows["weights"].sum()
    tokens_N[docs] = np.bincount(
        layout.windows["doc_index"], weights=layout.windows["weights"].sum(1),
        minlength=len(docs))
    dense_N[docs] = per_doc_nll(layout, routed.token_nll(
        dense.experiment.model, dense_params, layout,
        config.train.eval_batch_size))
  own_nll_P = np.array([per_doc_PxN[p][doc_paths == p].sum()
                        for p in range(num_paths)])
  out = {"models": {name: routed.summary(nll, count)
                    for name, nll in totals.items()}}
  out["models"]["dipaco best path per document (oracle)"] = routed.summary(
      per_doc_PxN.min(0).sum(), count)
  if every > 0:
    out["models"][f"dipaco best path per {every}-token chunk (oracle)"] = (
        routed.summary(best_chunks, count))
  out["models"][DENSE_BASELINE_ROW] = routed.summary(dense_N.sum(), count)
  out["paths"] = []
  for p in range(num_paths):
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


def _score_block(config, exp, trained, layout, doc_paths, source,
                 window_router, router, bank, dump) -> dict:
  """One block of validation documents under every path: each routing
  scheme's summed NLL, every path's NLL per document, and the chunk
  oracle's sum."""
  # Which path scores each token, per routing scheme; then one pass over
  # the paths adds up the tokens each scheme gave to that path.
  routes = {"dipaco routed once per document":
            routed.route_once(layout, doc_paths)}
  every = config.eval.reroute_every
  num_paths = exp.topology.num_paths
  chunks = None
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
                               num_paths))
  totals = routed.RoutedTotals(routes)
  per_doc_PxN = np.zeros((num_paths, layout.num_docs))
  # Per chunk: the best path's NLL (an oracle bound for re-routing), and
  # every path's when the data is dumped for study.
  best_chunk_NxC = np.full((layout.num_docs, chunks.num_chunks), np.inf) if (
      every > 0) else None
  chunk_NxCxP = np.zeros(best_chunk_NxC.shape + (num_paths,)) if dump else None

  def on_path(p, nll_MxL):
    totals.add(p, nll_MxL)
    per_doc_PxN[p] = per_doc_nll(layout, nll_MxL)
    if every > 0:
      nll_NxC = routed.chunk_nll(layout, chunks, nll_MxL)
      np.minimum(best_chunk_NxC, nll_NxC, out=best_chunk_NxC)
      if dump:
        chunk_NxCxP[:, :, p] = nll_NxC

  score_paths(trained, layout, config, on_path, bank)
  if dump:
    dump_reroute_data(exp, "validation", chunks, doc_paths, chunk_NxCxP,
                      layout)
  return {"routes": totals.nll, "per_doc_PxN": per_doc_PxN,
          "best_chunks": best_chunk_NxC.sum() if every > 0 else 0.0}
