"""The optional operands of an attention call, each declared once.

The arrays a call may add to q, k, v and the token metadata (the dense mask, the additive bias,
ALiBi slopes, the FP8 descales, the sinks) are each described here by one ``Operand``: the
keyword that passes it (or, for the FP8 descales, what they are made from), how it is checked
and normalized, the role of each axis of the normalized array, whether the kernels read it (a
``kernels.common.Operands`` field) or it is merged around them (the sinks, which the entry
points take by name), and whether it has a gradient. The code that moves
operands iterates over ``DECLARED`` and reads the axis roles:

* ``call.check`` normalizes each given one into ``Arrays.terms`` (``normalize``);
* ``flash_attention`` pads its query and key axes to the tiles (``pad``);
* the ring cuts each step's key columns out of the operands that span the keys (``KEYS``);
* ``sharded_attention`` gives each a PartitionSpec (``spec``), which also hands Ulysses the
  heads of its devices;
* ``decode_attention`` repeats batch rows for its cache chunks (``repeat_batch``);
* ``pair.kernel_operands`` / ``pair.ops_grad`` build the kernels' ``Operands`` and the
  cotangents of the differentiable ones (additive logit terms of the ``TILE`` layout).

What an operand computes lives in ``reference`` and in each backend's kernels (and its score
term in ``kernels.common.score_terms``). A new operand is one more declaration here, one keyword
on the entry points, and its kernels.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from pallas_ring import validation

Array = Any

# Roles of the axes of a normalized operand.
BATCH = "batch"  # B, or 1 where it broadcasts over the batch
HEADS = "heads"  # N query heads, or 1 where it broadcasts over them
QUERIES = "queries"  # the call's T queries
KEYS = "keys"  # every key the call sees (a ring shard's: the R * S keys of the ring)
ONE = "one"  # size 1
PARTS = "parts"  # an axis of the operand's own parts, never cut or sharded
TILE = (BATCH, HEADS, QUERIES, KEYS)  # a [B|1, N|1, T, S] operand


class Dims(NamedTuple):
  """The sizes an operand is checked against: batch, query heads, queries and keys, and the
  dtype of per-head float terms (ALiBi slopes)."""

  b: int
  n: int
  t: int
  s: int
  terms_dtype: Any = jnp.float32  # float64 where the call computes in float64 (x64, xla)


@dataclasses.dataclass(frozen=True)
class Operand:
  """One optional operand of an attention call."""

  name: str  # key in ``call.Arrays.terms``; the ``common.Operands`` field when ``in_kernel``
  argument: str  # the entry points' keyword
  axes: tuple  # the role of each axis of the normalized array (BATCH, HEADS, ...)
  normalize: Callable  # (value, Dims) -> normalized array; raises naming ``argument``
  in_kernel: bool = True  # the kernels read it (else it is merged around them)
  # The entry points take it by ``argument`` (False: made from other arguments: the FP8
  # descales, from ``q_descale``, ``k_descale`` and ``v_descale`` by ``fp8.prepare``).
  keyword: bool = True
  differentiable: bool = False  # it has a gradient (else it is held with stop_gradient)
  # Not differentiable, but not a constant by design either (as the FP8 descales are): being
  # differentiated raises (``no_gradient``) rather than giving zeros silently.
  gradient_raises: bool = False

  def __post_init__(self):
    # A differentiable kernel operand is an additive logit term: its gradient is dS summed over
    # its broadcast axes (``pair.ops_grad``), which needs the tile layout.
    assert not (self.in_kernel and self.differentiable) or self.axes == TILE, self.name

  def axis(self, role: str) -> Optional[int]:
    """The index of the axis with ``role``, or None."""
    return self.axes.index(role) if role in self.axes else None

  def spec(self, x, *, batch, heads, rows) -> P:
    """The PartitionSpec of ``x`` over a mesh: broadcast axes replicated, the batch over
    ``batch``, heads over ``heads``, queries over ``rows`` and keys whole."""
    def one(role, size):
      if role == BATCH:
        return batch if size > 1 else None
      if role == HEADS:
        return heads if size > 1 else None
      return rows if role == QUERIES else None
    return P(*(one(r, d) for r, d in zip(self.axes, x.shape)))


def dense_mask_misuse(dense_mask, name: str = "dense_mask"):
  """Checks that a non-boolean dense mask holds only 0 and 1 (1 = visible, as Flax reads it).

  Concrete values are read: others (an additive ``0 / -inf`` mask) raise naming ``bias``. Traced
  values (under ``jit``) cannot be read while tracing: the caller poisons its output with NaN
  where the returned flag is True, so misuse is loud rather than silently wrong.

  Returns:
    None (nothing left to check: no mask, a bool mask, or concrete values), or a traced bool
    scalar, True when the mask holds a value other than 0 and 1 (NaN included).
  """
  if dense_mask is None:
    return None
  m = jnp.asarray(dense_mask)
  if m.dtype == bool:
    return None
  if isinstance(m, jax.core.Tracer):
    return jnp.any((m != 0) & (m != 1))
  values = np.unique(np.asarray(m))
  if not np.all((values == 0) | (values == 1)):
    raise ValueError(
        f"`{name}` has dtype {m.dtype} with values other than 0 and 1 (e.g. "
        f"{values[~((values == 0) | (values == 1))][0]}): a non-boolean dense mask is read as "
        "0 = masked, 1 = visible. An additive mask (0 visible, -inf masked) belongs in `bias`; "
        "or pass a bool mask (True = visible). (Under jit, where the values cannot be read, "
        "such a mask makes the output NaN.)")
  return None


def _dense_mask(m, d: Dims):
  """Bool ``[Bm, Nm, T, S]`` (Bm in {1, B}, Nm in {1, N}). A non-boolean mask must hold 0 / 1:
  concrete values are checked here; traced ones are left to the entry point, which poisons its
  output where they are not (``dense_mask_misuse``)."""
  full = validation.bnts_shape("dense_mask", m, d.b, d.n, d.t, d.s)
  dtype = m.dtype if hasattr(m, "dtype") else np.asarray(m).dtype
  if not (dtype == bool or jnp.issubdtype(dtype, jnp.integer)
          or jnp.issubdtype(dtype, jnp.floating)):
    raise TypeError(f"`dense_mask` has dtype {dtype}; it must be bool (True = visible), or an "
                    "integer or real float array of 0 and 1.")
  m = jnp.asarray(m)
  if not isinstance(m, jax.core.Tracer):
    dense_mask_misuse(m)
  m = m.reshape(full) if m.dtype == bool else (m.reshape(full) != 0)
  return jnp.broadcast_to(m, (full[0], full[1], d.t, d.s))


def _bias(x, d: Dims):
  """``[Bb, Nb, T, S]`` (Bb in {1, B}, Nb in {1, N}) in its own dtype (its gradient sums over
  the broadcast axes through autodiff)."""
  full = validation.bnts_shape("bias", x, d.b, d.n, d.t, d.s)
  validation.check_float("bias", x)
  return jnp.broadcast_to(jnp.reshape(x, full), (full[0], full[1], d.t, d.s))


def _alibi_slopes(x, d: Dims):
  """``[N]`` or ``[B, N]`` -> float32 ``[Ba, N, 1]`` (Ba in {1, B}; float64 for a float64
  call)."""
  shape = tuple(jnp.shape(x))
  if shape not in ((d.n,), (1, d.n), (d.b, d.n)):
    raise ValueError(f"`alibi_slopes` has shape {shape}; expected [N] = ({d.n},) or [B, N] = "
                     f"{(d.b, d.n)}: one slope per query head (and batch row).")
  validation.check_float("alibi_slopes", x)
  x = jnp.asarray(x, d.terms_dtype)
  return (x[None] if x.ndim == 1 else x)[..., None]


def _fp8_descales(x, d: Dims):
  """float32 ``[Bs, N, 3]`` (Bs in {1, B}): q's, k's and v's descales per query head, as
  ``fp8.prepare`` makes them from the entry points' ``q_descale``, ``k_descale``, ``v_descale``
  (which it checks)."""
  assert x.dtype == jnp.float32 and x.shape[0] in (1, d.b) and x.shape[1:] == (d.n, 3), x.shape
  return x


def _sinks(x, d: Dims):
  """``[N]`` sink logits, one per query head."""
  if tuple(jnp.shape(x)) != (d.n,):
    raise ValueError(f"`sinks` has shape {tuple(jnp.shape(x))}; expected [N] = ({d.n},), one "
                     "logit per query head.")
  validation.check_float("sinks", x)
  return jnp.asarray(x)


DECLARED = (
    Operand("dense", "dense_mask", TILE, _dense_mask),
    Operand("bias", "bias", TILE, _bias, differentiable=True),
    Operand("alibi", "alibi_slopes", (BATCH, HEADS, ONE), _alibi_slopes, gradient_raises=True),
    # (not differentiated: descales are constants; gradients reach the FP8 operands)
    Operand("fp8", "fp8_descales", (BATCH, HEADS, PARTS), _fp8_descales, keyword=False),
    Operand("sinks", "sinks", (HEADS,), _sinks, in_kernel=False, differentiable=True),
)
BY_NAME = {o.name: o for o in DECLARED}


def normalize(given: Mapping[str, Any], dims: Dims) -> dict:
  """``{name: normalized array}`` of the operands given (by keyword; None: absent)."""
  unknown = set(given) - {o.argument for o in DECLARED}
  assert not unknown, f"undeclared operands {sorted(unknown)}"
  terms = {}
  for o in DECLARED:
    value = given.get(o.argument)
    if value is not None:
      x = o.normalize(value, dims)
      if o.gradient_raises:
        x = no_gradient(o.argument, x)
      terms[o.name] = x if o.differentiable else jax.lax.stop_gradient(x)
  return terms


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def no_gradient(argument: str, x):
  """``x``; differentiating it raises, naming ``argument`` (its gradient is not implemented)."""
  return x


def _no_gradient_fwd(argument, x):
  if x.perturbed:
    raise NotImplementedError(
        f"`{argument}` is differentiated, but attention has no gradient with respect to it "
        "(q, k, v, `bias` and `sinks` have one): hold it constant with "
        f"jax.lax.stop_gradient({argument}), or pass its term as `bias` to learn it.")
  return x.value, None


def _no_gradient_bwd(argument, _, ct):
  return (None,)


no_gradient.defvjp(_no_gradient_fwd, _no_gradient_bwd, symbolic_zeros=True)


def spanning(terms: Mapping[str, Array], role: str) -> dict:
  """The operands of ``terms`` that have an axis with ``role``."""
  return {k: x for k, x in terms.items() if BY_NAME[k].axis(role) is not None}


def pad(terms: Mapping[str, Array], *, queries: int, keys: int) -> dict:
  """Each operand's query axis zero-padded to ``queries`` and key axis to ``keys``."""
  def one(name, x):
    o, widths = BY_NAME[name], [(0, 0)] * x.ndim
    for role, length in ((QUERIES, queries), (KEYS, keys)):
      if o.axis(role) is not None:
        widths[o.axis(role)] = (0, length - x.shape[o.axis(role)])
    return jnp.pad(x, widths) if any(w for _, w in widths) else x
  return {k: one(k, x) for k, x in terms.items()}


def map_axis(terms: Mapping[str, Array], role: str, fn: Callable) -> dict:
  """``fn(x, axis)`` on each operand with an axis of ``role``; the others unchanged."""
  return {k: (x if BY_NAME[k].axis(role) is None else fn(x, BY_NAME[k].axis(role)))
          for k, x in terms.items()}


def repeat_batch(terms: Mapping[str, Array], p: int) -> dict:
  """Each operand with a batch axis of B > 1 repeated ``p`` times per row (``[B * p, ...]``):
  the layout of ``decode_attention``'s cache chunks."""
  def one(x, axis):
    return x if x.shape[axis] == 1 else jnp.repeat(x, p, axis=axis)
  return map_axis(terms, BATCH, one)


def specs(terms: Mapping[str, Array], *, batch, heads, rows) -> dict:
  """``{name: PartitionSpec}`` of ``terms`` (``Operand.spec``)."""
  return {k: BY_NAME[k].spec(x, batch=batch, heads=heads, rows=rows) for k, x in terms.items()}


def in_kernel(terms: Mapping[str, Array]) -> dict:
  """The operands the kernels read (``common.Operands`` fields)."""
  return {k: x for k, x in terms.items() if BY_NAME[k].in_kernel}


__all__ = ["Operand", "Dims", "DECLARED", "BY_NAME", "BATCH", "HEADS", "QUERIES", "KEYS", "ONE",
           "PARTS", "dense_mask_misuse", "normalize", "spanning", "pad", "map_axis",
           "repeat_batch", "specs", "in_kernel"]
