"""Kernel lowerings, one backend object each (``kernels.backend.Backend``), registered here once.

* ``pallas_tpu``: Pallas lowered through Mosaic (TPU).
* ``pallas_mosaic_gpu``: Pallas lowered through Mosaic GPU (Hopper, sm_90+).
* ``pallas_triton``: Pallas lowered through Triton (GPU).
* ``xla``: blockwise pure jnp (CPU default, float64, and the oracle for the block logic).

The registry's order is ``backend="auto"``'s preference: on each platform family it takes the
first backend that runs there natively, may be picked in this process and can serve the call
(``Backend.supports``, the user's tiles), then ``xla``. ``"auto"`` and ``interpret=None`` are
resolved for the platform a computation is *lowered* for, not for the default device:
``dispatch`` builds one variant per platform and lets ``lax.platform_dependent`` pick, so
compiling for a TPU or GPU from a CPU host (AOT) yields the native kernels, and CPU runs
interpret mode only where it must.

A backend's kernel variants (``BlockSizes(variants=<that backend>.Variants(...))``) apply where
that backend runs: under ``"auto"`` the other backends (other platforms, or calls that backend
does not serve) run without them (``for_backend``); a backend named explicitly refuses another's
variants, and an object that is no backend's variants raises naming the fix (``check_variants``).

A backend whose module cannot be imported with the installed JAX (a Pallas lowering removed
from JAX: the Triton one is deprecated since JAX 0.11) is skipped by ``"auto"`` with a warning,
so GPUs its kernels served fall back to the next backend (``xla`` for pre-Hopper GPUs); asked for
by name, it raises ``BackendUnavailable`` naming the fix.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import warnings
from typing import Callable

import jax
import jax.numpy as jnp

from pallas_ring.kernels.backend import Backend, Call

# The registry: backend name -> the module that defines its ``BACKEND`` object (imported on first
# use), in ``"auto"``'s order of preference. Registering a backend is adding its line here.
_REGISTRY = {"pallas_tpu": "pallas_ring.kernels.pallas_tpu",
             "pallas_mosaic_gpu": "pallas_ring.kernels.pallas_mosaic_gpu",
             "pallas_triton": "pallas_ring.kernels.pallas_triton",
             "xla": "pallas_ring.kernels.xla"}
# lax.platform_dependent's platform names.
PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


def backend_names() -> tuple[str, ...]:
  """Every accepted ``backend=`` value: ``"auto"`` and the registered backends."""
  return ("auto", *_REGISTRY)


class BackendUnavailable(ImportError):
  """A registered backend cannot be imported with this JAX (its Pallas lowering is gone)."""


_WARNED_UNAVAILABLE: set[str] = set()


def get(name: str) -> Backend:
  """The backend object registered as ``name``.

  Raises:
    ValueError: ``name`` is not registered.
    BackendUnavailable: its module cannot be imported with this JAX, e.g. Pallas's Triton
      lowering (``jax.experimental.pallas.triton``), deprecated in JAX 0.11, once it is removed.
  """
  if name not in _REGISTRY:
    raise ValueError(f"`backend`={name!r} is not known; use one of {backend_names()} ('auto' "
                     "picks pallas_tpu on TPU, pallas_mosaic_gpu or pallas_triton on GPU, xla on "
                     "CPU).")
  try:
    return importlib.import_module(_REGISTRY[name]).BACKEND
  except ImportError as e:
    if isinstance(e, BackendUnavailable):
      raise
    raise BackendUnavailable(
        f"backend={name!r} cannot be used with JAX {jax.__version__}: importing its kernels "
        f"failed ({type(e).__name__}: {e}), so this JAX lacks the Pallas lowering they are "
        "written in (JAX 0.11 deprecates Pallas's Triton lowering, the pre-Hopper GPU kernels). "
        "Use backend='auto', which runs the fastest backend this JAX still has ('xla', the "
        "blockwise XLA implementation of the same contract, where no kernel is left), or "
        "install a JAX that has the lowering (the README's 'Pre-Hopper GPUs').") from e


def _available(name: str) -> Backend | None:
  """``get(name)``, or None (warning once) when its module cannot be imported with this JAX."""
  try:
    return get(name)
  except BackendUnavailable as e:
    if name not in _WARNED_UNAVAILABLE:
      _WARNED_UNAVAILABLE.add(name)
      warnings.warn(f"{e} backend='auto' skips it.", RuntimeWarning, stacklevel=3)
    return None


def family(platform: str) -> str:
  """'cpu', 'gpu' or 'tpu' for a platform name (``jax.default_backend()`` or a lowering one)."""
  return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


def interprets(backend: str, platform: str) -> bool:
  """Whether ``backend``'s kernels run in interpret mode on ``platform`` (a platform name or
  family): they are native to one family, and it is another."""
  native = get(backend).platform
  return native is not None and native != family(platform)


def target_device():
  """The device being lowered for: the abstract mesh's device inside ``shard_map`` or
  ``jax.set_mesh`` (e.g. a TPU topology compiled from a CPU host), else the default device;
  None without any backend. Either has ``device_kind`` and ``platform``."""
  abstract = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  if abstract is not None:
    return abstract
  try:
    return jax.devices()[0]
  except RuntimeError:  # pragma: no cover - no backend at all
    return None


def _lowering_platforms() -> tuple[str, ...]:
  """The platforms a computation traced now may be lowered for: the mesh's when its devices
  are of another family than this process's (a TPU topology compiled from a CPU host: tracing
  the CPU variant too would only cost time), else every platform."""
  dev = target_device()
  if dev is not None and family(dev.platform) != family(jax.default_backend()):
    return tuple(p for p in PLATFORMS if family(p) == family(dev.platform))
  return PLATFORMS


def variants_owner(variants) -> str | None:
  """The registered backend whose kernel-variant config ``variants`` is (None: no backend's)."""
  for name in _REGISTRY:
    b = _available(name)
    if b is not None and b.variants_cls is not None and isinstance(variants, b.variants_cls):
      return name
  return None


def check_variants(block_sizes) -> None:
  """Raises when ``block_sizes.variants`` is set but is no registered backend's variants."""
  v = getattr(block_sizes, "variants", None)
  if v is None or variants_owner(v) is not None:
    return
  owned = [f"{b.variants_cls.__module__}.{b.variants_cls.__name__}"
           for b in map(_available, _REGISTRY) if b is not None and b.variants_cls is not None]
  raise ValueError(
      f"block_sizes.variants={v!r} is not the kernel-variant config of any backend (those are "
      f"{', '.join(owned)}): pass one of them, e.g. "
      "BlockSizes(variants=pallas_ring.kernels.pallas_mosaic_gpu.Variants(deterministic=True)), "
      "or variants=None for each backend's defaults.")


def for_backend(name: str, block_sizes):
  """``block_sizes`` as backend ``name`` sees them under ``"auto"``: another backend's kernel
  variants are dropped. A backend's variants apply where that backend runs; the computations
  ``"auto"`` gives other backends (another platform, or a call that backend does not serve) run
  without them."""
  v = block_sizes.variants
  if v is None or variants_owner(v) in (name, None):  # (None: check_variants' error)
    return block_sizes
  return block_sizes.replace(variants=None)


def auto(family_: str, call: Call) -> str:
  """The backend ``"auto"`` picks on a platform family (``family``) for ``call``."""
  reasons = []
  for name in _REGISTRY:
    b = _available(name)  # (None: gone from this JAX, e.g. the Pallas Triton lowering)
    if (b is None or b.platform not in (family_, None) or not b.auto_eligible()
        or not b.auto_prefers(call)):
      continue
    mine = dataclasses.replace(call, block_sizes=for_backend(name, call.block_sizes))
    try:
      check_explicit(name, mine)
    except (TypeError, ValueError) as e:
      reasons.append(f"{name}: {e}")
      continue
    return name
  # (xla serves every call its tile rules allow: the user's block_sizes broke them.)
  raise ValueError(f"backend='auto' found no backend that serves this call on {family_}: "
                   + " ".join(reasons) + " Fix the block_sizes named above (None fields are "
                   "resolved per backend).")


def check_explicit(name: str, call: Call) -> None:
  """Raises when the backend asked for by name cannot serve ``call``: the reason and the
  fallback."""
  b = get(name)
  if jnp.dtype(call.dtype) == jnp.float64 and not b.computes_float64:
    raise TypeError(
        f"`q` has dtype float64 but backend={name!r} computes in float32 at most (Pallas "
        "kernels have no float64 matmul). Pass backend=\"xla\" for float64 attention (it computes "
        "in float64), or cast the inputs to float32.")
  why = b.supports(call)
  if why is not None:
    raise ValueError(f"backend={name!r} cannot serve this call: {why}. Use "
                     f"backend={b.fallback!r} (or 'auto', which picks the best kernel that can).")
  b.check_block_sizes(call.block_sizes)


def native_backend(dtype=jnp.bfloat16) -> str:
  """The backend ``"auto"`` runs on this process's default device."""
  return auto(family(jax.default_backend()), Call(dtype, 128))


def variants(backend: str, interpret, call: Call) -> dict[str, tuple[str, bool]]:
  """``{platform: (backend, interpret)}`` for every platform a computation may be lowered for.

  Args:
    backend: a backend name or ``"auto"`` (an explicit name must have passed
      ``check_explicit``).
    interpret: True / False, an interpreter's parameters (``pltpu.InterpretParams``: JAX's TPU
      interpreter), or None for "interpret exactly where the kernel cannot run".
    call: what the backends are asked about (``Backend.supports``).
  """
  if backend == "auto":
    check_variants(call.block_sizes)
  out, picks = {}, {}  # (picks: "auto" resolved once per platform family)
  for platform in _lowering_platforms():
    fam = family(platform)
    if fam not in picks:
      picks[fam] = auto(fam, call) if backend == "auto" else backend
    b = picks[fam]
    # (an interpreter's parameters, e.g. ``pltpu.InterpretParams``, reach the kernels as given)
    given = interpret if dataclasses.is_dataclass(interpret) else bool(interpret)
    out[platform] = (b, given if interpret is not None else interprets(b, fam))
  return out


def dispatch(fn: Callable, per_platform: dict[str, tuple[str, bool]], *args):
  """Calls ``fn(backend, interpret, *args)`` with the variant of the lowering platform."""
  distinct = set(per_platform.values())
  if len(distinct) == 1:
    return fn(*distinct.pop(), *args)
  branches = {p: functools.partial(fn, *v) for p, v in per_platform.items()}
  return jax.lax.platform_dependent(*args, **branches)

