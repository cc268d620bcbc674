"""dipaco_jax.parallel."""
