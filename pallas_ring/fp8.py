"""FP8 inputs: ``quantize_fp8`` and the descale / ``out_dtype`` arguments of every entry point.

An FP8 operand ``x8`` (``float8_e4m3fn`` or ``float8_e5m2``) stands for
``x8.astype(float32) * descale`` with ``descale`` float32, a scalar or one value per batch row
and kv head ``[B, K]`` (a query's descale is its kv head group's; ``[B, N]``, one per query head,
is accepted too, as ``quantize_fp8(q)`` makes it). ``with_fp8`` adds ``q_descale``, ``k_descale``,
``v_descale`` and ``out_dtype`` to an entry point: it checks them, widens the FP8 operands to the
16-bit compute dtype (the kernels' contract: softmax and accumulation in float32) and casts the
output. The widening is an XLA convert that fuses with the kernels' input padding; the kernels
do not read FP8 from memory yet (BENCHMARKS.md says what that costs).
"""

from __future__ import annotations

import functools
import inspect
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def is_fp8(x) -> bool:
  """Whether ``x`` is an array of one of the FP8 dtypes attention takes."""
  return jnp.result_type(x) in FP8_DTYPES


def quantize_fp8(x, dtype=jnp.float8_e4m3fn):
  """Quantizes ``x [B, L, heads, H]`` to FP8 with one scale per batch row and head.

  Args:
    x: a float array ``[B, L, heads, H]`` (q, k, v or a cache).
    dtype: ``jnp.float8_e4m3fn`` (default) or ``jnp.float8_e5m2``.

  Returns:
    ``(x8, descale)``: ``x8`` in ``dtype``, ``descale`` float32 ``[B, heads]`` with
    ``x ~= x8.astype(float32) * descale[:, None, :, None]`` (the amax of each batch row and head
    maps to the dtype's largest finite value; an all-zero head gets descale 1).
  """
  dtype = jnp.dtype(dtype)
  if dtype not in FP8_DTYPES:
    raise ValueError(f"`dtype`={dtype} is not an FP8 dtype attention takes; use one of "
                     f"{[str(d) for d in FP8_DTYPES]}.")
  if np.ndim(x) != 4:
    raise ValueError(f"`x` must have rank 4 ([batch, seq, heads, head_dim]), got shape "
                     f"{tuple(np.shape(x))}.")
  xf = jnp.asarray(x, jnp.float32)
  top = float(jnp.finfo(dtype).max)
  amax = jnp.max(jnp.abs(xf), axis=(1, 3))  # [B, heads]
  descale = jnp.where(amax > 0, amax / top, 1.0).astype(jnp.float32)
  x8 = jnp.clip(xf / descale[:, None, :, None], -top, top).astype(dtype)
  return x8, descale


def _descale_per_head(name: str, descale, x, b: int, kv_heads: int):
  """``descale`` (scalar, ``[B, K]``, or ``[B, N]`` for q) as float32 ``[B|1, 1, heads, 1]``."""
  shape, heads = tuple(np.shape(descale)), x.shape[2]
  d = jnp.asarray(descale, jnp.float32)
  if shape in ((), (1,)):
    return d.reshape(1, 1, 1, 1)
  if shape == (b, heads):
    return d[:, None, :, None]
  if shape == (b, kv_heads) and heads % kv_heads == 0:  # a query head takes its group's
    return jnp.repeat(d, heads // kv_heads, axis=1)[:, None, :, None]
  want = f"[B, K] = {(b, kv_heads)}" + (f" or [B, N] = {(b, heads)}" if heads != kv_heads else "")
  raise ValueError(f"`{name}` has shape {shape}; it must be a scalar or {want}: one float32 "
                   "value per batch row and kv head (pallas_ring.quantize_fp8 makes it).")


def widen(q, k, v, q_descale=None, k_descale=None, v_descale=None, out_dtype=None,
          names=("q", "k", "v")):
  """Checks the FP8 arguments of a call and widens its FP8 operands.

  Args:
    q: ``[B, T, N, H]``; k: ``[B, S, K, H]``; v: ``[B, S, K, Hv]`` (any may be FP8).
    q_descale, k_descale, v_descale: float32 scalar or ``[B, K]`` for each FP8 operand; None
      for the others.
    out_dtype: the output dtype; None: q's dtype, or bfloat16 when q is FP8.
    names: the caller's names of q, k, v (for errors).

  Returns:
    ``(q, k, v, out_dtype)``: FP8 operands as ``x8 * descale`` in the compute dtype (the first
    non-FP8 operand's dtype, else bfloat16), the others unchanged.
  """
  ops = dict(zip(names, (q, k, v)))
  descales = dict(zip(names, (q_descale, k_descale, v_descale)))
  descale_names = dict(zip(names, ("q_descale", "k_descale", "v_descale")))
  wide = [jnp.result_type(x) for x in ops.values() if not is_fp8(x)]
  compute = wide[0] if wide else jnp.dtype(jnp.bfloat16)
  b, kv_heads = np.shape(k)[0], np.shape(k)[2] if np.ndim(k) == 4 else None
  for name, x in ops.items():
    d, dname = descales[name], descale_names[name]
    if is_fp8(x):
      if d is None:
        raise ValueError(f"`{name}` is {jnp.result_type(x)} but `{dname}` is None: an FP8 "
                         f"operand needs its descale (float32, a scalar or [B, K]); make both "
                         f"with `x8, {dname} = pallas_ring.quantize_fp8(x)`.")
      if np.ndim(x) != 4:
        continue  # (validation names the rank)
      scale = _descale_per_head(dname, d, x, b, kv_heads)
      ops[name] = (x.astype(jnp.float32) * scale).astype(compute)
    elif d is not None:
      raise ValueError(f"`{dname}` was given but `{name}` is {jnp.result_type(x)}, not FP8: "
                       f"descales apply to float8_e4m3fn / float8_e5m2 operands only. Drop "
                       f"`{dname}`, or pass the quantized `{name}`.")
    elif jnp.issubdtype(jnp.result_type(x), jnp.floating) and jnp.finfo(
        jnp.result_type(x)).bits == 8:
      raise TypeError(f"`{name}` has dtype {jnp.result_type(x)}; the FP8 dtypes attention "
                      f"takes are {[str(t) for t in FP8_DTYPES]}. Convert it, e.g. "
                      f"`pallas_ring.quantize_fp8({name}.astype(jnp.float32))`.")
  if out_dtype is None:
    out_dtype = jnp.bfloat16 if is_fp8(q) else jnp.result_type(q)
  out_dtype = jnp.dtype(out_dtype)
  if not jnp.issubdtype(out_dtype, jnp.floating) or out_dtype in FP8_DTYPES:
    raise ValueError(f"`out_dtype`={out_dtype} is not an output dtype attention gives; use "
                     "bfloat16, float16, float32 (or float64 with backend='xla'), or None for "
                     "q's dtype.")
  return (*ops.values(), out_dtype)


def _cast(result, out_dtype):
  """Casts the output of ``(out, lse)`` or ``out`` (the lse stays float32)."""
  if isinstance(result, tuple):
    return (result[0].astype(out_dtype),) + tuple(result[1:])
  return result.astype(out_dtype)


_KEYWORDS = ("q_descale", "k_descale", "v_descale", "out_dtype")


def with_fp8(fn):
  """Adds ``q_descale``, ``k_descale``, ``v_descale`` and ``out_dtype`` (keyword-only, default
  None) to an entry point ``fn(q, k, v, ...)``: FP8 operands are widened (``widen``) before
  ``fn`` and its output cast to ``out_dtype``."""

  sig = inspect.signature(fn)
  names = tuple(sig.parameters)[:3]  # (q, k, v) or (q, k_cache, v_cache)

  @functools.wraps(fn)
  def wrapped(*args, q_descale=None, k_descale=None, v_descale=None,
              out_dtype: Optional[jax.typing.DTypeLike] = None, **kwargs):
    bound = sig.bind(*args, **kwargs)
    *qkv, out = widen(*(bound.arguments[n] for n in names), q_descale, k_descale, v_descale,
                      out_dtype, names=names)
    bound.arguments.update(zip(names, qkv))
    return _cast(fn(*bound.args, **bound.kwargs), out)

  extra = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None)
           for name in _KEYWORDS]
  wrapped.__signature__ = sig.replace(parameters=list(sig.parameters.values()) + extra)
  return wrapped


__all__ = ["quantize_fp8", "widen", "with_fp8", "is_fp8", "FP8_DTYPES"]
