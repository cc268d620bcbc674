"""dipaco_jax.routing."""
