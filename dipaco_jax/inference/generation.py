"""Generating text from routed paths with a KV cache.

Every prompt starts on the path the document router picks for it. With
re-routing, before the first token of each chunk (positions prefix_len +
c * every, c >= 1) the re-router reads the text so far and may switch the
row to another path; the new path then reads the whole text so far into
the row's cache (a prefill), exactly as evaluation scores a chunk under
its path with the full window before it as context. Each row keeps one
cache, for its current path.

All prompts decode as one batch, right-padded: row b's text is tokens[b,
:length_b] and each row sits at its own position (`decoding`). A step
runs once per path that some row is on, each call updating only its rows.
A row stops at `max_new_tokens` or at a stop token (the CLI stops at BOS
and EOS: documents are packed BOS-first, so BOS means "a new document").
Random draws use one key per step for the whole batch, so a sampled
completion depends on the batch it is in (greedy ones do not).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from dipaco_jax.inference import decoding
from dipaco_jax.model import kv_cache


@dataclasses.dataclass(frozen=True)
class Sampling:
  max_new_tokens: int
  temperature: float = 0.0  # 0: greedy
  top_p: float = 1.0
  seed: int = 0
  stop_ids: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Rerouting:
  """When and how rows may switch path during generation."""
  every: int
  prefix_len: int
  # (texts, chunk_N, doc_paths_N) -> [N] paths (`routing.Routing.route_chunks`)
  route_fn: object

  def chunk_of(self, position):
    """The chunk of the token at `position` (0 up to the first boundary:
    the prompt's path)."""
    return np.maximum(np.asarray(position) - self.prefix_len, 0) // self.every

  def starts_chunk(self, position_N):
    """Whether the token at each position is the first of a chunk >= 1."""
    position_N = np.asarray(position_N)
    return (position_N >= self.prefix_len + self.every) & (
        (position_N - self.prefix_len) % self.every == 0)


@dataclasses.dataclass
class Completion:
  """One prompt's generation: its tokens and which path made which."""
  prompt: np.ndarray
  tokens: np.ndarray  # generated, stop token included
  paths: np.ndarray  # the path that produced each generated token
  document_path: int  # the document router's choice on the prompt

  def spans(self) -> list[tuple[int, int, int]]:
    """(path, first, end) runs of generated tokens, as positions in the
    whole text (the prompt's tokens are 0 .. len(prompt) - 1)."""
    out, n = [], len(self.prompt)
    for i, p in enumerate(self.paths):
      if out and out[-1][0] == p:
        out[-1] = (p, out[-1][1], n + i + 1)
      else:
        out.append((int(p), n + i, n + i + 1))
    return out


class _Batch:
  """The generation state of every row, on the host, and the caches.

  Host arrays go to the compiled functions as copies: on CPU a jitted call
  may read a numpy argument in place after it returns (asynchronous
  dispatch), and these arrays change at every step.
  """

  def __init__(self, model, path_params, prompts, doc_paths, max_new):
    self.model, self._host_params = model, path_params
    self._device_params = {}
    self.lengths_B = np.array([len(p) for p in prompts], np.int32)
    size = int(self.lengths_B.max()) + max_new
    self.tokens_BxS = np.zeros((len(prompts), size), np.int32)
    for b, p in enumerate(prompts):
      self.tokens_BxS[b, :len(p)] = p
    self.doc_paths_B = np.asarray(doc_paths, np.int32)
    self.paths_B = self.doc_paths_B.copy()
    self.caches = kv_cache.init(model.dims, model.segments, len(prompts),
                                size)
    self.logits_BxV = None

  def params(self, path: int):
    """A path's parameters on the device, moved there once."""
    if path not in self._device_params:
      self._device_params[path] = jax.device_put(self._host_params[path])
    return self._device_params[path]

  def texts(self, rows):
    return [self.tokens_BxS[b, :self.lengths_B[b]] for b in rows]

  def prefill(self, rows_B) -> None:
    """The rows' current paths read their whole text so far."""
    for p in np.unique(self.paths_B[rows_B]):
      update_B = rows_B & (self.paths_B == p)
      logits, self.caches = decoding.prefill(
          self.model, self.params(int(p)), self.caches,
          self.tokens_BxS.copy(), self.lengths_B.copy(), update_B)
      self._take(logits, update_B)

  def step(self, token_B, rows_B) -> None:
    """The rows read their new token (at position length_b)."""
    for p in np.unique(self.paths_B[rows_B]):
      update_B = rows_B & (self.paths_B == p)
      logits, self.caches = decoding.step(
          self.model, self.params(int(p)), self.caches, token_B,
          self.lengths_B.copy(), update_B)
      self._take(logits, update_B)

  def _take(self, logits_BxV, update_B) -> None:
    if self.logits_BxV is None:
      self.logits_BxV = logits_BxV
    self.logits_BxV = jnp.where(update_B[:, None], logits_BxV,
                                self.logits_BxV)

  def reroute(self, rerouting: Rerouting, rows_B):
    """Routes the chunk each of `rows_B` is at; returns the rows whose
    path changed (their caches are the old path's until a prefill)."""
    changed_B = np.zeros_like(rows_B)
    rows = np.flatnonzero(rows_B)
    if len(rows):
      new = np.asarray(rerouting.route_fn(
          self.texts(rows), rerouting.chunk_of(self.lengths_B[rows]),
          self.doc_paths_B[rows]), np.int32)
      changed_B[rows] = new != self.paths_B[rows]
      self.paths_B[rows] = new
    return changed_B


def generate(model, path_params: list, prompts: list[np.ndarray],
             doc_paths, sampling: Sampling,
             rerouting: Rerouting | None = None) -> list[Completion]:
  """Completes each prompt (token ids, BOS first) from `path_params[p]` of
  its path, starting on `doc_paths[b]`; see the module docstring."""
  batch = _Batch(model, path_params, prompts, doc_paths,
                 sampling.max_new_tokens)
  if rerouting is not None:
    # A prompt that reaches past the first chunk boundary: its next token
    # belongs to chunk c >= 1, whose path reads the text before chunk c.
    batch.reroute(rerouting, rerouting.chunk_of(batch.lengths_B) >= 1)
  live_B = np.ones(len(prompts), bool)
  batch.prefill(live_B)
  key = jax.random.key(sampling.seed)
  made = [([], []) for _ in prompts]
  stop = np.asarray(sampling.stop_ids, np.int32)
  for i in range(sampling.max_new_tokens):
    if rerouting is not None and i > 0:
      batch.prefill(batch.reroute(rerouting, live_B & rerouting.starts_chunk(
          batch.lengths_B)))
    key, draw = jax.random.split(key)
    token_B = np.asarray(decoding.sample(
        batch.logits_BxV, draw, jnp.float32(sampling.temperature),
        jnp.float32(sampling.top_p)))
    for b in np.flatnonzero(live_B):
      made[b][0].append(int(token_B[b]))
      made[b][1].append(int(batch.paths_B[b]))
      batch.tokens_BxS[b, batch.lengths_B[b]] = token_B[b]
    live_B &= ~np.isin(token_B, stop)
    if i == sampling.max_new_tokens - 1 or not live_B.any():
      break
    batch.step(token_B, live_B)
    batch.lengths_B += live_B
  return [Completion(np.asarray(p), np.array(t, np.int32),
                     np.array(s, np.int32), int(d))
          for p, (t, s), d in zip(prompts, made, batch.doc_paths_B)]
