"""Test setup: 8 virtual CPU devices (set before JAX initialises) and a deterministic hypothesis profile."""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
if os.environ.get("PALLAS_RING_TEST_GPU") is None:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
# TPU programs are compiled (not run) through libtpu by several pytest-xdist workers at once.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci", derandomize=True, deadline=None, max_examples=30, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def rel_err(got, ref):
  """Relative error ||got - ref|| / ||ref|| in float64."""
  got = np.asarray(got, np.float64)
  ref = np.asarray(ref, np.float64)
  denom = np.linalg.norm(ref)
  return float(np.linalg.norm(got - ref) / (denom if denom > 0 else 1.0))


@pytest.fixture
def rng():
  return np.random.default_rng(0)


# A GPU run (PALLAS_RING_TEST_GPU=1) adds the Mosaic GPU backend to test_pitfalls's backends.
ON_GPU = os.environ.get("PALLAS_RING_TEST_GPU") is not None
if ON_GPU:
  # On a GPU, JAX's default precision runs float32 matmuls as TF32 (in XLA and in Pallas
  # Triton kernels alike; README, below the support matrix). The float32 tolerances here are for
  # float32 arithmetic, which the xla and pallas_triton backends give under this setting.
  import jax  # noqa: E402
  jax.config.update("jax_default_matmul_precision", "highest")


def small_blocks(backend, head_dim=128):
  """Small tiles that still obey each backend's rules (many blocks at test sizes)."""
  from pallas_ring import BlockSizes
  if backend == "pallas_tpu":
    return BlockSizes(block_q=32, block_kv=128, block_q_bwd=32, block_kv_bwd=128)
  if backend == "pallas_mosaic_gpu":  # two warpgroups of 64 rows (the backward's on both sides
    bwd = 128 if head_dim <= 128 else 32  # up to H=128; above, the backward is Triton's)
    return BlockSizes(block_q=128, block_kv=64, block_q_bwd=bwd, block_kv_bwd=bwd)
  return BlockSizes(block_q=16, block_kv=16, block_q_bwd=16, block_kv_bwd=32)


def kernel_dtype(backend, dtype):
  """The dtype a backend is tested in: float32 cases run in bfloat16 on ``pallas_mosaic_gpu``
  (wgmma takes 16-bit inputs; float32 calls are refused, see test_mosaic_gpu)."""
  import jax.numpy as jnp
  if backend == "pallas_mosaic_gpu" and dtype == jnp.float32:
    return jnp.bfloat16
  return dtype
