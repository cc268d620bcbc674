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

  def scores(self, features_NxD) -> np.ndarray:
    """[N, P], higher is better."""
    if self.kind == "linear":
      return np.asarray(discriminative.router_logits(self.linear,
                                                     features_NxD))
    return -np.asarray(kmeans.path_distances(features_NxD, self.centroids))

  def top_k(self, features_NxD, k: int) -> np.ndarray:
    """[N, k] best paths first (k capped at the number of paths)."""
    scores = self.scores(features_NxD)
    return np.asarray(kmeans.top_k_paths(-scores, min(k, scores.shape[1])))

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
                   num_iters: int) -> Router:
  """k-means with prod(K) clusters, or product k-means (one per level)."""
  key = jax.random.key(seed)
  features = np.asarray(features_NxD, np.float32)
  if method == "product_kmeans" and len(level_sizes) > 1:
    centroids = kmeans.product_kmeans(key, features, level_sizes, num_iters)
    return Router("product_kmeans", tuple(level_sizes),
                  [np.asarray(c) for c in centroids])
  k = math.prod(level_sizes)
  result = kmeans.kmeans(key, features, k, num_iters)
  return Router("kmeans", tuple(level_sizes),
                [np.asarray(result.centroids_KxD)])


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
