"""dipaco_jax.train."""
