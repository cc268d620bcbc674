"""The parts of the main job's stages; `dipaco_jax.pipeline` runs them."""
