"""The outer step: a golden update by hand, and DiLoCo/DiPaCo invariants."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from dipaco_jax import testing
from dipaco_jax.diloco import outer
from dipaco_jax.train import loop
import reference_step  # pylint: disable=g-bad-import-order  (in tests/)

# 2 levels x 2 experts = 4 paths (workers); path p uses expert p // 2 of
# slot 'a' (level 0) and p % 2 of slot 'b' (level 1); slot 'e' is shared.
ASSIGNMENT = np.array([[0, 0, 0], [0, 1, 0], [1, 0, 0], [1, 1, 0]])
SLOTS = ("a", "b", "e")
WEIGHTS = np.array([1.0, 2.0, 3.0, 4.0])  # shard sizes, unequal


def _nesterov():
  cfg = ml_collections.ConfigDict(dict(outer_optimizer="nesterov",
                                       outer_lr=0.7, outer_momentum=0.9))
  return outer.outer_optimizer(cfg)


def _outer_step(bank, opt_state, inner, rescale=False, weights=WEIGHTS):
  new, restarted = outer.outer_update(
      {"params": bank, "opt_state": opt_state}, inner, _nesterov(),
      assignment_WxS=ASSIGNMENT, slot_names=SLOTS, weights_W=weights,
      rescale_by_sqrt_users=rescale)
  return new["params"], new["opt_state"], restarted


def test_golden_outer_update_two_levels_unequal_weights_nesterov():
  bank = {"a": jnp.array([[1.0], [2.0]]), "b": jnp.array([[10.0], [20.0]]),
          "e": jnp.array([[5.0]])}
  inner = {"a": jnp.array([[0.5], [0.8], [1.5], [1.0]]),
           "b": jnp.array([[9.0], [19.0], [11.0], [18.0]]),
           "e": jnp.array([[4.0], [6.0], [5.0], [5.5]])}
  tx = _nesterov()
  bank1, state1, restarted = _outer_step(
      bank, outer.init_outer_opt_state(tx, bank), inner)
  # Pseudo-gradients, weighted by shard size over each module's users:
  #  a0: users 0 (w=1), 1 (w=2): 1.0 - (0.5 + 1.6)/3 = 0.3
  #  a1: users 2 (w=3), 3 (w=4): 2.0 - (4.5 + 4.0)/7 = 0.7857142857
  #  b0: users 0 (1), 2 (3):   10 - (9 + 33)/4 = -0.5
  #  b1: users 1 (2), 3 (4):   20 - (38 + 72)/6 = 1.6666666667
  #  e:  all (1,2,3,4):          5 - (4 + 12 + 15 + 22)/10 = -0.3
  # Nesterov from zero momentum: m = g; step = -lr (g + 0.9 m) = -1.33 g.
  want_a = [1.0 - 1.33 * 0.3, 2.0 - 1.33 * (2.0 - 8.5 / 7)]
  want_b = [10.0 + 1.33 * 0.5, 20.0 - 1.33 * (20.0 - 110.0 / 6)]
  want_e = [5.0 + 1.33 * 0.3]
  np.testing.assert_allclose(bank1["a"][:, 0], want_a, atol=1e-6)
  np.testing.assert_allclose(bank1["b"][:, 0], want_b, atol=1e-6)
  np.testing.assert_allclose(bank1["e"][:, 0], want_e, atol=1e-6)
  # Every worker restarts from its own modules' new outer copies.
  np.testing.assert_allclose(restarted["a"][:, 0],
                             np.array(want_a)[[0, 0, 1, 1]], atol=1e-6)
  np.testing.assert_allclose(restarted["b"][:, 0],
                             np.array(want_b)[[0, 1, 0, 1]], atol=1e-6)

  # Second round: momentum carries over. a0's workers move to 0.4 and 0.55.
  inner2 = dict(restarted, a=restarted["a"].at[0, 0].set(0.4)
                .at[1, 0].set(0.55))
  bank2, _, _ = _outer_step(bank1, state1, inner2)
  a0 = want_a[0]
  g2 = a0 - (1 * 0.4 + 2 * 0.55) / 3  # = 0.101 - ... by hand below
  m2 = g2 + 0.9 * 0.3
  np.testing.assert_allclose(bank2["a"][0, 0], a0 - 0.7 * (g2 + 0.9 * m2),
                             atol=1e-6)
  # a1's workers did not move: g = 0, but momentum keeps it going.
  a1 = want_a[1]
  m_a1 = 0.0 + 0.9 * (2.0 - 8.5 / 7)
  np.testing.assert_allclose(bank2["a"][1, 0], a1 - 0.7 * 0.9 * m_a1,
                             atol=1e-6)


def test_sqrt_users_rescaling_multiplies_the_pseudo_gradient():
  bank = {"a": jnp.array([[1.0], [2.0]]), "b": jnp.array([[0.0], [0.0]]),
          "e": jnp.array([[0.0]])}
  inner = {"a": jnp.array([[0.5], [0.8], [1.5], [1.0]]),
           "b": jnp.zeros((4, 1)), "e": jnp.zeros((4, 1))}
  mixing = outer.mixing_matrices(ASSIGNMENT, WEIGHTS, [2, 2, 1])
  users = outer.users_per_module(ASSIGNMENT, WEIGHTS, [2, 2, 1])
  delta = outer.pseudo_gradients(bank, inner, ASSIGNMENT, SLOTS, mixing,
                                 users, True)
  np.testing.assert_allclose(delta["a"][:, 0],
                             [0.3 * 2 ** 0.5, (2.0 - 8.5 / 7) * 2 ** 0.5],
                             atol=1e-6)


def test_unused_module_gets_no_update():
  assignment = np.array([[0], [0]])  # expert 1 has no users
  mixing = outer.mixing_matrices(assignment, np.ones(2), [2])
  users = outer.users_per_module(assignment, np.ones(2), [2])
  delta = outer.pseudo_gradients({"a": jnp.array([[1.0], [3.0]])},
                                 {"a": jnp.array([[0.0], [1.0]])},
                                 assignment, ("a",), mixing, users, False)
  np.testing.assert_allclose(delta["a"][:, 0], [0.5, 0.0])


def _train(config, batches, run_dir, weights_W=None):
  runtime = testing.tiny_runtime(config, weights_W=weights_W)
  result = loop.train(runtime, batches, str(run_dir), {}, "test")
  return runtime, jax.device_get(result.state)


def test_h1_outer_sgd_lr1_equals_synchronous_training(tmp_path):
  """DiLoCo, H = 1, outer SGD lr 1, no momentum, inner SGD: the average of
  the replicas' steps is one step on the mean gradient over all batches."""
  diloco = testing.tiny_config("1", replicas=4, inner_steps=1, num_steps=4)
  diloco.inner_opt.name = "sgd"
  diloco.inner_opt.learning_rate = 0.5
  diloco.inner_opt.grad_clip = 0.0
  diloco.diloco.outer_optimizer = "sgd"
  diloco.diloco.outer_lr = 1.0
  diloco.diloco.outer_momentum = 0.0
  data = testing.RandomBatches(4, 8, diloco.data.seq_len)
  runtime, got = _train(diloco, data, tmp_path / "diloco")

  # Synchronous SGD, written out: the same examples as one batch of 4 x 8.
  fresh = jax.device_get(runtime.init_state(jax.random.key(diloco.seed)))
  want = jax.tree.map(lambda x: x[0], fresh["outer"]["params"])
  opt = reference_step.init(want)
  step_fn = reference_step.make_step(runtime.model, diloco.inner_opt,
                                     diloco.train.num_steps)
  for step in range(4):
    want, opt, _ = step_fn(want, opt, data.batch(step).reshape(32, -1))
  for g, w in zip(jax.tree.leaves(got["outer"]["params"]),
                  jax.tree.leaves(want)):
    np.testing.assert_allclose(g[0], w, rtol=2e-5, atol=2e-6)


def test_one_expert_per_level_equals_plain_diloco(tmp_path):
  """DiPaCo with shape 1x1 (two levels, one expert each) and 2 replicas is
  DiLoCo: compared with Algorithm 1 written out over the whole tree."""
  config = testing.tiny_config("1x1", replicas=2, inner_steps=3, num_steps=6)
  data = testing.RandomBatches(2, 8, config.data.seq_len)
  runtime, got = _train(config, data, tmp_path / "dipaco",
                        weights_W=[1.0, 1.0])

  # Reference DiLoCo: per replica AdamW for H steps, mean of deltas over the
  # whole parameter tree, optax Nesterov.
  fresh = jax.device_get(runtime.init_state(jax.random.key(config.seed)))
  theta = jax.tree.map(lambda x: x[0], fresh["outer"]["params"])
  tx_out = optax.sgd(0.7, momentum=0.9, nesterov=True)
  out_state = tx_out.init(theta)
  inner_state = [reference_step.init(theta) for _ in range(2)]
  step_fn = reference_step.make_step(runtime.model, config.inner_opt,
                                     config.train.num_steps)
  for rnd in range(2):
    finals = []
    for r in range(2):
      params = theta
      for h in range(3):
        batch = data.batch(rnd * 3 + h)[r]
        params, inner_state[r], _ = step_fn(params, inner_state[r], batch)
      finals.append(params)
    delta = jax.tree.map(lambda t, a, b: t - (a + b) / 2, theta, *finals)
    updates, out_state = tx_out.update(delta, out_state, theta)
    theta = optax.apply_updates(theta, updates)
  for g, w in zip(jax.tree.leaves(got["outer"]["params"]),
                  jax.tree.leaves(theta)):
    np.testing.assert_allclose(g[0], w, rtol=1e-5, atol=1e-6)


def test_modules_change_only_through_their_paths_and_stay_in_sync(tmp_path):
  config = testing.tiny_config("2x2", inner_steps=2, num_steps=2)
  base = testing.RandomBatches(4, 8, config.data.seq_len)
  other = testing.RandomBatches(4, 8, config.data.seq_len,
                                salt_W=np.array([0, 0, 0, 1]))
  _, a = _train(config, base, tmp_path / "a")
  _, b = _train(config, other, tmp_path / "b")
  # Path 3 = (level-0 expert 1, level-1 expert 1) saw different data.
  level0, level1 = "layers_00_01", "layers_02_03"
  same = lambda x, y: all(np.array_equal(p, q) for p, q in zip(
      jax.tree.leaves(x), jax.tree.leaves(y)))
  take = lambda tree, e: jax.tree.map(lambda x: x[e], tree)
  assert same(take(a["outer"]["params"][level0], 0),
              take(b["outer"]["params"][level0], 0))
  assert same(take(a["outer"]["params"][level1], 0),
              take(b["outer"]["params"][level1], 0))
  assert not same(take(a["outer"]["params"][level0], 1),
                  take(b["outer"]["params"][level0], 1))
  assert not same(take(a["outer"]["params"][level1], 1),
                  take(b["outer"]["params"][level1], 1))
  assert not same(a["outer"]["params"]["embed_head"],
                  b["outer"]["params"]["embed_head"])
  # Right after the outer step, every user of a module holds its outer copy.
  for w, (e0, e1) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
    assert same(take(a["inner"]["params"][level0], w),
                take(a["outer"]["params"][level0], e0))
    assert same(take(a["inner"]["params"][level1], w),
                take(a["outer"]["params"][level1], e1))


def test_senders_mean_averages_each_coordinate_over_its_senders():
  # Hand-computed: users weighted 0.5, 0.25, 0.25 of module 0 (module 1
  # unused). Coordinate 0 sent by users 0 and 2: (0.5 * 2 + 0.25 * 2) /
  # 0.75 = 2 (the dense mean: 1.5); coordinate 2 by user 1 alone: 8 (mean:
  # 2); coordinate 1 by no one: 0; coordinate 3 by users 0 and 1: 4.
  c_WxN = jnp.asarray([[2., 0., 0., 4.], [0., 0., 8., 4.], [2., 0., 0., 0.]])
  a_WxK = jnp.asarray([[0.5, 0.], [0.25, 0.], [0.25, 0.]])
  users_K = jnp.asarray([3., 0.])
  mix = lambda aggregate: outer.mix({"s": c_WxN}, ["s"], [a_WxK], [users_K],
                                    False, [aggregate])["s"]
  np.testing.assert_allclose(mix("mean"), [[1.5, 0., 2., 3.], [0.] * 4])
  np.testing.assert_allclose(mix("senders"), [[2., 0., 8., 4.], [0.] * 4])
  # Without the argument: the mean.
  np.testing.assert_allclose(
      outer.mix({"s": c_WxN}, ["s"], [a_WxK], [users_K], False)["s"],
      mix("mean"))
