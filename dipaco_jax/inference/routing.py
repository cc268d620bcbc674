"""Routing text at generation time exactly as evaluation routes documents.

A prompt is a document (`[BOS] + tokens`): its path is the document
router's choice on the routing feature of its first `prefix_len` tokens
(`features.prefix_features`, as `stages/evaluation.py` routes validation
documents). A prompt shorter than that is routed on all of its tokens:
the feature is the mean over the tokens there are.

Re-routing every `every` tokens picks the path of target chunk c >= 1
(positions prefix_len + c * every onwards) from the text before it, with
the evaluation's own code: the text so far becomes a document, laid out
in windows (`eval/routed.py` `make_layout`, `chunk_features`) and routed by
the learned window router (`evaluation.window_router_routes`' inputs) or
by the document router on the previous chunk or on everything so far (the
evaluation's other two re-routing rows).
"""

import dataclasses

import numpy as np

from dipaco_jax.data import token_store
from dipaco_jax.eval import routed
from dipaco_jax.model import transformer
from dipaco_jax.routing import features as features_lib
from dipaco_jax.routing import router as router_lib

# --reroute_with: which router picks chunk c >= 1, on what.
LEARNED = "learned"
REROUTERS = (LEARNED, "previous_chunk", "cumulative")
_DOCUMENTS_PER_CALL = 8


@dataclasses.dataclass(frozen=True)
class Routing:
  """The routers of a trained model and what their features come from."""
  document_router: router_lib.Router
  window_router: router_lib.Router | None
  feature_kind: str  # base_hidden | token_embedding (config.routing.features)
  feature_model: transformer.PathTransformer
  feature_params: dict
  prefix_len: int
  seq_len: int  # evaluation windows: hidden states never see across them
  every: int  # the chunk length the window router was fit on (0: none)
  batch_size: int  # feature batches (config.train.eval_batch_size)

  @property
  def num_paths(self) -> int:
    return self.document_router.num_paths

  def route_prompts(self, prompts: list[np.ndarray]) -> np.ndarray:
    """[N] path of each prompt (token ids, BOS first) from its first
    `prefix_len` tokens, or all of them when it has fewer."""
    feats_NxD = features_lib.prefix_features(
        self.feature_model, self.feature_params, as_documents(prompts),
        self.prefix_len, self.feature_kind, self.batch_size)
    return self.document_router.top_k(feats_NxD, 1)[:, 0]

  def route_chunks(self, texts: list[np.ndarray], chunk_N, doc_paths_N,
                   every: int, how: str = LEARNED,
                   force: bool = False) -> np.ndarray:
    """[N] path of chunk `chunk_N[n]` >= 1 of each text, read from its
    tokens before the chunk (`texts[n]` must hold at least those).

    how: 'learned' (the window router; one whose cross-validation said to
    keep each document's path keeps it, as evaluation does, unless
    `force`), 'previous_chunk' or 'cumulative' (the document router on
    that feature).
    """
    chunk_N = np.asarray(chunk_N)
    doc_paths_N = np.asarray(doc_paths_N)
    if how == LEARNED and self.window_router.keep_document_path and (
        not force):
      return doc_paths_N
    # Padded with copies of the first text to a multiple of
    # _DOCUMENTS_PER_CALL: the feature sums are compiled for a number of
    # documents, and re-routes come one row at a time.
    n = len(texts)
    pad = -n % _DOCUMENTS_PER_CALL
    texts = list(texts) + [texts[0]] * pad
    chunk_N = np.concatenate([chunk_N, np.repeat(chunk_N[:1], pad)])
    doc_paths_N = np.concatenate([doc_paths_N, np.repeat(doc_paths_N[:1],
                                                         pad)])
    return self._route_chunks(texts, chunk_N, doc_paths_N, every, how)[:n]

  def _route_chunks(self, texts, chunk_N, doc_paths_N, every, how):
    ends = self.prefix_len + chunk_N * every
    # One placeholder token after each text's end: then the input at
    # end - 1 sits in a window whatever the lengths (`eval_windows` covers
    # inputs with a target), and a causal model's features of the tokens
    # before it do not depend on it.
    docs = as_documents([np.append(t[:e], 0) for t, e in zip(texts, ends)])
    layout = routed.make_layout(docs, self.seq_len, self.prefix_len)
    chunks = routed.chunk_features(layout, self.prefix_len, every,
                                   self.group_sums(layout))
    rows = np.arange(len(texts))
    if how == LEARNED:
      feats_NxCxD = routed.window_router_features(chunks, doc_paths_N,
                                                  self.num_paths)
      return self.window_router.top_k(feats_NxCxD[rows, chunk_N - 1], 1)[:, 0]
    if how not in REROUTERS:
      raise ValueError(f"Unknown re-router {how!r}: one of {REROUTERS}.")
    feats_NxCxD = chunks.features(how)
    return self.document_router.top_k(feats_NxCxD[rows, chunk_N - 1], 1)[:, 0]

  def group_sums(self, layout):
    """`feature_source.group_sums_fn` for this feature model."""
    def group_sums(group_MxL, num_groups):
      return features_lib.group_feature_sums(
          self.feature_model, self.feature_params, layout.windows["inputs"],
          group_MxL, num_groups, self.feature_kind, self.batch_size)
    return group_sums


def as_documents(texts: list[np.ndarray]) -> token_store.TokenDocs:
  """Token texts (BOS first) as the documents evaluation reads."""
  offsets = np.concatenate([[0], np.cumsum([len(t) for t in texts])])
  return token_store.TokenDocs(np.concatenate(texts).astype(np.int32),
                               offsets)
