"""Low-rank compression of one leaf (PowerSGD), with an adaptive rank and,
optionally, integer factors (the end of this file).

A leaf of ndim >= 2 is viewed as the matrix M [m, n] closest to square, and
approximated by one power iteration from the previous round's right factor
(the warm start, so that the iterations accumulate over rounds):

  P = orth(M Q),   Q' = M^T P,   M ~ P Q'^T          (P orthonormal [m, r])

Since P is orthonormal, P Q'^T has the singular values of Q': they come from
the small [r, r] Gram matrix Q'^T Q'. Rotating both factors by its
eigenvectors leaves P Q'^T as it is and sorts the columns by singular value,
so the best rank-k part is the first k columns. The columns past the chosen
rank are zeroed, not cut, to keep shapes static inside jit; the wire payload
cuts them (compress.py's `trim`).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

# float32 matmuls even on GPUs, whose default would round to TF32.
_HIGHEST = jax.lax.Precision.HIGHEST
# Every leaf's first warm start: fixed, so that workers agree and a rerun
# compresses the same way.
_INIT_SEED = 0
# orthonormalize: a column keeping less than this share of its norm after
# removing the earlier columns' directions is a combination of them.
_DEPENDENT_RTOL = 1e-4


def matrix_shape(shape) -> tuple[int, int] | None:
  """The [m, n] view of a leaf: the split of its dims closest to square,
  the first such split on a tie. None for a leaf of ndim < 2 (sent as it
  is: a vector has no low rank to exploit)."""
  shape = tuple(shape)
  if len(shape) < 2:
    return None
  def imbalance(i):
    m, n = math.prod(shape[:i]), math.prod(shape[i:])
    return abs(math.log(max(m, 1) / max(n, 1)))
  i = min(range(1, len(shape)), key=imbalance)
  return math.prod(shape[:i]), math.prod(shape[i:])


def num_columns(m: int, n: int, rank_max: int) -> int:
  """The factors' static width: rank_max, but no more than the matrix has."""
  return max(1, min(rank_max, m, n))


def init_q(n: int, r: int) -> np.ndarray:
  """The first warm start [n, r]: a fixed-seed orthonormal matrix."""
  g_NxR = np.random.default_rng(_INIT_SEED).standard_normal((n, r))
  return np.linalg.qr(g_NxR)[0].astype(np.float32)


def orthonormalize(a_MxR):
  """Orthonormal columns spanning a's, column by column: classical
  Gram-Schmidt applied twice ("CGS2", as stable as Householder for these
  few columns), as PowerSGD orthogonalizes. A column that is a
  combination of the earlier ones (a zero contribution, or any column of
  a rank-deficient M Q) comes out exactly zero, which power_step handles.

  "A combination" up to rounding: what two passes leave of such a column
  is float32 rounding noise, a few eps of the column's own norm. Scaled to
  unit norm it would be a direction set by the CPU's summation order (it
  differed between machines), and its tiny singular value would still mix
  into the eigenvectors of the Gram matrix. A column that keeps less than
  `_DEPENDENT_RTOL` of its norm is taken as dependent: the energy so
  dropped is at most 1e-8 of the column's, far below any rank the
  adaptive rule keeps.

  Not jnp.linalg.qr: the CPU's LAPACK QR of a batch of these matrices
  (one per worker, under vmap) splits its batch over the intra-op thread
  pool and waits for it from inside that pool; two of them at once on a
  2-core machine deadlock the whole program (jaxlib 0.10.2). These are
  plain matmuls on every backend.
  """
  r = a_MxR.shape[1]
  def add_column(j, q_MxR):
    earlier_1xR = (jnp.arange(r) < j)[None, :]
    basis_MxR = jnp.where(earlier_1xR, q_MxR, 0.0)
    a_M = jax.lax.dynamic_index_in_dim(a_MxR, j, axis=1, keepdims=False)
    v_M = a_M
    for _ in range(2):  # the second pass removes what rounding left
      v_M = v_M - jnp.matmul(
          basis_MxR, jnp.matmul(basis_MxR.T, v_M, precision=_HIGHEST),
          precision=_HIGHEST)
    norm = jnp.linalg.norm(v_M)
    independent = norm > _DEPENDENT_RTOL * jnp.linalg.norm(a_M)
    v_M = jnp.where(independent, v_M / jnp.where(independent, norm, 1.0), 0.0)
    return jax.lax.dynamic_update_index_in_dim(q_MxR, v_M, j, axis=1)
  return jax.lax.fori_loop(0, r, add_column, jnp.zeros_like(a_MxR))


@jax.custom_batching.custom_vmap
def eigh_one_at_a_time(gram_RxR):
  """jnp.linalg.eigh of one symmetric matrix that, on CPU, stays one call
  per matrix under vmap (the workers' axis): each is a LAPACK call of
  batch 1, in sequence (`lax.map`). Other backends batch it as usual
  (cuSOLVER's batched kernel has no such problem, and a sequence of small
  GPU calls would be slow).

  Why: jaxlib 0.10's CPU LAPACK kernels split a batch over XLA's intra-op
  thread pool and wait for the pieces from inside that pool (jaxlib 0.11.1
  compiled this path out of its open-source builds). Several batched eigh
  calls at once (one per leaf) then deadlock a 2-core machine, as batched
  QR did: measured here with 6 batched eighs of
  8 x 100 x 100 and of 8 x 200 x 200; the same through `lax.map` finished.
  The matrices are [R, R] with R = rank_max: a sequence costs little
  (one outer step's encode on a 2-core CPU: 5% faster at R = 64, 13-15%
  slower at R = 100-128 than the batched call).
  """
  sigma2_R, v_RxR = jnp.linalg.eigh(gram_RxR)
  return sigma2_R, v_RxR


@eigh_one_at_a_time.def_vmap
def _eigh_vmap(axis_size, in_batched, gram_BxRxR):
  del axis_size, in_batched  # One argument: vmap batches it to come here.
  # The body calls the custom_vmap function again, so an outer vmap
  # (vmap of vmap) comes back here instead of batching the LAPACK call.
  return jax.lax.platform_dependent(
      gram_BxRxR,
      cpu=lambda g: jax.lax.map(eigh_one_at_a_time, g),
      default=lambda g: tuple(jnp.linalg.eigh(g))), (True, True)


def adaptive_rank(sigma2_R, rank_min: int, energy: float):
  """The smallest rank whose (descending) squared singular values keep a
  share `energy` of their sum, within [rank_min, R]: int32, traced.
  energy >= 1 means R, whatever rounding says about the tail."""
  r_max = sigma2_R.shape[0]
  if energy >= 1.0:
    return jnp.int32(r_max)
  cum_R = jnp.cumsum(sigma2_R)
  # The ranks that keep too little; a zero matrix has none, so rank 1.
  short = (cum_R < energy * cum_R[-1]).sum()
  return jnp.clip(short + 1, min(rank_min, r_max), r_max).astype(jnp.int32)


def power_step(m_MxN, q_NxR, rank_min: int, energy: float):
  """One warm-started power iteration with an adaptive rank.

  Returns (p_MxR, q_NxR, rank, warm_NxR): the factors with the columns past
  `rank` zeroed, so that decode(p, q) = p q^T is the rank-`rank`
  approximation; and the next warm start, all R columns.
  """
  p_MxR = orthonormalize(jnp.matmul(m_MxN, q_NxR, precision=_HIGHEST))
  q_new_NxR = jnp.matmul(m_MxN.T, p_MxR, precision=_HIGHEST)
  gram_RxR = jnp.matmul(q_new_NxR.T, q_new_NxR, precision=_HIGHEST)
  sigma2_R, v_RxR = eigh_one_at_a_time(gram_RxR)  # ascending
  sigma2_R, v_RxR = jnp.maximum(sigma2_R[::-1], 0.0), v_RxR[:, ::-1]
  p_MxR = jnp.matmul(p_MxR, v_RxR, precision=_HIGHEST)
  q_new_NxR = jnp.matmul(q_new_NxR, v_RxR, precision=_HIGHEST)
  rank = adaptive_rank(sigma2_R, rank_min, energy)
  keep_1xR = (jnp.arange(sigma2_R.shape[0]) < rank)[None, :]
  # A column that came out exactly zero (a zero contribution) would stay
  # zero in every later round; it keeps its previous direction instead.
  alive_1xR = (jnp.square(q_new_NxR).sum(0) > 0)[None, :]
  warm_NxR = jnp.where(alive_1xR, q_new_NxR, q_NxR)
  return (jnp.where(keep_1xR, p_MxR, 0.0), jnp.where(keep_1xR, q_new_NxR, 0.0),
          rank, warm_NxR)


def expand(p_MxR, q_NxR):
  """The approximation P Q^T [m, n]."""
  return jnp.matmul(p_MxR, q_NxR.T, precision=_HIGHEST)


# The codec of one leaf. Payload: factors p [m, R], q [n, R] (columns past
# `rank` zero) and the rank, int32; state: the warm start q [n, R]. A leaf of
# ndim < 2 passes as float32 (payload {"x"}, state {}).


def init_state(shape, rank_max: int) -> dict:
  mn = matrix_shape(shape)
  if mn is None:
    return {}
  return {"q": jnp.asarray(init_q(mn[1], num_columns(*mn, rank_max)))}


def encode(x, state, rank_min: int, energy: float) -> tuple[dict, dict]:
  x = jnp.asarray(x, jnp.float32)
  mn = matrix_shape(x.shape)
  if mn is None:
    return {"x": x}, state
  p, q, rank, warm = power_step(x.reshape(mn), state["q"], rank_min, energy)
  return {"p": p, "q": q, "rank": rank}, {"q": warm}


def decode(payload, shape):
  if "x" in payload:
    return payload["x"].reshape(shape)
  return expand(payload["p"], payload["q"]).reshape(shape)


def payload_bytes(payload, shape):
  """(m + n) r float32 values for the rank r used, + 4 bytes for r."""
  mn = matrix_shape(shape)
  if mn is None:
    return jnp.float32(4 * math.prod(shape))
  return (mn[0] + mn[1]) * payload["rank"].astype(jnp.float32) * 4 + 4


def trim(payload) -> dict:
  """Eager: the factors cut to the rank used (numpy)."""
  trimmed = {k: np.asarray(v) for k, v in payload.items()}
  if "rank" in trimmed:
    r = int(trimmed["rank"])
    trimmed["p"], trimmed["q"] = trimmed["p"][:, :r], trimmed["q"][:, :r]
    trimmed["rank"] = np.int32(r)
  return trimmed


def untrim(trimmed, shape, rank_max: int) -> dict:
  """trim's inverse: the zeroed columns back, the very payload trimmed."""
  payload = dict(trimmed)
  if "rank" in payload:
    width = num_columns(*matrix_shape(shape), rank_max)
    for key in ("p", "q"):
      f = np.asarray(trimmed[key])
      payload[key] = np.pad(f, ((0, 0), (0, width - f.shape[1])))
  return payload


# With integer factors (compress.py's factor_bits: DiLoCoX's "low rank +
# int4"), each factor column [m] goes through the int8/int4 block codec
# (`int_codec`, compress_block.py) on its own, so that no block straddles
# two columns and the wire can cut the columns past the rank: payload
# {f}_code [R, m] int8 and {f}_scale [R, ceil(m / block)] float32 for f in
# p, q, and the rank. Columns past the rank are zero, so are their codes.
# The codec's rounding of the factors is part of what the error feedback
# keeps.


def quantize_factors(payload, int_codec) -> dict:
  """A float32-factor payload (`encode`'s) with each factor coded."""
  if "x" in payload:
    return payload
  out = {"rank": payload["rank"]}
  for key in ("p", "q"):
    coded = jax.vmap(lambda col: int_codec.encode(col, {})[0])(payload[key].T)
    out[f"{key}_code"], out[f"{key}_scale"] = coded["code"], coded["scale"]
  return out


def dequantize_factors(payload, int_codec) -> dict:
  """The float32 factors p [m, R], q [n, R] of a quantized payload."""
  if "x" in payload:
    return payload
  out = {"rank": payload["rank"]}
  for key in ("p", "q"):
    length = payload[f"{key}_code"].shape[1]
    columns_RxM = jax.vmap(lambda code, scale: int_codec.decode(
        {"code": code, "scale": scale}, (length,)))(
            payload[f"{key}_code"], payload[f"{key}_scale"])
    out[key] = columns_RxM.T
  return out


def quantized_payload_bytes(payload, shape, int_codec):
  """Per factor, r columns of codes (int_codec.bits each, the r columns
  packed together) and their scales; + 4 bytes for r."""
  mn = matrix_shape(shape)
  if mn is None:
    return jnp.float32(4 * math.prod(shape))
  r = payload["rank"].astype(jnp.float32)
  block = int_codec.spec.block_size
  total = jnp.float32(4)
  for length in mn:
    total += (jnp.ceil(r * length * int_codec.bits / 8)
              + 4 * r * -(-length // block))
  return total


def trim_quantized(payload, int_codec) -> dict:
  """Eager: the first `rank` columns of each factor, codes packed by the
  int codec's own `trim` (4-bit codes two a byte)."""
  if "x" in payload:
    return {"x": np.asarray(payload["x"])}
  r = int(payload["rank"])
  trimmed = {"rank": np.int32(r)}
  for key in ("p", "q"):
    wire = int_codec.trim({
        "code": np.asarray(payload[f"{key}_code"])[:r].reshape(-1),
        "scale": np.asarray(payload[f"{key}_scale"])[:r]})
    trimmed[f"{key}_code"], trimmed[f"{key}_scale"] = (wire["code"],
                                                       wire["scale"])
  return trimmed


def untrim_quantized(trimmed, shape, rank_max: int, int_codec) -> dict:
  """trim_quantized's inverse: the static-shape payload, zero columns back."""
  if "x" in trimmed:
    return dict(trimmed)
  mn = matrix_shape(shape)
  width = num_columns(*mn, rank_max)
  r = int(trimmed["rank"])
  payload = {"rank": np.int32(r)}
  for key, length in zip(("p", "q"), mn):
    scale = np.asarray(trimmed[f"{key}_scale"])
    code = int_codec.untrim({"code": trimmed[f"{key}_code"], "scale": scale},
                            (r * length,))["code"]
    pad = ((0, width - r), (0, 0))
    payload[f"{key}_code"] = np.pad(np.asarray(code).reshape(r, length), pad)
    payload[f"{key}_scale"] = np.pad(scale.reshape(r, -1), pad)
  return payload
