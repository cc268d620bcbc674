"""dipaco_jax.model."""
