"""Routers fit on how well the trained paths score the held-out router
documents: the discriminative document router and the learned re-router."""

import numpy as np

from dipaco_jax.eval import routed
from dipaco_jax.routing import router as router_lib
from dipaco_jax.routing import window_cv
from dipaco_jax.stages import evaluation
from dipaco_jax.stages import experiment as experiment_lib
from dipaco_jax.stages import feature_source as feature_source_lib


def discriminative(config, data, trained: experiment_lib.TrainedPaths,
                   router, feats, router_ids):
  """Score router documents under every path, fit the linear router."""
  exp = trained.experiment
  docs = data.docs["train"].subset(router_ids)
  layout = routed.make_layout(docs, config.data.seq_len,
                              config.data.prefix_len)
  nll_NxP = np.zeros((len(docs), exp.topology.num_paths))

  def on_path(p, nll_MxL):
    nll_NxP[:, p] = evaluation.per_doc_nll(layout, nll_MxL)

  evaluation.score_paths(trained, layout, config, on_path)
  doc_M = layout.windows["doc_index"]
  scored = layout.windows["weights"].sum(1)
  keep = np.bincount(doc_M, weights=scored, minlength=len(docs)) > 0
  disc, info = router_lib.fit_discriminative(
      config.seed, feats["router"][keep], nll_NxP[keep],
      exp.topology.level_sizes)
  before = router.top_k(feats["router"][keep], 1)[:, 0]
  info["agreement_with_generative"] = float(np.mean(
      before == disc.top_k(feats["router"][keep], 1)[:, 0]))
  print(f"[router] discriminative: fit on {int(keep.sum())} router docs, "
        f"train accuracy {info['train_accuracy']:.2f}", flush=True)
  return disc, info


def fit_window_router(config, data, trained: experiment_lib.TrainedPaths,
                      doc_router, router_feats, router_ids,
                      source: feature_source_lib.FeatureSource):
  """The learned re-router: the paper's test-time router is a transformer
  trained on "the best path over the next window"; ours is the same target
  with a linear router (`routed.window_router_features`: the base feature of
  everything read so far and of the previous chunk), fit on the held-out
  router documents, never on validation. It re-routes only if that beats
  each document's prefix path under cross-validation on those documents
  (`window_cv`); otherwise it keeps each document's path."""
  exp = trained.experiment
  every, num_paths = config.eval.reroute_every, exp.topology.num_paths
  docs = data.docs["train"].subset(router_ids)
  layout = routed.make_layout(docs, config.data.seq_len,
                              config.data.prefix_len)
  chunks = routed.chunk_features(
      layout, config.data.prefix_len, every,
      feature_source_lib.group_sums_fn(config, layout, source))
  doc_paths = doc_router.top_k(router_feats, 1)[:, 0]
  nll_NxCxP = np.zeros((len(docs), chunks.num_chunks, num_paths))

  def on_path(p, nll_MxL):
    nll_NxCxP[:, :, p] = routed.chunk_nll(layout, chunks, nll_MxL)

  evaluation.score_paths(trained, layout, config, on_path)
  if config.eval.dump_reroute_data:
    evaluation.dump_reroute_data(exp, "router", chunks, doc_paths, nll_NxCxP,
                                 layout)
  inputs, nll_XxP, tokens_X, prefix_paths, doc_X = (
      routed.window_router_examples(
          chunks, doc_paths, nll_NxCxP,
          routed.chunk_nll(layout, chunks, layout.windows["weights"])))
  window_router, info = window_cv.fit_window_router(
      config.seed, inputs, nll_XxP, tokens_X, prefix_paths, doc_X,
      exp.topology.level_sizes, config.eval.window_router_objective)
  labels = nll_XxP.argmin(1)
  info.update({"router_documents": len(docs), "chunks": len(labels),
               "every": every,
               "prefix_path_accuracy": float(np.mean(prefix_paths == labels))})
  print(f"[router] window router: fit on {info['chunks']:,} chunks of "
        f"{every} tokens from {len(docs):,} router docs; best path found "
        f"{info['train_accuracy']:.2f} (prefix path "
        f"{info['prefix_path_accuracy']:.2f})", flush=True)
  print(_decision_line(info), flush=True)
  return window_router, info


def _decision_line(info) -> str:
  cv = info["cv_nll_per_token_reroute"]
  learned = "n/a" if cv is None else f"{cv:.4f}"
  return (f"[router] window router: {info['decision']} (held-out NLL per "
          f"token over {info['cv_folds']}-fold cross-validation on router "
          f"documents: re-routed {learned}, each document's path "
          f"{info['cv_nll_per_token_document_path']:.4f}; gain "
          f"{info['cv_gain_standard_errors'] or 0.0:.1f} standard errors, "
          f"re-routes above {window_cv.MARGIN_STANDARD_ERRORS:g})")
