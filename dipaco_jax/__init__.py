"""dipaco_jax: DiPaCo, DiLoCo and DiLoCoX in JAX/Flax."""
