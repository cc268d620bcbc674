"""dipaco_jax.eval."""
