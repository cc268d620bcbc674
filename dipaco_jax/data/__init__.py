"""dipaco_jax.data."""
