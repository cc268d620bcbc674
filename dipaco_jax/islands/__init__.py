"""dipaco_jax.islands."""
