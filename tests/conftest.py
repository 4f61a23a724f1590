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
