"""Kernel lowerings, one module each, all implementing the contract of ``kernels.common``.

* ``xla``: blockwise pure jnp (CPU default, and the oracle for the block logic).
* ``pallas_triton``: Pallas lowered through Triton (GPU).
* ``pallas_tpu``: Pallas lowered through Mosaic (TPU).
"""

from __future__ import annotations

import importlib

import jax

BACKEND_PLATFORM = {"xla": None, "pallas_triton": "gpu", "pallas_tpu": "tpu"}
_MODULES = {"xla": "pallas_ring.kernels.xla",
            "pallas_triton": "pallas_ring.kernels.pallas_triton",
            "pallas_tpu": "pallas_ring.kernels.pallas_tpu"}


def platform() -> str:
  """'tpu', 'gpu' or 'cpu' for the default device."""
  p = jax.default_backend()
  return "gpu" if p in ("gpu", "cuda", "rocm") else p


def resolve_backend(backend: str) -> str:
  """Maps ``"auto"`` to the native backend of the default device."""
  if backend != "auto":
    return backend
  return {"tpu": "pallas_tpu", "gpu": "pallas_triton"}.get(platform(), "xla")


def resolve_interpret(backend: str, interpret) -> bool:
  """``interpret=None`` means: interpret exactly when the device cannot run the kernel natively."""
  if interpret is not None:
    return bool(interpret)
  native = BACKEND_PLATFORM[backend]
  return native is not None and platform() != native


def get(backend: str):
  """The kernel module of a resolved backend name."""
  return importlib.import_module(_MODULES[backend])
