"""Mask specs in global token coordinates.

A mask spec is a static, hashable description of which (query, key) pairs may attend. It is
evaluated two ways:

* ``visible(q, k)``: elementwise on (broadcast) integer position arrays; used inside kernels on
  partially visible blocks and by the dense reference.
* ``block_test(qb, kb)``: on per-block summaries (min / max position of a query block and of a key
  block), returns ``(any_visible, all_visible)``. The test is *sound*: it never says "no pair is
  visible" when one is, nor "every pair is visible" when one is masked. For the primitive specs it
  is exact when the positions inside each block are contiguous.

Specs combine with ``&`` and ``|``. ``bool(spec)`` raises, which catches ``spec_a and spec_b``.
Document masking is not a spec: ``segment_ids`` are ANDed in by the block plan and the kernels.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from pallas_ring import validation

Array = Any


class BlockBounds(NamedTuple):
  """Per-block position summaries, broadcast against each other.

  Attributes:
    lo: smallest position in the block.  # e.g. [nq, 1] for queries, [1, nk] for keys
    hi: largest position in the block.
  """

  lo: Array
  hi: Array


class MaskSpec:
  """Base class of all mask specs. Subclasses are frozen dataclasses (hashable, jit-static)."""

  def visible(self, q: Array, k: Array) -> Array:
    """Elementwise visibility of query positions ``q`` against key positions ``k`` (broadcast)."""
    raise NotImplementedError

  def block_test(self, qb: BlockBounds, kb: BlockBounds) -> tuple[Array, Array]:
    """Sound ``(any_visible, all_visible)`` for blocks summarised by ``qb`` and ``kb``."""
    raise NotImplementedError

  def __and__(self, other: "MaskSpec") -> "MaskSpec":
    return And(self, _check_spec(other, "right operand of &"))

  def __or__(self, other: "MaskSpec") -> "MaskSpec":
    return Or(self, _check_spec(other, "right operand of |"))

  def __bool__(self):
    raise TypeError(
        f"The truth value of mask spec {self!r} is ambiguous: `and`/`or` do not combine masks. "
        "Use `mask_a & mask_b` (both must allow) or `mask_a | mask_b` (either allows).")


def _check_spec(value, what: str) -> MaskSpec:
  if isinstance(value, type) and issubclass(value, MaskSpec):
    raise TypeError(f"{what} is the class masks.{value.__name__}, not a mask: instantiate it, "
                    f"e.g. `masks.{value.__name__}()`"
                    f"{'' if value in (Full, Causal) else ' with its arguments'}.")
  if not isinstance(value, MaskSpec):
    got = (f"an array of shape {tuple(value.shape)}" if hasattr(value, "shape")
           else f"{type(value).__name__}: {value!r}")
    raise TypeError(
        f"{what} must be a pallas_ring.masks spec (Full, Causal, SlidingWindow, ChunkedCausal, "
        f"PrefixLM, Custom or a combination), got {got}. "
        "For an array mask pass it as `dense_mask=` instead.")
  return value


def as_spec(mask: Optional[MaskSpec], argname: str = "mask") -> MaskSpec:
  """Returns ``mask`` validated as a spec; ``None`` means ``Full()``."""
  if mask is None:
    return Full()
  return _check_spec(mask, f"`{argname}`")


def _floordiv(x, c: int):
  """Floor division by a positive constant without ``sign`` (which Mosaic cannot lower offline)."""
  if isinstance(x, np.ndarray):  # (block plans built in numpy: ``plans.Planner``)
    return x // c
  x = jnp.asarray(x)
  d = jax.lax.div(x, jnp.asarray(c, x.dtype))
  return d - (x - d * c < 0).astype(x.dtype)


INT32_MIN, INT32_MAX = validation.INT32_MIN, validation.INT32_MAX


def _filled(value: bool, a, b):
  """A bool array of ``value`` in the broadcast shape of ``a`` and ``b``: numpy when both are
  (block plans built in numpy, e.g. while compiling for a TPU topology under its mesh, where a
  ``jnp`` constant cannot be placed), else jax."""
  shape = np.broadcast_shapes(np.shape(a), np.shape(b))
  if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
    return np.full(shape, value)
  return jnp.full(shape, value)


def _check_int(cls: str, field: str, value, minimum: int, fix: str) -> None:
  if isinstance(value, bool) or not isinstance(value, int):
    raise TypeError(f"{cls}.{field} must be a Python int, got {type(value).__name__}: {value!r}.")
  if value < minimum:
    raise ValueError(f"{cls}.{field}={value} is invalid: it must be >= {minimum}. {fix}")
  if value > INT32_MAX:
    raise ValueError(
        f"{cls}.{field}={value} is invalid: positions are int32, so it must be <= 2**31 - 1 = "
        f"{INT32_MAX}. Use {INT32_MAX} (no position pair is further apart than that on this side) "
        "or a smaller value.")


# Overflow-free comparisons of int32 positions against a shifted position: ``x - c`` or ``x + c``
# may wrap around int32 for positions near the limits; where it would, the comparison's outcome
# is already known, so the wrapped value is never used.
def _ge_minus(a, b, c: int):
  """Exactly ``a >= b - c`` for int32 arrays ``a, b`` and a constant ``0 <= c <= INT32_MAX``."""
  return (b < INT32_MIN + c) | (a >= b - c)


def _le_plus(a, b, c: int):
  """Exactly ``a <= b + c`` for int32 arrays ``a, b`` and a constant ``0 <= c <= INT32_MAX``."""
  return (b > INT32_MAX - c) | (a <= b + c)


@dataclasses.dataclass(frozen=True)
class Full(MaskSpec):
  """Every key is visible to every query."""

  def visible(self, q, k):
    return jnp.ones(jnp.broadcast_shapes(jnp.shape(q), jnp.shape(k)), dtype=bool)

  def block_test(self, qb, kb):
    ones = _filled(True, qb.lo, kb.lo)
    return ones, ones


@dataclasses.dataclass(frozen=True)
class Causal(MaskSpec):
  """Key visible iff ``k <= q``."""

  def visible(self, q, k):
    return k <= q

  def block_test(self, qb, kb):
    return kb.lo <= qb.hi, kb.hi <= qb.lo


@dataclasses.dataclass(frozen=True)
class SlidingWindow(MaskSpec):
  """Key visible iff ``q - left <= k <= q + right``.

  Attributes:
    left: how many earlier keys each query sees besides its own position.
    right: how many later keys each query sees (0 for causal local attention).
  """

  left: int
  right: int = 0

  def __post_init__(self):
    fix = "Use a window size >= 0 (0 means only the token itself on that side)."
    _check_int("SlidingWindow", "left", self.left, 0, fix)
    _check_int("SlidingWindow", "right", self.right, 0, fix)

  def visible(self, q, k):
    return _ge_minus(k, q, self.left) & _le_plus(k, q, self.right)

  def block_test(self, qb, kb):
    # k - q ranges over [kb.lo - qb.hi, kb.hi - qb.lo] (every value when blocks are contiguous),
    # compared without forming the (possibly overflowing) differences.
    any_ = _le_plus(kb.lo, qb.hi, self.right) & _ge_minus(kb.hi, qb.lo, self.left)
    all_ = _le_plus(kb.hi, qb.lo, self.right) & _ge_minus(kb.lo, qb.hi, self.left)
    return any_, all_


@dataclasses.dataclass(frozen=True)
class ChunkedCausal(MaskSpec):
  """Key visible iff ``q // chunk == k // chunk and k <= q`` (Llama-4 style local chunks).

  Attributes:
    chunk: chunk length in tokens, >= 1.
  """

  chunk: int

  def __post_init__(self):
    _check_int("ChunkedCausal", "chunk", self.chunk, 1, "Use a chunk length of at least 1 token.")

  def visible(self, q, k):
    return (_floordiv(q, self.chunk) == _floordiv(k, self.chunk)) & (k <= q)

  def block_test(self, qb, kb):
    c = lambda x: _floordiv(x, self.chunk)
    overlap = (c(qb.lo) <= c(kb.hi)) & (c(kb.lo) <= c(qb.hi))
    any_ = overlap & (kb.lo <= qb.hi)
    one_chunk = (c(qb.lo) == c(qb.hi)) & (c(kb.lo) == c(kb.hi)) & (c(qb.lo) == c(kb.lo))
    all_ = one_chunk & (kb.hi <= qb.lo)
    return any_, all_


@dataclasses.dataclass(frozen=True)
class PrefixLM(MaskSpec):
  """Key visible iff ``k < prefix or k <= q`` (bidirectional prefix, causal after it).

  Attributes:
    prefix: length of the bidirectional prefix, >= 0.
  """

  prefix: int

  def __post_init__(self):
    _check_int("PrefixLM", "prefix", self.prefix, 0, "Use a prefix length >= 0 (0 is causal).")

  def visible(self, q, k):
    return (k < self.prefix) | (k <= q)

  def block_test(self, qb, kb):
    any_ = (kb.lo < self.prefix) | (kb.lo <= qb.hi)
    all_ = (kb.hi < self.prefix) | (kb.hi <= qb.lo)
    return any_, all_


_WARNED_ANONYMOUS = False


def _warn_if_anonymous(fn) -> None:
  """Warns once per process when a lambda or nested function makes a Custom mask: specs are jit
  static arguments compared by identity, so a fresh function every call recompiles every call."""
  global _WARNED_ANONYMOUS
  name = getattr(fn, "__qualname__", "")
  if _WARNED_ANONYMOUS or fn is None or not ("<lambda>" in name or "<locals>" in name):
    return
  _WARNED_ANONYMOUS = True
  validation.warn(
      f"masks.Custom({name}): mask specs are compared by identity of their functions, so a "
      "lambda or nested function created anew on every call recompiles attention on every call "
      "(seconds each). Define the function once at module level and reuse it (or build the "
      "Custom spec once). This warning is shown once.")


@dataclasses.dataclass(frozen=True)
class Custom(MaskSpec):
  """Key visible iff ``fn(q, k)``; ``fn`` must be elementwise and traceable.

  Without ``block_fn`` every block is treated as partially visible (correct, no skipping). A
  ``block_fn(q_lo, q_hi, k_lo, k_hi) -> (any_visible, all_visible)`` enables skipping; it must be
  sound (see the module docstring). ``fn`` and ``block_fn`` are compared by identity, so define
  them once (module-level functions) to keep jit caches warm.
  """

  fn: Callable[[Array, Array], Array]
  block_fn: Optional[Callable[..., tuple[Array, Array]]] = None

  def __post_init__(self):
    if not callable(self.fn):
      raise TypeError(f"Custom.fn must be callable (q, k) -> bool array, got {self.fn!r}.")
    if self.block_fn is not None and not callable(self.block_fn):
      raise TypeError(f"Custom.block_fn must be callable or None, got {self.block_fn!r}.")
    _warn_if_anonymous(self.fn)
    _warn_if_anonymous(self.block_fn)

  def visible(self, q, k):
    try:
      out = jnp.asarray(self.fn(q, k), dtype=bool)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError,
            ValueError) as e:
      if isinstance(e, ValueError) and "truth value" not in str(e):
        raise
      raise TypeError(
          f"masks.Custom.fn={self.fn!r} is not traceable: it is called on traced int32 position "
          "arrays (inside jit and the kernels), so it must use jax.numpy operations elementwise, "
          "not numpy, Python `if`/`and`/`or`, or int(). E.g. `lambda q, k: (k <= q) & "
          "(q - k < 128)`.") from e
    shape = jnp.broadcast_shapes(jnp.shape(q), jnp.shape(k))
    if out.ndim not in (0, len(shape)) or jnp.broadcast_shapes(out.shape, shape) != shape:
      raise ValueError(
          f"masks.Custom.fn={self.fn!r} returned shape {out.shape} for query and key positions "
          f"of shapes {jnp.shape(q)} and {jnp.shape(k)}: it must be elementwise, returning their "
          f"broadcast shape {shape} (or a scalar), not reduce over an axis.")
    return out

  def block_test(self, qb, kb):
    if self.block_fn is None:
      return _filled(True, qb.lo, kb.lo), _filled(False, qb.lo, kb.lo)
    shape = jnp.broadcast_shapes(jnp.shape(qb.lo), jnp.shape(kb.lo))
    try:
      any_, all_ = self.block_fn(qb.lo, qb.hi, kb.lo, kb.hi)
    except (TypeError, ValueError) as e:
      raise TypeError(
          f"masks.Custom.block_fn={self.block_fn!r} failed ({type(e).__name__}: {e}): it is "
          "called as block_fn(q_lo, q_hi, k_lo, k_hi) on int32 arrays of block bounds and must "
          "return a pair (any_visible, all_visible) of bool arrays, using jax.numpy "
          "operations.") from e
    return (jnp.broadcast_to(jnp.asarray(any_, bool), shape),
            jnp.broadcast_to(jnp.asarray(all_, bool), shape))


@dataclasses.dataclass(frozen=True)
class And(MaskSpec):
  """Visible iff both operands allow the pair."""

  a: MaskSpec
  b: MaskSpec

  def visible(self, q, k):
    return self.a.visible(q, k) & self.b.visible(q, k)

  def block_test(self, qb, kb):
    a_any, a_all = self.a.block_test(qb, kb)
    b_any, b_all = self.b.block_test(qb, kb)
    return a_any & b_any, a_all & b_all


@dataclasses.dataclass(frozen=True)
class Or(MaskSpec):
  """Visible iff either operand allows the pair."""

  a: MaskSpec
  b: MaskSpec

  def visible(self, q, k):
    return self.a.visible(q, k) | self.b.visible(q, k)

  def block_test(self, qb, kb):
    a_any, a_all = self.a.block_test(qb, kb)
    b_any, b_all = self.b.block_test(qb, kb)
    return a_any | b_any, a_all | b_all


def is_full(spec: MaskSpec) -> bool:
  """True when the spec is statically known to allow every pair."""
  if isinstance(spec, Full):
    return True
  if isinstance(spec, And):
    return is_full(spec.a) and is_full(spec.b)
  if isinstance(spec, Or):
    return is_full(spec.a) or is_full(spec.b)
  return False


def is_causal(spec: MaskSpec) -> bool:
  """True when the spec statically sees only keys at or before the query (``k <= q``)."""
  if isinstance(spec, (Causal, ChunkedCausal)):
    return True
  if isinstance(spec, SlidingWindow):
    return spec.right == 0
  if isinstance(spec, And):
    return is_causal(spec.a) or is_causal(spec.b)
  if isinstance(spec, Or):
    return is_causal(spec.a) and is_causal(spec.b)
  return False


def window_width(spec: MaskSpec) -> Optional[int]:
  """``left + right`` of the narrowest sliding window that statically bounds every query's keys
  (so every row sees at most that many keys besides its own), or None when none does."""
  if isinstance(spec, SlidingWindow):
    return spec.left + spec.right
  if isinstance(spec, And):
    widths = [w for w in (window_width(spec.a), window_width(spec.b)) if w is not None]
    return min(widths, default=None)
  return None


def key_bounds(spec: MaskSpec) -> tuple[Optional[int], Optional[int]]:
  """``(left, right)`` such that every key a query ``q`` sees lies in ``[q - left, q + right]``
  (None: unbounded on that side), as far as the spec's structure tells statically."""
  if isinstance(spec, SlidingWindow):
    return spec.left, spec.right
  if isinstance(spec, (Causal, ChunkedCausal)):
    return None, 0
  if isinstance(spec, And):  # the tighter bound of either side
    return tuple(min((x for x in pair if x is not None), default=None)
                 for pair in zip(key_bounds(spec.a), key_bounds(spec.b)))
  if isinstance(spec, Or):  # the looser one, bounded only where both are
    return tuple(None if None in pair else max(pair)
                 for pair in zip(key_bounds(spec.a), key_bounds(spec.b)))
  return None, None


__all__ = [
    "MaskSpec", "BlockBounds", "Full", "Causal", "SlidingWindow", "ChunkedCausal", "PrefixLM",
    "Custom", "And", "Or", "as_spec", "is_full", "is_causal", "window_width", "key_bounds",
]
