"""Training state and the two jitted steps of the SPMD runtime.

The state is a dict of two parts that are saved, sent and donated apart:
  step                 int32, inner steps taken by every worker
  inner                per worker (leading axis W):
    params             every worker's path: {slot: leaves [W, ...]}
    opt_state          every worker's AdamW state
  outer                per module (leading axis K_s in each slot):
    params             the module bank: {slot: leaves [K_s, ...]}
    opt_state          the outer optimizer's state, {slot: state}
With DiLoCoX's delay or compression set, both parts carry more (anchors,
residuals, the round in flight: `diloco/comm_step.py`).

`inner_step` is the per-worker AdamW step `jax.vmap`ped over workers (the
mesh axis `path`), and `inner_k_steps` a scan of K of them over [K, W, B,
L+1] batches (`train.steps_per_dispatch`); `outer_step(state, weights_W)`
is the chain of `diloco.outer`, with the worker weights as an argument (a
missing worker's weight 0 does not recompile). All are jitted with
explicit shardings and donate the state. The training loop reaches `outer_step` only through a
synchronizer (`train.sync`).
"""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from dipaco_jax import paths as paths_lib
from dipaco_jax.diloco import comm as comm_lib
from dipaco_jax.diloco import comm_step
from dipaco_jax.diloco import overlap_step
from dipaco_jax.diloco import inner as inner_lib
from dipaco_jax.diloco import outer as outer_lib
from dipaco_jax.model import bank as bank_lib
from dipaco_jax.model import chunked_loss
from dipaco_jax.model import cross_entropy
from dipaco_jax.model import layers
from dipaco_jax.model import pipelined
from dipaco_jax.model import transformer
from dipaco_jax.parallel import mesh as mesh_lib
from dipaco_jax.train import comm_shardings
from dipaco_jax.train import merged_slots


def next_token_loss(model, params, batch_BxLp1, loss_chunk: int = 0):
  """Mean next-token cross-entropy over a packed batch; with `loss_chunk`
  (`config.model.loss_chunk`) positions at a time, without the whole
  [B, L, V] logits (`chunked_loss`)."""
  inputs_BxL, targets_BxL = batch_BxLp1[:, :-1], batch_BxLp1[:, 1:]
  if loss_chunk:
    normed_BxLxD, weight = model.apply({"params": params}, inputs_BxL,
                                       method=model.head_inputs)
    return chunked_loss.mean_cross_entropy(normed_BxLxD, weight, targets_BxL,
                                           model.dims, loss_chunk)
  logits_BxLxV = model.apply({"params": params}, inputs_BxL)
  with jax.named_scope(chunked_loss.SCOPE):
    return cross_entropy.mean_cross_entropy(logits_BxLxV, targets_BxL)


@dataclasses.dataclass
class Runtime:
  """Everything static about a run: model, topology, mesh, optimizers."""
  config: object
  topology: paths_lib.Topology
  dims: layers.ModelDims
  mesh: jax.sharding.Mesh
  worker_weights_W: np.ndarray  # Shard sizes (tokens) of the workers.

  def __post_init__(self):
    c = self.config
    self.model = transformer.build_model(self.dims, self.topology)
    # The inner step's model: pipelined over `config.pipeline.stages`
    # (same parameters); evaluation and decoding use `model`.
    self.pipeline = pipelined.schedule_of(c)
    self.train_model = transformer.build_model(self.dims, self.topology,
                                               self.pipeline)
    self.bubble_fraction = pipelined.bubble_fraction(c)
    self.rules = mesh_lib.rules_of(c)
    self.slot_names = tuple(s.name for s in self.topology.slots)
    # The outer step's worker weights: shard sizes (paper Eq. 2-3) or 1.
    self.outer_weights_W = outer_lib.check_weights(
        self.worker_weights_W if c.diloco.weight_by_shard_size
        else np.ones(self.topology.num_workers))
    self.inner_tx = inner_lib.inner_optimizer(c.inner_opt, c.train.num_steps)
    self.outer_tx = outer_lib.outer_optimizer(c.diloco)
    # Each slot's delay and compressor (DiLoCoX); all "plain" is the chain
    # of `diloco.outer` exactly as without them.
    self.comms = comm_lib.comm_by_slot(c, self.topology.slots)
    self.comm_plain = comm_lib.all_plain(self.comms)
    # delay=overlap: the outer step in two halves, tau steps apart.
    self.overlap_steps = comm_lib.overlap_steps(c)
    self._build_shardings()
    self.init_state = self._jit_init()
    self._all_finite = jax.jit(lambda s: jnp.all(jnp.stack([
        jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(
            (s["inner"]["params"], s["outer"]["params"]))])))
    self.inner_step = self._jit_inner_step()
    self.inner_k_steps = self._jit_inner_k_steps()
    self.outer_step = self._jit_outer_step()
    self.flush_step = self._jit_flush_step()
    if self.overlap_steps:
      self.handover_step, self.apply_step = overlap_step.jit_steps(self)

  # --- Shapes and shardings ---------------------------------------------

  def _dummy_tokens(self):
    return jnp.zeros((1, 8), jnp.int32)

  def boxed_path_params(self):
    """Abstract path parameters with their logical-axis metadata."""
    return self._boxed_path_params

  @functools.cached_property
  def _boxed_path_params(self):
    # Traced once per Runtime: the shardings, the state's shapes, the
    # island programs and the stages all read these same shapes (a tiny
    # 2x2's Runtime starts in 0.21 s instead of 0.53 s on 2 CPU cores, and
    # each later read is free instead of another 0.17 s trace).
    return jax.eval_shape(self.model.init, jax.random.key(0),
                          self._dummy_tokens())["params"]

  @property
  def _workers_spec(self):
    """The mesh axes of the leading worker axis (`path` by default)."""
    return nn.logical_to_mesh_axes(("workers",), list(self.rules))

  def _build_shardings(self):
    boxed = self.boxed_path_params()
    to_sh = functools.partial(mesh_lib.to_shardings, mesh=self.mesh,
                              rules=self.rules)
    self.bank_shardings = to_sh(mesh_lib.logical_specs(boxed, "experts"))
    self.inner_param_shardings = to_sh(mesh_lib.logical_specs(boxed,
                                                              "workers"))
    worker_vector = jax.sharding.NamedSharding(self.mesh, self._workers_spec)
    replicated = mesh_lib.replicated(self.mesh)
    abstract = jax.eval_shape(self._state_from_path_params, nn.unbox(boxed))

    def opt_shardings(tx, opt_state, param_shardings, non_param):
      return optax.tree_map_params(
          tx, lambda _, sh: sh, opt_state, param_shardings,
          transform_non_params=lambda leaf: non_param(leaf))

    self.state_shardings = {
        "step": replicated,
        "inner": {
            "params": self.inner_param_shardings,
            "opt_state": opt_shardings(
                self.inner_tx, abstract["inner"]["opt_state"],
                self.inner_param_shardings,
                lambda leaf: worker_vector if leaf.ndim else replicated),
        },
        "outer": {
            "params": self.bank_shardings,
            "opt_state": {name: opt_shardings(
                self.outer_tx, abstract["outer"]["opt_state"][name],
                self.bank_shardings[name], lambda _: replicated)
                          for name in self.slot_names},
        },
    }
    comm_shardings.add(self.state_shardings, abstract,
                       self.inner_param_shardings, self.bank_shardings,
                       self.outer_tx, worker_vector, replicated)
    self.abstract_state = jax.tree.map(
        lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
        abstract, self.state_shardings)
    self.batch_sharding = mesh_lib.batch_sharding(self.mesh, self.rules)
    # K steps' batches [K, W, B, L+1]: every device holds its rows of all K.
    self.steps_batch_sharding = jax.sharding.NamedSharding(
        self.mesh, jax.sharding.PartitionSpec(None, *self.batch_sharding.spec))

  # --- Init -----------------------------------------------------------------

  def _init_fn(self, key):
    return self._state_from_path_params(nn.unbox(self.model.init(
        key, self._dummy_tokens())["params"]))

  def _state_from_path_params(self, path_params):
    # Every expert of a slot starts as the same copy (DiPaCo forks all paths
    # from one base model; DiLoCo replicas must start identical).
    bank = {s.name: jax.tree.map(
        lambda x, k=s.num_experts: jnp.broadcast_to(x, (k,) + x.shape),
        path_params[s.name]) for s in self.topology.slots}
    return self._state_from_bank(bank)

  def _state_from_bank(self, bank):
    inner = outer_lib.gather_workers(bank, self.topology.assignment_WxS,
                                     self.slot_names)
    inner_extra, outer_extra = comm_step.init_extra(self.comms, inner, bank,
                                                    self.outer_tx)
    return {
        "step": jnp.zeros((), jnp.int32),
        "inner": {"params": inner,
                  "opt_state": jax.vmap(self.inner_tx.init)(inner),
                  **inner_extra},
        "outer": {"params": bank,
                  "opt_state": outer_lib.init_outer_opt_state(
                      self.outer_tx, bank),
                  **outer_extra},
    }

  def _jit_init(self):
    init = jax.jit(self._init_fn, out_shardings=self.state_shardings)

    def run(key):
      with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
        return init(key)
    return run

  def init_bank(self, key):
    """The initial module bank alone (the outer part of `init_state`, the
    same numbers), without every worker's copy and AdamW state."""
    fn = jax.jit(lambda k: self._init_fn(k)["outer"]["params"],
                 out_shardings=self.bank_shardings)
    with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
      return fn(key)

  def state_from_bank(self, bank):
    """A fresh state whose modules are `bank` (e.g. a pretrained base)."""
    fn = jax.jit(self._state_from_bank, out_shardings=self.state_shardings)
    with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
      return fn(bank)

  # --- Steps ----------------------------------------------------------------

  def _worker_step(self, params, opt_state, batch_BxLp1, unmerge=None):
    """One worker's AdamW step; `unmerge`: its layer slots arrive merged
    (`merged_slots`), and the model gets them back cut apart."""
    loss_fn = functools.partial(next_token_loss, self.train_model,
                                loss_chunk=self.config.model.loss_chunk)
    if unmerge is not None:
      loss_fn = lambda p, b, f=loss_fn: f(unmerge(p), b)
    grad_dtype = jnp.dtype(self.config.train.grad_dtype)
    if grad_dtype == jnp.float32:
      loss, grads = jax.value_and_grad(loss_fn)(params, batch_BxLp1)
    else:
      # The gradient with respect to low-precision copies is low-precision
      # from the matmuls on, so the all-reduce over the data axes (which
      # XLA places where the batch's partial sums meet) can move half the
      # bytes (on CPU XLA still reduces float32 partial sums; on 2 H100s
      # it made the dense step no faster, docs/performance.md); AdamW gets
      # it back in float32.
      lowp = jax.tree.map(lambda p: p.astype(grad_dtype), params)
      loss, grads = jax.value_and_grad(loss_fn)(lowp, batch_BxLp1)
      grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    with jax.named_scope("optimizer"):  # Names its ops in profiles.
      updates, opt_state = self.inner_tx.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
    return params, opt_state, {"loss": loss,
                               "grad_norm": optax.tree.norm(grads)}

  def _step(self, state, batch_WxBxLp1, unmerge=None):
    """One inner step of every worker."""
    params, opt_state, metrics = jax.vmap(
        functools.partial(self._worker_step, unmerge=unmerge),
        spmd_axis_name=self._workers_spec[0])(
            state["inner"]["params"], state["inner"]["opt_state"],
            batch_WxBxLp1)
    inner = dict(state["inner"], params=params, opt_state=opt_state)
    return dict(state, inner=inner, step=state["step"] + 1), metrics

  def _jit_inner_step(self):
    metric_sharding = jax.sharding.NamedSharding(self.mesh,
                                                 self._workers_spec)
    jitted = jax.jit(self._step, in_shardings=(self.state_shardings,
                                               self.batch_sharding),
                     out_shardings=(self.state_shardings, metric_sharding),
                     donate_argnums=0)
    return self._in_context(jitted)

  def _jit_inner_k_steps(self):
    """K inner steps in one call (`train.steps_per_dispatch`): a scan of
    `_step` over batches [K, W, B, L+1]; metrics come back [K, W]."""
    group = merged_slots.layer_group(self.topology, self.config)

    def steps(state, batches_KxWxBxLp1):
      if group:  # `train.merge_layer_slots`.
        return merged_slots.scan(self._step, group, state, batches_KxWxBxLp1)
      return jax.lax.scan(self._step, state, batches_KxWxBxLp1)

    metric_sharding = jax.sharding.NamedSharding(
        self.mesh, jax.sharding.PartitionSpec(None, *self._workers_spec))
    jitted = jax.jit(steps, in_shardings=(self.state_shardings,
                                          self.steps_batch_sharding),
                     out_shardings=(self.state_shardings, metric_sharding),
                     donate_argnums=0)
    return self._in_context(jitted)

  def _outer_fn(self, state, weights_W):
    if not self.comm_plain:
      outer, inner = comm_step.outer_update(
          state["outer"], state["inner"], self.outer_tx, comms=self.comms,
          assignment_WxS=self.topology.assignment_WxS,
          slot_names=self.slot_names, weights_W=weights_W,
          rescale_by_sqrt_users=self.config.diloco.rescale_by_sqrt_users)
      return dict(state, inner=inner, outer=outer)
    inner = state["inner"]
    outer, params = outer_lib.outer_update(
        state["outer"], inner["params"], self.outer_tx,
        assignment_WxS=self.topology.assignment_WxS,
        slot_names=self.slot_names, weights_W=weights_W,
        rescale_by_sqrt_users=self.config.diloco.rescale_by_sqrt_users)
    return dict(state, inner=dict(inner, params=params), outer=outer)

  def _jit_outer_step(self):
    replicated = mesh_lib.replicated(self.mesh)
    jitted = jax.jit(self._outer_fn,
                     in_shardings=(self.state_shardings, replicated),
                     out_shardings=self.state_shardings, donate_argnums=0)
    return self._in_context(jitted)

  def _jit_flush_step(self):
    """Applies a delayed round still in flight (end of training)."""
    def flush(state):
      outer, inner = comm_step.flush(
          state["outer"], state["inner"], self.outer_tx, comms=self.comms,
          assignment_WxS=self.topology.assignment_WxS,
          slot_names=self.slot_names)
      return dict(state, inner=inner, outer=outer)
    jitted = jax.jit(flush, in_shardings=(self.state_shardings,),
                     out_shardings=self.state_shardings, donate_argnums=0)
    return self._in_context(jitted)

  def _in_context(self, fn):
    def run(*args):
      with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
        return fn(*args)
    run.jitted = fn
    return run

  def all_finite(self, state) -> bool:
    return bool(self._all_finite(state))

  # --- Views ------------------------------------------------------------------

  def path_params(self, bank, path: int):
    """One path's dense parameters gathered from a bank."""
    return bank_lib.bank_path(bank, self.topology, path)

  @functools.cached_property
  def global_batch_shape(self) -> tuple[int, int, int]:
    return (self.topology.num_workers, self.config.train.batch_size,
            self.config.data.seq_len + 1)

  @functools.cached_property
  def local_workers(self) -> tuple[int, ...]:
    """The workers (batch streams) whose rows this process's devices hold."""
    index_map = self.batch_sharding.addressable_devices_indices_map(
        self.global_batch_shape)
    num_workers = self.global_batch_shape[0]
    return tuple(sorted({w for idx in index_map.values()
                         for w in range(*idx[0].indices(num_workers))}))

  def worker_rows(self, local_batch):
    """The global [W, B, L+1] batch from this process's streams
    (`local_workers`, in that order): each device takes its own rows. A
    [K, len(local_workers), B, L+1] stack gives [K, W, B, L+1] (the
    batches of `inner_k_steps`)."""
    position = {w: i for i, w in enumerate(self.local_workers)}
    num_workers = self.global_batch_shape[0]
    if local_batch.ndim == 4:  # K steps: the same rows of every step.
      def rows_of_steps(index):
        streams = [position[w]
                   for w in range(*index[1].indices(num_workers))]
        return local_batch[index[0]][:, streams][:, :, index[2], index[3]]
      return jax.make_array_from_callback(
          (local_batch.shape[0],) + self.global_batch_shape,
          self.steps_batch_sharding, rows_of_steps)

    def rows_of(index):
      streams = [position[w] for w in range(*index[0].indices(num_workers))]
      return local_batch[streams][:, index[1], index[2]]
    return jax.make_array_from_callback(self.global_batch_shape,
                                        self.batch_sharding, rows_of)
