"""dipaco_jax: DiPaCo, DiLoCo and DiLoCoX in JAX/Flax."""

# gs:// reads fresh across processes, whatever the user's environment
# (no gcsfs listing cache; etils through gcsfs): store/object_store.py.
from dipaco_jax.store import object_store as _object_store  # pylint: disable=g-import-not-at-top

_object_store.configure()
