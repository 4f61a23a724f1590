"""Kernel lowerings, one module each, all implementing the contract of ``kernels.common``.

* ``xla``: blockwise pure jnp (CPU default, and the oracle for the block logic).
* ``pallas_mosaic_gpu``: Pallas lowered through Mosaic GPU (Hopper, sm_90+).
* ``pallas_triton``: Pallas lowered through Triton (GPU).
* ``pallas_tpu``: Pallas lowered through Mosaic (TPU).

``backend="auto"`` and ``interpret=None`` are resolved for the platform a computation is *lowered*
for, not for the default device: ``dispatch`` builds one variant per platform and lets
``lax.platform_dependent`` pick, so compiling for a TPU or GPU from a CPU host (AOT) yields the
native kernels, and CPU runs interpret mode only where it must.
"""

from __future__ import annotations

import functools
import importlib
from typing import Callable

import jax
import jax.numpy as jnp

# The platform family each backend's kernels run on natively (None: everywhere).
BACKEND_PLATFORM = {"xla": None, "pallas_triton": "gpu", "pallas_mosaic_gpu": "gpu",
                    "pallas_tpu": "tpu"}
_MODULES = {"xla": "pallas_ring.kernels.xla",
            "pallas_triton": "pallas_ring.kernels.pallas_triton",
            "pallas_mosaic_gpu": "pallas_ring.kernels.pallas_mosaic_gpu",
            "pallas_tpu": "pallas_ring.kernels.pallas_tpu"}
# lax.platform_dependent's platform names.
PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
# What "auto" tries on each platform family, in order (then xla).
_NATIVE = {"tpu": ("pallas_tpu",), "gpu": ("pallas_mosaic_gpu", "pallas_triton")}


def family(platform: str) -> str:
  """'cpu', 'gpu' or 'tpu' for a platform name (``jax.default_backend()`` or a lowering one)."""
  return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


def hopper() -> bool:
  """Whether this process's GPUs are Hopper-class or newer (compute capability >= 9.0), the ones
  the ``pallas_mosaic_gpu`` kernels are written for. False without a local GPU: ``"auto"`` then
  lowers GPU computations (e.g. AOT from a CPU host) through Triton; ask for
  ``backend="pallas_mosaic_gpu"`` explicitly to target Hopper from such a host."""
  try:
    devices = jax.devices("gpu")
  except RuntimeError:
    return False
  cc = getattr(devices[0], "compute_capability", "0")
  return float(cc) >= 9.0


def _auto(family_: str, dtype, accepts: Callable[[str], bool] = lambda b: True) -> str:
  """The backend ``"auto"`` picks on a platform family for inputs of ``dtype``: the first native
  backend that ``accepts`` the call, else xla."""
  if jnp.dtype(dtype) == jnp.float64:  # only the xla lowering computes in float64
    return "xla"
  for b in _NATIVE.get(family_, ()):
    if b == "pallas_mosaic_gpu" and not (
        jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and hopper()):
      continue
    if accepts(b):
      return b
  return "xla"


def native_backend(dtype=jnp.bfloat16) -> str:
  """The backend ``"auto"`` runs on this process's default device."""
  return _auto(family(jax.default_backend()), dtype)


def variants(backend: str, interpret, dtype, accepts: Callable[[str], bool] = lambda b: True
             ) -> dict[str, tuple[str, bool]]:
  """``{platform: (backend, interpret)}`` for every platform a computation may be lowered for.

  Args:
    backend: a backend name or ``"auto"``.
    interpret: True / False, or None for "interpret exactly where the kernel cannot run".
    dtype: the inputs' dtype (``"auto"`` keeps float64 on ``xla``).
    accepts: whether a backend can take the call's arguments (e.g. user block sizes, a feature
      one kernel lacks); ``"auto"`` takes the next native backend that can, then ``xla``.
  """
  out = {}
  for platform in PLATFORMS:
    fam = family(platform)
    b = _auto(fam, dtype, accepts) if backend == "auto" else backend
    native = BACKEND_PLATFORM[b]
    out[platform] = (b, bool(interpret) if interpret is not None else
                     native is not None and native != fam)
  return out


def dispatch(fn: Callable, per_platform: dict[str, tuple[str, bool]], *args):
  """Calls ``fn(backend, interpret, *args)`` with the variant of the lowering platform."""
  distinct = set(per_platform.values())
  if len(distinct) == 1:
    return fn(*distinct.pop(), *args)
  branches = {p: functools.partial(fn, *v) for p, v in per_platform.items()}
  return jax.lax.platform_dependent(*args, **branches)


def get(backend: str):
  """The kernel module of a resolved backend name."""
  return importlib.import_module(_MODULES[backend])
