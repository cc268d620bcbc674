"""What every codec of `compress.py` is built on: the identity codec
(`Codec`, "none"), whose methods the others override, and the small
helpers they share (leaf size, flattening, the eager decode)."""

import dataclasses
import functools
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from dipaco_jax.diloco import compress_spec
from dipaco_jax.diloco import compress_topk


def size(shape) -> int:
  return math.prod(tuple(shape))


def flat(x):
  return jnp.asarray(x, jnp.float32).reshape(-1)


@dataclasses.dataclass(frozen=True)
class Codec:
  """The identity ("none"), and what every codec does.

  Frozen and stateless (a static jit argument): per-leaf state, lowrank's
  warm start, is passed in and out explicitly. `shape` is always one
  worker's leaf shape.
  """
  spec: compress_spec.CompressionSpec
  stateful: ClassVar[bool] = False

  def init_state(self, x) -> dict:
    del x
    return {}

  def encode(self, x, state) -> tuple[dict, dict]:
    return {"x": jnp.asarray(x, jnp.float32)}, state

  def decode(self, payload, shape) -> jax.Array:
    return payload["x"].reshape(shape)

  def payload_bytes(self, payload, shape) -> jax.Array:
    del payload
    return jnp.float32(4 * size(shape))

  def trim(self, payload) -> dict:
    """Eager: the payload as it goes on the wire (numpy)."""
    return {k: np.asarray(v) for k, v in payload.items()}

  def untrim(self, trimmed, shape) -> dict:
    """trim's inverse: the static-shape payload back from the wire's."""
    del shape
    return dict(trimmed)

  def decode_trimmed(self, trimmed, shape) -> np.ndarray:
    # Through `decode`, so that the receiver gets exactly what the sender
    # computed as sent (and its residual assumed).
    shape = tuple(shape)
    return np.asarray(_decode_jit(self, self.untrim(trimmed, shape), shape))


# Eager callers compile once per leaf shape, not op by op (several times
# faster on a new shape); inside a jit, a jit is inlined.
@functools.partial(jax.jit, static_argnums=(0, 2))
def _decode_jit(codec, payload, shape):
  return codec.decode(payload, shape)


def unpack_signed(packed, bits: int, n: int) -> np.ndarray:
  """Two's-complement codes of `bits` bits back from `pack_bits`."""
  u = compress_topk.unpack_bits(packed, bits, n).astype(np.int16)
  return np.where(u >= 2**(bits - 1), u - 2**bits, u).astype(np.int8)
