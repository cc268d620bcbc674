"""A fitted router: features -> path scores, saved with the run.

Generative routers (k-means, product k-means) score a path by its negative
squared distance; the discriminative router by its logit. Either way
`top_k` returns the best paths first, so sharding and evaluation do not care
which kind they hold. A learned window router may also keep each
document's path (`keep_document_path`, decided in `window_cv`).
"""

import dataclasses
import hashlib
import math

from etils import epath
import jax
import numpy as np

from dipaco_jax.routing import discriminative
from dipaco_jax.routing import kmeans
from dipaco_jax.store import atomic


# Documents scored at a time by `Router.scores` and `Router.top_k`.
SCORE_BLOCK = 65_536


@dataclasses.dataclass
class Router:
  kind: str  # kmeans | product_kmeans | linear
  level_sizes: tuple[int, ...]
  centroids: list  # per level (generative)
  linear: discriminative.LinearRouter | None = None
  # Window routers only: cross-validation on the router documents found the
  # fitted router no better than the prefix's path, so every chunk keeps
  # its document's path (evaluation then routes once per document).
  keep_document_path: bool = False

  @property
  def num_paths(self) -> int:
    return math.prod(self.level_sizes)

  def _block_scores(self, features_NxD) -> np.ndarray:
    if self.kind == "linear":
      return np.asarray(discriminative.router_logits(self.linear,
                                                     features_NxD))
    return -np.asarray(kmeans.path_distances(features_NxD, self.centroids))

  def scores(self, features_NxD) -> np.ndarray:
    """[N, P] float32, higher is better; `SCORE_BLOCK` documents at a time,
    so the temporaries stay at one block's whatever N."""
    n = len(features_NxD)
    if n <= SCORE_BLOCK:
      return self._block_scores(features_NxD)
    out = np.empty((n, self.num_paths), np.float32)
    for first in range(0, n, SCORE_BLOCK):
      out[first:first + SCORE_BLOCK] = self._block_scores(
          features_NxD[first:first + SCORE_BLOCK])
    return out

  def top_k(self, features_NxD, k: int) -> np.ndarray:
    """[N, k] best paths first (k capped at the number of paths)."""
    k = min(k, self.num_paths)
    n = len(features_NxD)
    if n <= SCORE_BLOCK:
      scores = self._block_scores(features_NxD)
      return np.asarray(kmeans.top_k_paths(-scores, k))
    out = np.empty((n, k), np.int32)
    for first in range(0, n, SCORE_BLOCK):
      out[first:first + SCORE_BLOCK] = self.top_k(
          features_NxD[first:first + SCORE_BLOCK], k)
    return out

  def arrays(self) -> dict:
    out = {f"centroids_{i}": np.asarray(c)
           for i, c in enumerate(self.centroids)}
    if self.linear is not None:
      out.update({f"linear_{k}": np.asarray(v)
                  for k, v in self.linear._asdict().items()})
    return out

  def sha256(self) -> str:
    h = hashlib.sha256(self.kind.encode() + str(self.level_sizes).encode())
    if self.keep_document_path:  # Only then, so older hashes still hold.
      h.update(b"keep_document_path")
    for k, v in sorted(self.arrays().items()):
      h.update(k.encode() + np.ascontiguousarray(v).tobytes())
    return h.hexdigest()[:16]

  def save(self, path) -> None:
    atomic.write_npz(path, kind=self.kind,
                     level_sizes=np.array(self.level_sizes),
                     keep_document_path=np.array(self.keep_document_path),
                     **self.arrays())

  @classmethod
  def load(cls, path) -> "Router":
    with epath.Path(path).open("rb") as f:
      z = dict(np.load(f))
    centroids = [z[f"centroids_{i}"] for i in range(
        sum(k.startswith("centroids_") for k in z))]
    linear = None
    if "linear_w_DxP" in z:
      linear = discriminative.LinearRouter(
          *(z[f"linear_{f}"] for f in discriminative.LinearRouter._fields))
    # Routers saved before the flag existed re-route: keep_document_path
    # defaults to False.
    return cls(str(z["kind"]), tuple(int(x) for x in z["level_sizes"]),
               centroids, linear,
               bool(z.get("keep_document_path", np.array(False))))


def fit_generative(seed: int, features_NxD, level_sizes, method: str,
                   num_iters: int, max_points: int = 0) -> Router:
  """k-means with prod(K) clusters, or product k-means (one per level), on
  at most `max_points` of the rows (`routing.kmeans_max_points`; drawn by
  the seed, in order; 0 = all), so the fit's memory does not grow with the
  corpus."""
  key = jax.random.key(seed)
  features = np.asarray(features_NxD, np.float32)
  features = features[fit_sample(seed, len(features), max_points)]
  if method == "product_kmeans" and len(level_sizes) > 1:
    centroids = kmeans.product_kmeans(key, features, level_sizes, num_iters)
    return Router("product_kmeans", tuple(level_sizes),
                  [np.asarray(c) for c in centroids])
  k = math.prod(level_sizes)
  result = kmeans.kmeans(key, features, k, num_iters)
  return Router("kmeans", tuple(level_sizes),
                [np.asarray(result.centroids_KxD)])


def fit_size(num_rows: int, max_points: int) -> int:
  """How many rows k-means fits on (in the routers' cache keys: a cap above
  the corpus leaves the fit, and its cached router, as they were)."""
  return num_rows if max_points <= 0 else min(max_points, num_rows)


def fit_sample(seed: int, num_rows: int, max_points: int) -> np.ndarray:
  """The rows k-means fits on: all of them, or `max_points` drawn without
  replacement by the seed, sorted."""
  if fit_size(num_rows, max_points) == num_rows:
    return np.arange(num_rows)
  return np.sort(np.random.default_rng([seed, num_rows]).choice(
      num_rows, max_points, replace=False))


def fit_discriminative(seed: int, features_NxD, nll_NxP, level_sizes,
                       num_steps: int = 500,
                       l2: float = 1e-4) -> tuple[Router, dict]:
  """The paper's discriminative phase: label each router document with its
  best path, fit a linear router, and bias it toward the labels' shares."""
  num_paths = math.prod(level_sizes)
  labels = np.asarray(discriminative.best_path_labels(nll_NxP))
  linear = discriminative.fit_linear_router(
      jax.random.key(seed), np.asarray(features_NxD, np.float32), labels,
      num_paths, l2=l2, num_steps=num_steps)
  shares = np.bincount(labels, minlength=num_paths) / len(labels)
  logits = discriminative.router_logits(linear, features_NxD)
  bias = discriminative.calibrate_bias(logits, shares)
  linear = linear._replace(b_P=linear.b_P + bias)
  router = Router("linear", tuple(level_sizes), [], linear)
  accuracy = float(np.mean(router.top_k(features_NxD, 1)[:, 0] == labels))
  return router, {"label_shares": shares.tolist(),
                  "train_accuracy": accuracy}


def fit_window_router(seed: int, features_XxD, nll_XxP, tokens_X, level_sizes,
                      objective: str, l2: float = 1e-4) -> tuple[Router, dict]:
  """The learned re-router, fit on chunks (one example each).

  objective 'best_path': the paper's target, each chunk labelled with its
  best path (`fit_discriminative`, shares calibrated to the labels');
  'expected_nll': the excess NLL of the chosen path over the best one, per
  token (`discriminative.fit_linear_router_expected_cost`).
  """
  nll_XxP = np.asarray(nll_XxP, np.float64)
  if objective == "best_path":
    router, info = fit_discriminative(seed, features_XxD, nll_XxP,
                                      level_sizes, l2=l2)
  elif objective == "expected_nll":
    cost_XxP = (nll_XxP - nll_XxP.min(1, keepdims=True)) / max(
        float(np.mean(tokens_X)), 1.0)
    linear = discriminative.fit_linear_router_expected_cost(
        jax.random.key(seed), np.asarray(features_XxD, np.float32), cost_XxP,
        l2=l2)
    router = Router("linear", tuple(level_sizes), [], linear)
    info = {"train_accuracy": float(np.mean(
        router.top_k(features_XxD, 1)[:, 0] == nll_XxP.argmin(1)))}
  else:
    raise ValueError(f"Unknown window router objective {objective!r}: use "
                     "best_path or expected_nll.")
  chosen = router.top_k(features_XxD, 1)[:, 0]
  excess = nll_XxP[np.arange(len(chosen)), chosen] - nll_XxP.min(1)
  info.update({"objective": objective, "train_excess_nll_per_token": float(
      excess.sum() / max(float(np.sum(tokens_X)), 1.0))})
  return router, info
