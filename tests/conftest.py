"""Test setup: 8 fake CPU devices before JAX starts; implicit rank
promotion is an error, so a broadcast that only works by accident fails."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # pylint: disable=g-import-not-at-top

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")
