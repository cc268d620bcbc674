"""Does the learned window router beat keeping each document's path?

Re-routing must never make a model worse, so before the learned window
router is used it is compared, by K-fold cross-validation on the router
documents alone (never validation), with routing once: each fold's chunks
are routed by a window router fit on the other folds, and their summed NLL
is set against that of the document's prefix path. Folds are by document,
so no document's chunks are both fit and scored. Only chunks 1 and later
count: chunk 0 takes the prefix's path either way.

A gain must be clear, not a tie broken by noise: the router re-routes only
when the mean over router documents of each document's NLL gain is more
than `MARGIN_STANDARD_ERRORS` standard errors above 0 (a one-sided paired
test over documents). A tiny gain on a few dozen router documents (seen:
0.02% on 57 documents of a small text corpus) does not carry over to new
text.
"""

import dataclasses

import numpy as np

from dipaco_jax.routing import router as router_lib

NUM_FOLDS = 5
MARGIN_STANDARD_ERRORS = 2.0
REROUTE = "reroute"
KEEP_DOCUMENT_PATH = "keep_document_path"


def document_folds(doc_X, num_folds: int, seed: int = 0) -> np.ndarray:
  """The fold of every example: the documents shuffled, then dealt out in
  turn, so a document's chunks share a fold and min(num_folds, documents)
  folds get examples."""
  docs, doc_index_X = np.unique(np.asarray(doc_X), return_inverse=True)
  order = np.random.default_rng(seed).permutation(len(docs))
  return order[doc_index_X.reshape(-1)] % num_folds


def held_out_paths(fit_fn, inputs_XxD, doc_X,
                   num_folds: int = NUM_FOLDS) -> np.ndarray:
  """The path chosen for every example by a router fit without its fold.

  `fit_fn(train_X)` fits a router on the examples of boolean mask `train_X`.
  Needs examples of at least two documents.
  """
  fold_X = document_folds(doc_X, num_folds)
  if len(np.unique(fold_X)) < 2:
    raise ValueError("Cross-validation needs at least two documents.")
  chosen_X = np.zeros(len(fold_X), np.int64)
  for k in np.unique(fold_X):
    test_X = fold_X == k
    chosen_X[test_X] = fit_fn(~test_X).top_k(inputs_XxD[test_X], 1)[:, 0]
  return chosen_X


def clear_gain(gain_X, doc_X) -> float:
  """The mean per-document NLL gain over its standard error (+-inf for a
  gain or loss without spread, 0 for none): how clearly re-routing
  helps."""
  _, doc_index_X = np.unique(np.asarray(doc_X), return_inverse=True)
  gain_N = np.bincount(doc_index_X.reshape(-1),
                       weights=np.asarray(gain_X, np.float64))
  mean = float(gain_N.mean())
  if len(gain_N) < 2:
    return 0.0
  se = float(gain_N.std(ddof=1) / np.sqrt(len(gain_N)))
  if se == 0.0:
    return float(np.sign(mean)) * float("inf") if mean else 0.0
  return mean / se


def fit_window_router(seed: int, inputs_XxD, nll_XxP, tokens_X,
                      prefix_paths_X, doc_X, level_sizes, objective: str,
                      l2: float = 1e-4, num_folds: int = NUM_FOLDS):
  """`router.fit_window_router` on every example, kept only if it helps.

  Re-routes only when the cross-validated NLL under the window router's
  choices is lower than under each document's prefix path
  (`prefix_paths_X`) by more than `MARGIN_STANDARD_ERRORS` standard errors
  of the per-document gain (`clear_gain`); otherwise the returned router
  has `keep_document_path` set. With examples of fewer than two documents
  nothing can be cross-validated, and the document's path is kept.

  Returns:
    (router, info): info is `router.fit_window_router`'s plus cv_folds,
    cv_nll_per_token_reroute (None without cross-validation),
    cv_nll_per_token_document_path, cv_gain_standard_errors (the mean
    per-document gain over its standard error) and decision (REROUTE or
    KEEP_DOCUMENT_PATH).
  """
  inputs_XxD = np.asarray(inputs_XxD)
  nll_XxP = np.asarray(nll_XxP, np.float64)
  tokens_X = np.asarray(tokens_X)
  rows_X = np.arange(len(nll_XxP))
  tokens = max(float(np.sum(tokens_X)), 1.0)
  keep_nll = float(nll_XxP[rows_X, np.asarray(prefix_paths_X)].sum()) / tokens
  folds = min(num_folds, len(np.unique(np.asarray(doc_X))))
  reroute_nll, gain_se = None, None
  if folds >= 2:
    fit = lambda train_X: router_lib.fit_window_router(
        seed, inputs_XxD[train_X], nll_XxP[train_X], tokens_X[train_X],
        level_sizes, objective, l2)[0]
    chosen_X = held_out_paths(fit, inputs_XxD, doc_X, folds)
    reroute_nll = float(nll_XxP[rows_X, chosen_X].sum()) / tokens
    gain_se = clear_gain(
        nll_XxP[rows_X, np.asarray(prefix_paths_X)] - nll_XxP[rows_X,
                                                              chosen_X],
        doc_X)
  decision = (REROUTE if gain_se is not None and (
      gain_se > MARGIN_STANDARD_ERRORS) else KEEP_DOCUMENT_PATH)
  # Fit on every router document either way: its training numbers still
  # say what the router learned, even when its choices are not used.
  router, info = router_lib.fit_window_router(
      seed, inputs_XxD, nll_XxP, tokens_X, level_sizes, objective, l2)
  router = dataclasses.replace(
      router, keep_document_path=decision == KEEP_DOCUMENT_PATH)
  info.update({"cv_folds": folds if reroute_nll is not None else 0,
               "cv_nll_per_token_reroute": reroute_nll,
               "cv_nll_per_token_document_path": keep_nll,
               "cv_gain_standard_errors": gain_se,
               "decision": decision})
  return router, info
