"""dipaco_jax: DiPaCo / DiLoCo / DiLoCoX training in JAX and Flax."""

import setuptools

_CORE = [
    "jax>=0.10.0",
    "flax>=0.12.0",
    "optax>=0.2.5",
    "orbax-checkpoint>=0.12.0",
    "ml-collections>=1.0.0",
    "chex>=0.1.90",
    "sentencepiece>=0.2.0",
    "numpy>=1.26",
    "etils[epath]>=1.10",
    "absl-py>=2.1",
    "tensorboardX>=2.6",
    "matplotlib>=3.8",
    # The token store (dipaco_jax/data/doc_store.py): ArrayRecord files read
    # through its ArrayRecordDataSource (the one Grain's subclasses).
    "array-record>=0.7",
]

_EXTRAS = {
    # Data preparation only (invariant 2: training never imports TensorFlow).
    # tensorflow-text (a seqio dependency) needs the `tensorflow` package
    # itself, not tensorflow-cpu; these pins install together with jax 0.10
    # and numpy 2 on Python 3.11 (see BUILD_NOTES.md).
    "data": ["tensorflow==2.21.0", "tensorflow-text==2.21.1",
             "tensorflow-datasets==4.9.10", "seqio==0.0.20"],
    # gcp-storage-emulator: the local GCS of tests/test_gcs_emulator.py
    # (pinned: dipaco_jax/testing/gcs_server.py patches its handlers);
    # gcsfs: what etils.epath reads and writes gs:// with (2025.2 or
    # later: commit markers are created with pipe_file(mode="create"),
    # dipaco_jax/store/object_store.py).
    "test": ["pytest>=8", "pytest-xdist>=3.5",
             "gcp-storage-emulator==2026.7.19", "gcsfs>=2025.2.0"],
    # The documentation site (mkdocs.yml; CI builds it with --strict).
    "docs": ["mkdocs>=1.6", "mkdocstrings[python]>=0.26",
             "mkdocs-material>=9.5"],
    "tpu": ["jax[tpu]"],
    "gcs": ["gcsfs>=2025.2.0"],
}

setuptools.setup(
    name="dipaco_jax",
    version="0.1.0",
    description=(
        "Distributed Path Composition (DiPaCo) and DiLoCo in JAX/Flax: "
        "low-communication training across compute islands."
    ),
    packages=setuptools.find_packages(include=["dipaco_jax", "dipaco_jax.*"]),
    python_requires=">=3.11",
    install_requires=_CORE,
    extras_require=_EXTRAS,
)
