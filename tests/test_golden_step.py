"""Golden values: the first inner steps of a tiny DiPaCo 2x2, pinned.

If this fails, the numbers the framework produces changed. When that was
not intended, the change broke something (the model, the inner optimizer,
the batches, the outer step at step 2). When it was intended (a new
initializer, another loss reduction), rerun the loop below, replace the
values, and say in BUILD_NOTES.md what moved and why.
"""

import jax
import numpy as np

from dipaco_jax import testing
from dipaco_jax.train import sync as sync_lib

# Per step (1-based), per worker: (loss, gradient global norm); the outer
# step runs after step 2. Recorded on CPU with jax 0.10.2, 2026-11-26.
GOLDEN_LOSS = {
    1: [5.068394184112549, 5.080349445343018, 4.993133544921875,
        5.022794723510742],
    2: [5.025198459625244, 5.035349369049072, 5.074677467346191,
        4.97079610824585],
    3: [5.12947416305542, 5.019105434417725, 5.067330360412598,
        5.071096897125244],
    4: [5.017531871795654, 5.017800807952881, 5.154733180999756,
        4.990129470825195],
}
GOLDEN_GRAD_NORM = {
    1: [0.38973939418792725, 0.3948449194431305, 0.378563791513443,
        0.38720694184303284],
    2: [0.38543903827667236, 0.38486987352371216, 0.3904222846031189,
        0.3791274428367615],
    3: [0.3983846604824066, 0.3802277445793152, 0.38378557562828064,
        0.3850612938404083],
    4: [0.38281524181365967, 0.38586264848709106, 0.40539994835853577,
        0.38840121030807495],
}
# The outer step's arithmetic order may move the last bits; a real change
# moves far more.
RTOL = 1e-5


def test_first_steps_of_a_tiny_2x2_match_the_pinned_values():
  config = testing.tiny_config("2x2", inner_steps=2, num_steps=4)
  data = testing.RandomBatches(4, 8, config.data.seq_len)
  runtime = testing.tiny_runtime(config, weights_W=[1.0, 2.0, 3.0, 4.0])
  sync = sync_lib.InProcessSync(runtime)
  state = runtime.init_state(jax.random.key(config.seed))
  for step in range(1, 5):
    state, metrics = runtime.inner_step(
        state, runtime.worker_rows(data.batch(step - 1)))
    metrics = jax.device_get(metrics)
    hint = (f"step {step}: the numbers changed; if intended, update the "
            "golden values (see this file's docstring)")
    np.testing.assert_allclose(metrics["loss"], GOLDEN_LOSS[step],
                               rtol=RTOL, err_msg=hint)
    np.testing.assert_allclose(metrics["grad_norm"], GOLDEN_GRAD_NORM[step],
                               rtol=RTOL, err_msg=hint)
    if step == 2:
      state = sync.finish(0, sync.start(0, state))
