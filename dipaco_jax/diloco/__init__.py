"""dipaco_jax.diloco."""
