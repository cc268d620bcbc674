"""The device mesh, fake CPU devices, and logical-to-mesh shardings.

One mesh `path x stage x data x fsdp x tensor` (unused axes have size 1)
in Auto axis mode; parameters carry logical axis names and
`config.sharding_rules` maps them to mesh axes (DESIGN invariant 6). The
`stage` axis holds pipeline stages (`model.pipelined`).
"""

import math
import os

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from dipaco_jax import config_fields


def setup_fake_devices(num_devices: int, check: bool = True) -> None:
  """Asks for `num_devices` CPU devices (per process); must run before JAX
  starts. With `check`, verifies it took (this starts JAX's backends).

  Raises a clear error when the platform is not CPU, since fake devices only
  exist there.
  """
  if num_devices <= 0:
    return
  platforms = os.environ.get("JAX_PLATFORMS", "")
  if platforms and platforms != "cpu":
    raise ValueError(
        f"--fake_devices={num_devices} needs the CPU platform but "
        f"JAX_PLATFORMS={platforms!r}; unset it or drop --fake_devices.")
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", num_devices)
  if check:
    verify_fake_devices(num_devices)


def verify_fake_devices(num_devices: int) -> None:
  """Raises unless JAX runs on `num_devices` local CPU devices."""
  if num_devices <= 0:
    return
  if jax.default_backend() != "cpu" or jax.local_device_count() != num_devices:
    raise ValueError(
        f"--fake_devices={num_devices}: JAX started on "
        f"{jax.default_backend()} with {jax.local_device_count()} devices. Fake "
        "devices must be set before JAX initializes; drop the flag on GPU/TPU.")


def make_mesh(config, devices=None) -> jax.sharding.Mesh:
  devices = devices if devices is not None else jax.devices()
  shape = resolve_mesh_shape(config, len(devices))
  axes = config_fields.MESH_AXES
  return jax.make_mesh(tuple(shape[a] for a in axes), axes,
                       axis_types=(jax.sharding.AxisType.Auto,) * len(axes),
                       devices=devices)


def resolve_mesh_shape(config, num_devices: int) -> dict[str, int]:
  """Resolves `path=0` (auto) and the one -1 axis against `num_devices`."""
  sizes = {a: config.mesh[a] for a in config_fields.MESH_AXES}
  if sum(s == -1 for s in sizes.values()) > 1 or any(
      s < -1 or (s == 0 and a not in ("path", "stage"))
      for a, s in sizes.items()):
    config_fields.fail("mesh", f"{sizes}: sizes are positive, with at most "
                       "one -1 (and path and stage may be 0 = auto).")
  if sizes["stage"] == 0:
    sizes["stage"] = config.pipeline.stages
  if sizes["path"] == 0:
    stage = max(sizes["stage"], 1)  # Workers share what stages leave.
    sizes["path"] = math.gcd(config_fields.num_workers_of(config),
                             max(num_devices // stage, 1))
  known = math.prod(s for s in sizes.values() if s != -1)
  if num_devices % known:
    config_fields.fail("mesh",
                       f"{sizes} does not divide {num_devices} devices.")
  for a, s in sizes.items():
    if s == -1:
      sizes[a] = num_devices // known
  if math.prod(sizes.values()) != num_devices:
    config_fields.fail("mesh", f"{sizes} uses {math.prod(sizes.values())} "
                       f"devices but {num_devices} are present.")
  return sizes


def rules_of(config) -> tuple:
  return tuple((k, v) for k, v in config.sharding_rules)


def logical_specs(boxed_tree, leading: str | None = None):
  """PartitionSpecs of logical names from flax metadata, optionally with a
  leading logical axis (`experts` for the bank, `workers` for inner state)."""
  specs = nn.get_partition_spec(boxed_tree)
  if leading is None:
    return specs
  return jax.tree.map(lambda s: P(leading, *s), specs,
                      is_leaf=lambda x: isinstance(x, P))


def to_shardings(logical_spec_tree, mesh, rules):
  return nn.logical_to_mesh_sharding(logical_spec_tree, mesh, list(rules))


def batch_sharding(mesh, rules) -> NamedSharding:
  """Batches are [W, B, L+1]: workers over `path`, examples over data."""
  spec = nn.logical_to_mesh_axes(("workers", "batch", None), list(rules))
  return NamedSharding(mesh, spec)


def replicated(mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def describe(mesh) -> str:
  return " x ".join(f"{n}={s}" for n, s in mesh.shape.items()) + (
      f" on {mesh.devices.size} {np.ravel(mesh.devices)[0].platform} devices")
