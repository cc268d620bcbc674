"""Generative routing: k-means, product k-means and path assignment.

DiPaCo's initial router is k-means on per-document features (the mean of the
base LM's last hidden state over the first 32 tokens): a document goes to the
path whose centroid is nearest. For a multi-level DiPaCo the paper uses
*product* k-means: the feature vector is split into L contiguous parts, part l
is clustered into K_l clusters independently, and the tuple of cluster ids is
the path (P = prod(K_l) paths, one expert per level).

Path indices are row-major over levels with level 0 most significant, i.e.
`path = np.ravel_multi_index(ids, ks)`, everywhere in the framework.

All numerics are float32 JAX, jitted with static cluster counts; the largest
intermediate is the N x K distance matrix (N x P in `path_distances`).
"""

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# Full float32 matmuls: on GPU/TPU the default precision (TF32 / bf16 passes)
# perturbs distances enough to flip near-tie assignments between runtimes.
_PRECISION = jax.lax.Precision.HIGHEST


class KMeansResult(NamedTuple):
  """Result of `kmeans`.

  Attributes:
    centroids_KxD: float32 cluster centres.
    assignments_N: int32 index of the nearest centroid of each point.
    inertia: float32 scalar, mean squared distance of a point to its centroid.
  """
  centroids_KxD: jax.Array
  assignments_N: jax.Array
  inertia: jax.Array


def squared_distances(x_NxD: jax.Array, c_KxD: jax.Array) -> jax.Array:
  """Squared Euclidean distances ||x||^2 - 2 x.c + ||c||^2, float32, >= 0."""
  x_NxD = jnp.asarray(x_NxD, jnp.float32)
  c_KxD = jnp.asarray(c_KxD, jnp.float32)
  x_sq_Nx1 = jnp.sum(x_NxD * x_NxD, axis=-1, keepdims=True)
  c_sq_K = jnp.sum(c_KxD * c_KxD, axis=-1)
  xc_NxK = jnp.matmul(x_NxD, c_KxD.T, precision=_PRECISION)
  # The expansion can go slightly negative through cancellation; clamp so
  # callers can rely on d >= 0 (e.g. for D^2 sampling weights).
  return jnp.maximum(x_sq_Nx1 - 2.0 * xc_NxK + c_sq_K[None, :], 0.0)


def _check_k(x_NxD, k: int) -> None:
  if x_NxD.ndim != 2:
    raise ValueError(f"x_NxD must be 2-D, got shape {x_NxD.shape}.")
  if not 1 <= k <= x_NxD.shape[0]:
    raise ValueError(
        f"k must be in [1, N={x_NxD.shape[0]}] (k-means++ needs k distinct "
        f"points), got k={k}.")


@functools.partial(jax.jit, static_argnames=("k",))
def _kmeans_plus_plus_init(key, x_NxD, k):
  """Jitted body of `kmeans_plus_plus_init` (x already float32)."""
  n = x_NxD.shape[0]
  first_key, rest_key = jax.random.split(key)
  first = jax.random.randint(first_key, (), 0, n)
  centroids_KxD = jnp.zeros((k, x_NxD.shape[1]), jnp.float32)
  centroids_KxD = centroids_KxD.at[0].set(x_NxD[first])
  chosen_N = jnp.zeros((n,), bool).at[first].set(True)
  # Distances to one centre are computed as sum((x - c)^2), not the expanded
  # form: it is exact, so duplicates of a chosen point get weight exactly 0.
  min_d_N = jnp.sum(jnp.square(x_NxD - x_NxD[first][None, :]), axis=-1)

  def body(i, carry):
    centroids_KxD, chosen_N, min_d_N = carry
    weight_N = jnp.where(chosen_N, 0.0, min_d_N)
    # If every unchosen point coincides with a centre (all weights 0), D^2
    # sampling is undefined; fall back to uniform over unchosen points so the
    # k centres are still k distinct indices.
    weight_N = jnp.where(
        jnp.sum(weight_N) > 0, weight_N, jnp.where(chosen_N, 0.0, 1.0))
    logits_N = jnp.where(weight_N > 0, jnp.log(weight_N), -jnp.inf)
    idx = jax.random.categorical(jax.random.fold_in(rest_key, i), logits_N)
    c_D = x_NxD[idx]
    centroids_KxD = centroids_KxD.at[i].set(c_D)
    chosen_N = chosen_N.at[idx].set(True)
    min_d_N = jnp.minimum(min_d_N, jnp.sum(jnp.square(x_NxD - c_D[None, :]),
                                           axis=-1))
    return centroids_KxD, chosen_N, min_d_N

  centroids_KxD, _, _ = jax.lax.fori_loop(
      1, k, body, (centroids_KxD, chosen_N, min_d_N))
  return centroids_KxD


def kmeans_plus_plus_init(key: jax.Array, x_NxD: jax.Array,
                          k: int) -> jax.Array:
  """k-means++ seeding: k distinct data points chosen by D^2 sampling.

  Args:
    key: PRNG key.
    x_NxD: data points.
    k: number of centres (static); 1 <= k <= N.

  Returns:
    float32 centroids_KxD, each a row of x_NxD (distinct row indices).
  """
  x_NxD = jnp.asarray(x_NxD, jnp.float32)
  _check_k(x_NxD, k)
  return _kmeans_plus_plus_init(key, x_NxD, k)


def _lloyd(x_NxD, centroids_KxD, num_iters):
  """Runs Lloyd iterations; returns the final KMeansResult."""
  k = centroids_KxD.shape[0]
  ones_N = jnp.ones((x_NxD.shape[0],), jnp.float32)

  def step(_, centroids_KxD):
    assign_N = jnp.argmin(squared_distances(x_NxD, centroids_KxD), axis=-1)
    # segment_sum instead of a one-hot matmul: O(N*D) memory, not O(N*K).
    sums_KxD = jax.ops.segment_sum(x_NxD, assign_N, num_segments=k)
    counts_K = jax.ops.segment_sum(ones_N, assign_N, num_segments=k)
    means_KxD = sums_KxD / jnp.maximum(counts_K, 1.0)[:, None]
    # An empty cluster keeps its previous centroid (it may win points back
    # later); re-seeding would make the loop's result depend on extra RNG.
    return jnp.where(counts_K[:, None] > 0, means_KxD, centroids_KxD)

  centroids_KxD = jax.lax.fori_loop(0, num_iters, step, centroids_KxD)
  d_NxK = squared_distances(x_NxD, centroids_KxD)
  assign_N = jnp.argmin(d_NxK, axis=-1).astype(jnp.int32)
  inertia = jnp.mean(jnp.min(d_NxK, axis=-1))
  return KMeansResult(centroids_KxD, assign_N, inertia)


@functools.partial(
    jax.jit, static_argnames=("k", "num_iters", "num_restarts"))
def _kmeans(key, x_NxD, k, num_iters, num_restarts):
  """Jitted body of `kmeans` (x already float32)."""
  # k-means is translation invariant; centring first keeps ||x||^2 small so
  # the expanded distance formula loses less to float32 cancellation.
  mean_D = jnp.mean(x_NxD, axis=0)
  x_NxD = x_NxD - mean_D[None, :]

  def one_run(run_key):
    init_KxD = _kmeans_plus_plus_init(run_key, x_NxD, k)
    return _lloyd(x_NxD, init_KxD, num_iters)

  keys = jax.random.split(key, num_restarts)
  best = one_run(keys[0])
  if num_restarts > 1:
    # A scan (not vmap) over restarts: memory stays at one run's N x K.
    def body(best, run_key):
      res = one_run(run_key)
      better = res.inertia < best.inertia
      return jax.tree.map(lambda a, b: jnp.where(better, a, b), res, best), None

    best, _ = jax.lax.scan(body, best, keys[1:])
  return best._replace(centroids_KxD=best.centroids_KxD + mean_D[None, :])


def kmeans(key: jax.Array, x_NxD: jax.Array, k: int, num_iters: int = 50,
           num_restarts: int = 1) -> KMeansResult:
  """Lloyd's k-means with k-means++ seeding.

  Args:
    key: PRNG key; the result is a deterministic function of it.
    x_NxD: data points (cast to float32).
    k: number of clusters (static), 1 <= k <= N.
    num_iters: Lloyd iterations (static); 0 returns the seeding.
    num_restarts: independent seedings; the lowest-inertia run is kept.

  Returns:
    KMeansResult. An empty cluster keeps its previous centroid.
  """
  x_NxD = jnp.asarray(x_NxD, jnp.float32)
  _check_k(x_NxD, k)
  if num_iters < 0 or num_restarts < 1:
    raise ValueError(f"Need num_iters >= 0 and num_restarts >= 1, got "
                     f"{num_iters} and {num_restarts}.")
  return _kmeans(key, x_NxD, k, num_iters, num_restarts)


def _part_bounds(d: int, num_parts: int) -> list[tuple[int, int]]:
  """[start, stop) of each part, with np.array_split semantics on d."""
  if not 1 <= num_parts <= d:
    raise ValueError(
        f"num_parts must be in [1, D={d}], got {num_parts}.")
  size, extra = divmod(d, num_parts)
  bounds, start = [], 0
  for part in range(num_parts):
    stop = start + size + (1 if part < extra else 0)
    bounds.append((start, stop))
    start = stop
  return bounds


def feature_parts(x_NxD: jax.Array, num_parts: int) -> list[jax.Array]:
  """Splits features into contiguous parts like np.array_split(x, n, axis=1).

  Training (product k-means) and routing (path_distances) both use this, so
  a feature dimension always lands in the same level's part.
  """
  return [x_NxD[:, a:b] for a, b in _part_bounds(x_NxD.shape[-1], num_parts)]


def product_kmeans(key: jax.Array, x_NxD: jax.Array, ks: Sequence[int],
                   num_iters: int = 50,
                   num_restarts: int = 1) -> list[jax.Array]:
  """Product k-means: k-means with ks[l] clusters on feature part l.

  Args:
    key: PRNG key; each level gets its own sub-key.
    x_NxD: features.
    ks: clusters per level; len(ks) parts of the feature dimension.
    num_iters: Lloyd iterations per level.
    num_restarts: restarts per level.

  Returns:
    A list of len(ks) float32 arrays; entry l is centroids_{K_l x D_l}.
  """
  parts = feature_parts(jnp.asarray(x_NxD, jnp.float32), len(ks))
  keys = jax.random.split(key, len(ks))
  return [
      kmeans(keys[l], part, int(k_l), num_iters, num_restarts).centroids_KxD
      for l, (part, k_l) in enumerate(zip(parts, ks))
  ]


@jax.jit
def _path_distances(parts, centroids_per_level):
  num_levels = len(parts)
  n = parts[0].shape[0]
  total = jnp.zeros((n,) + (1,) * num_levels, jnp.float32)
  for l, (part, c) in enumerate(zip(parts, centroids_per_level)):
    d_NxK = squared_distances(part, c)
    # Put level l on axis 1 + l so the final reshape is row-major over
    # levels with level 0 most significant (np.ravel_multi_index order).
    shape = [n] + [1] * num_levels
    shape[1 + l] = c.shape[0]
    total = total + d_NxK.reshape(shape)
  return total.reshape(n, -1)


def path_distances(x_NxD: jax.Array,
                   centroids_per_level: Sequence[jax.Array]) -> jax.Array:
  """Distance of every point to every path, d_NxP with P = prod(K_l).

  d[n, ravel_multi_index(ids, ks)] = sum_l ||part_l(x_n) - c_l[ids[l]]||^2,
  with the parts from `feature_parts`. With one level this is the plain
  k-means squared distance.
  """
  x_NxD = jnp.asarray(x_NxD, jnp.float32)
  centroids = [jnp.asarray(c, jnp.float32) for c in centroids_per_level]
  parts = feature_parts(x_NxD, len(centroids))
  for l, (part, c) in enumerate(zip(parts, centroids)):
    if c.ndim != 2 or c.shape[1] != part.shape[1]:
      raise ValueError(
          f"Level {l} centroids have shape {c.shape}, but feature part {l} "
          f"of D={x_NxD.shape[1]} split into {len(centroids)} parts has "
          f"{part.shape[1]} dims.")
  return _path_distances(parts, centroids)


@functools.partial(jax.jit, static_argnames=("k",))
def top_k_paths(d_NxP: jax.Array, k: int) -> jax.Array:
  """Indices of the k nearest paths per row, nearest first (int32).

  k=1 is the argmin (ties go to the lower index, as in argmin). Training
  documents use k=2 (overlapping shards), evaluation documents k=1.
  """
  _, paths_Nxk = jax.lax.top_k(-jnp.asarray(d_NxP, jnp.float32), k)
  return paths_Nxk.astype(jnp.int32)


def path_to_level_ids(paths: jax.Array, ks: Sequence[int]) -> jax.Array:
  """Inverse of `level_ids_to_path`: path indices [...] -> ids [..., L].

  Same as np.stack(np.unravel_index(paths, ks), -1), int32.
  """
  rest = jnp.asarray(paths, jnp.int32)
  ids = []
  # Peel levels off from the least significant (last) one.
  for k_l in reversed(ks):
    ids.append(rest % k_l)
    rest = rest // k_l
  return jnp.stack(ids[::-1], axis=-1)


def level_ids_to_path(ids_NxLv: jax.Array, ks: Sequence[int]) -> jax.Array:
  """Expert ids per level [..., Lv] -> path index [...], int32.

  Row-major with level 0 most significant: np.ravel_multi_index(ids.T, ks).
  """
  ids_NxLv = jnp.asarray(ids_NxLv, jnp.int32)
  if ids_NxLv.shape[-1] != len(ks):
    raise ValueError(
        f"ids have {ids_NxLv.shape[-1]} levels, ks has {len(ks)}.")
  strides_Lv = jnp.asarray(np.cumprod([1] + list(ks[:0:-1]))[::-1],
                           jnp.int32)
  strides = strides_Lv.reshape((1,) * (ids_NxLv.ndim - 1) + (len(ks),))
  return jnp.sum(ids_NxLv * strides, axis=-1)
