"""FP8 inputs: ``quantize_fp8`` and the descale / ``out_dtype`` arguments of every entry point.

An FP8 operand ``x8`` (``float8_e4m3fn`` or ``float8_e5m2``) stands for
``x8.astype(float32) * descale`` with ``descale`` float32, a scalar or one value per batch row
and kv head ``[B, K]`` (a query's descale is its kv head group's; ``[B, N]``, one per query head,
is accepted too, as ``quantize_fp8(q)`` makes it). Descales are constants: gradients reach the
FP8 operands (in their FP8 dtype, where most values flush to zero: differentiating them
warns, ``watched``), not the descales. To train, ``quantize=...`` (flash, sharded and ring
attention) keeps 16-bit q, k, v to the custom VJPs, which quantize them (scales over the whole
sequence) and return their gradients straight through the quantization (``straight_through``).

``flash_attention`` and ``sharded_attention`` ``prepare`` their q, k, v: of one FP8 dtype they
stay FP8, their descales per query head become the ``fp8`` operand (``operands``: sharded and
handed to Ulysses' heads like the others), and each resolved backend takes them as they are
where its forward runs its matmuls in FP8 (``Backend.forward_reads_fp8``: Mosaic GPU), or
dequantized (``for_backend``); the backward's gradients are the dequantized values'
(``backward_operands``), computed on them or, where the backend's backward reads FP8
(``Backend.backward_reads_fp8``), on the FP8 operands themselves. ``ring_attention``
dequantizes them first: each device's descales may differ there, and a ring step reads another
device's K/V (its ``quantize=`` takes the maxima over the ring instead). Any other mix of FP8
and 16-bit operands is widened to the 16-bit compute dtype first. ``decode_attention`` instead
``fold``s the descales into q and the output, so that a backend whose decode kernels read an
FP8 cache (``Backend.decode_reads_fp8``: the GPU decode kernel; ``Backend.forward_reads_fp8_kv``:
the TPU forward kernel over cache chunks) reads one byte per element; elsewhere the cache is
widened in XLA before the kernels run.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple, Optional

import jax
from jax import custom_derivatives
import jax.numpy as jnp
import numpy as np

from pallas_ring import operands, pair
from pallas_ring.kernels.common import (dequantize, dequantize_kv, descale_of,
                                        quantize_with)

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
    maps to the dtype's largest finite value; an all-zero head gets descale 1, a head holding
    NaN or infinity descale NaN, which attention rejects where concrete and which makes its
    output NaN under jit).
  """
  dtype = jnp.dtype(dtype)
  if dtype not in FP8_DTYPES:
    raise ValueError(f"`dtype`={dtype} is not an FP8 dtype attention takes; use one of "
                     f"{[str(d) for d in FP8_DTYPES]}.")
  if np.ndim(x) != 4:
    raise ValueError(f"`x` must have rank 4 ([batch, seq, heads, head_dim]), got shape "
                     f"{tuple(np.shape(x))}.")
  descale = descale_of(x, dtype)
  return quantize_with(x, descale, dtype), descale


def _descale_per_head(name: str, descale, x, b: int, kv_heads: int):
  """``descale`` (scalar, ``[B, K]``, or ``[B, N]`` for q) as float32 ``[B|1, 1, heads, 1]``.
  Concrete values must be positive and finite (traced ones cannot be read here)."""
  shape, heads = tuple(np.shape(descale)), x.shape[2]
  d = jnp.asarray(descale, jnp.float32)
  if not isinstance(d, jax.core.Tracer):
    values = np.asarray(d).ravel()
    bad = values[~(np.isfinite(values) & (values > 0))]
    if bad.size:
      raise ValueError(f"`{name}` holds values that are not positive and finite (e.g. {bad[0]}): "
                       "a descale multiplies the FP8 values back to their range; an all-zero "
                       "head takes 1 (pallas_ring.quantize_fp8 makes them).")
  if shape in ((), (1,)):
    return d.reshape(1, 1, 1, 1)
  if shape == (b, heads):
    return d[:, None, :, None]
  if shape == (b, kv_heads) and heads % kv_heads == 0:  # a query head takes its group's
    return jnp.repeat(d, heads // kv_heads, axis=1)[:, None, :, None]
  want = f"[B, K] = {(b, kv_heads)}" + (f" or [B, N] = {(b, heads)}" if heads != kv_heads else "")
  raise ValueError(f"`{name}` has shape {shape}; it must be a scalar or {want}: one float32 "
                   "value per batch row and kv head (pallas_ring.quantize_fp8 makes it).")


def _scales(q, k, v, descales, out_dtype, names):
  """Checks a call's FP8 arguments.

  Returns:
    ``(scales, compute, out_dtype)``: per operand name the float32 descale as
    ``[B|1, 1, heads, 1]`` (None for a 16/32-bit operand), the compute dtype (the first
    non-FP8 operand's, else bfloat16) and the checked output dtype.
  """
  ops = dict(zip(names, (q, k, v)))
  descale_names = dict(zip(names, ("q_descale", "k_descale", "v_descale")))
  wide = [jnp.result_type(x) for x in ops.values() if not is_fp8(x)]
  compute = wide[0] if wide else jnp.dtype(jnp.bfloat16)
  b, kv_heads = np.shape(k)[0], np.shape(k)[2] if np.ndim(k) == 4 else None
  scales = {}
  for (name, x), d in zip(ops.items(), descales):
    dname, scales[name] = descale_names[name], None
    if is_fp8(x):
      if d is None:
        raise ValueError(f"`{name}` is {jnp.result_type(x)} but `{dname}` is None: an FP8 "
                         f"operand needs its descale (float32, a scalar or [B, K]); make both "
                         f"with `x8, {dname} = pallas_ring.quantize_fp8(x)`.")
      if np.ndim(x) == 4:  # (validation names a wrong rank)
        scales[name] = _descale_per_head(dname, d, x, b, kv_heads)
    elif d is not None:
      raise ValueError(f"`{dname}` was given but `{name}` is {jnp.result_type(x)}, not FP8: "
                       f"descales apply to float8_e4m3fn / float8_e5m2 operands only. Drop "
                       f"`{dname}`, or pass the quantized `{name}`.")
    elif jnp.issubdtype(jnp.result_type(x), jnp.floating) and jnp.finfo(
        jnp.result_type(x)).bits == 8:
      raise TypeError(f"`{name}` has dtype {jnp.result_type(x)}; the FP8 dtypes attention "
                      f"takes are {[str(t) for t in FP8_DTYPES]}. Convert it, e.g. "
                      f"`pallas_ring.quantize_fp8({name}.astype(jnp.float32))`.")
  if out_dtype is None:  # (q's own dtype is checked with q)
    return scales, compute, jnp.dtype(jnp.bfloat16 if is_fp8(q) else jnp.result_type(q))
  out_dtype = jnp.dtype(out_dtype)
  if not jnp.issubdtype(out_dtype, jnp.floating) or out_dtype in FP8_DTYPES:
    raise ValueError(f"`out_dtype`={out_dtype} is not an output dtype attention gives; use "
                     "bfloat16, float16, float32 (or float64 with backend='xla'), or None for "
                     "q's dtype.")
  return scales, compute, out_dtype


def _widened(ops, scales, compute):
  """Each of ``ops`` times its descale (a constant: not differentiated) in ``compute`` (None: as
  it is)."""
  return [x if d is None else (x.astype(jnp.float32) * jax.lax.stop_gradient(d)).astype(compute)
          for x, d in zip(ops, scales)]


class Prepared(NamedTuple):
  """The FP8 arguments of a call with an FP8 forward (``prepare``)."""

  q: Any  # FP8 as given where ``descales`` is set, else widened
  k: Any
  v: Any
  descales: Optional[Any]  # float32 [Bs, N, 3] (``kernel_descales``) or None
  compute: Any  # the dtype the call computes in
  out_dtype: Any  # the output's


def prepare(q, k, v, q_descale=None, k_descale=None, v_descale=None, out_dtype=None,
            read_fp8: bool = True, quantize_to=None, axis_name=None):
  """Checks a call's FP8 arguments and prepares its operands for kernels that may read FP8
  (``read_fp8``; False: every FP8 operand is widened here): q, k and v of one FP8 dtype stay
  FP8, with their descales per query head (``kernel_descales``: the ``fp8`` operand,
  ``operands``), for a backend with ``forward_reads_fp8`` (``for_backend`` dequantizes them for
  the others); any other mix is widened here. ``quantize_to``: the call's ``quantize``
  (``straight_through``, with ``axis_name``)."""
  if quantize_to is not None:
    return straight_through(q, k, v, quantize_to, (q_descale, k_descale, v_descale), out_dtype,
                            axis_name)
  scales, compute, out_dtype = _scales(q, k, v, (q_descale, k_descale, v_descale), out_dtype,
                                       ("q", "k", "v"))
  dtypes = {jnp.result_type(x) for x in (q, k, v)}
  q, k, v = _watch(q, k, v)
  # (a scale is None for an operand of a wrong rank, which validation names)
  if read_fp8 and len(dtypes) == 1 and is_fp8(q) and None not in scales.values():
    return Prepared(q, k, v, kernel_descales(*scales.values(), np.shape(q)[2]), compute,
                    out_dtype)
  return Prepared(*_widened((q, k, v), scales.values(), compute), None, compute, out_dtype)


def straight_through(q, k, v, dtype, descales, out_dtype, axis_name=None) -> Prepared:
  """A call's ``quantize=dtype``: float (16/32-bit, or 64 under x64) q, k, v to be quantized to
  FP8 inside the custom VJPs (``quantize``) for a forward on FP8 operands, their gradients
  straight through the quantization (the backward's, at the quantized values, in q's, k's and
  v's own dtypes: ``backward_operands``).

  Args:
    q, k, v: the call's operands; dtype: ``quantize``; descales: the call's three descale
      arguments (all None); out_dtype: the call's (None: q's).
    axis_name: a mesh axis the sequence is sharded over (``ring_attention``): the maxima are
      taken over it too, so that every shard has the same descales.

  Returns:
    ``Prepared``: q, k, v as given, their descales per query head (``quantize_fp8``'s scales
    per batch row and head, not differentiated), bfloat16 compute and the output dtype.
  """
  try:
    fp8_dtype = jnp.dtype(dtype) if not isinstance(dtype, bool) else None
  except TypeError:
    fp8_dtype = None
  if fp8_dtype not in FP8_DTYPES:
    given = repr(dtype) if fp8_dtype is None else fp8_dtype
    raise ValueError(f"`quantize`={given} is not an FP8 dtype; use one of "
                     f"{[str(d) for d in FP8_DTYPES]}, or None.")
  for name, x in zip("qkv", (q, k, v)):
    if is_fp8(x) or not jnp.issubdtype(jnp.result_type(x), jnp.floating):
      raise ValueError(f"`quantize` quantizes 16/32/64-bit floats, but `{name}` has dtype "
                       f"{jnp.result_type(x)}. Pass the unquantized `{name}`, or drop "
                       "`quantize` and pass FP8 operands with their descales.")
  if any(d is not None for d in descales):
    raise ValueError("`quantize` makes the descales itself: drop `q_descale`, `k_descale` and "
                     "`v_descale`, or drop `quantize` and pass FP8 operands with them.")
  scales = [descale_of(jax.lax.stop_gradient(x), dtype) for x in (q, k, v)]  # [B, heads]
  if axis_name is not None:
    scales = [jax.lax.pmax(d, axis_name) for d in scales]
  descales = kernel_descales(*(d[:, None, :, None] for d in scales), np.shape(q)[2])
  out_dtype = jnp.result_type(q) if out_dtype is None else out_dtype
  return Prepared(q, k, v, descales, jnp.dtype(jnp.bfloat16), out_dtype)


def quantize(q, k, v, descales, dtype):
  """``dequantize``'s inverse: q, k, v divided by their descales (``[Bs, N, 3]``) in the FP8
  ``dtype``, values beyond its range saturated (``quantize_with``)."""
  group = q.shape[2] // k.shape[2]
  return tuple(quantize_with(x, descales[:, ::g, i], dtype)
               for i, (x, g) in enumerate(((q, 1), (k, group), (v, group))))


def kernel_descales(q_scale, k_scale, v_scale, n: int):
  """float32 ``[Bs, N, 3]``: q's, k's and v's descales (``[B|1, 1, heads|1, 1]`` each, as
  ``_scales`` gives them) per batch row and query head."""
  per_head = [jnp.broadcast_to(_to_query_heads(d, n)[:, 0, :, 0], (d.shape[0], n))
              for d in (q_scale, k_scale, v_scale)]
  bs = max(d.shape[0] for d in per_head)
  return jnp.stack([jnp.broadcast_to(d, (bs, n)) for d in per_head], axis=-1)


def for_backend(lowering, q, k, v, terms, quantize_to=None):
  """A call's FP8 q, k, v (``prepare``; their descales the ``fp8`` operand of its ``terms``)
  as one resolved backend takes them: as they are where it reads FP8
  (``Backend.forward_reads_fp8``), else dequantized (and the operand dropped). With
  ``quantize_to`` (``straight_through``'s 16/32-bit q, k, v): as they are (the custom VJPs
  quantize them), else at their quantized values, their gradients straight through.

  Returns:
    ``((q, k, v), terms, compute, quantize)``: ``compute`` the dtype the call computes in,
    ``quantize`` the FP8 dtype its custom VJP quantizes q, k, v to (``quantize_to`` where the
    backend reads FP8, else None): the dtype its tiles are chosen for where given.
  """
  descales = terms.get("fp8")
  compute = compute_dtype(q, descales)
  if descales is None or lowering.forward_reads_fp8:
    return (q, k, v), terms, compute, None if descales is None else quantize_to
  rest = {name: x for name, x in terms.items() if name != "fp8"}
  if quantize_to is None:
    return dequantize(q, k, v, descales, compute), rest, compute, None
  at = dequantize(*quantize(q, k, v, descales, quantize_to), descales, jnp.float32)
  through = lambda x, y: (x + jax.lax.stop_gradient(y - x)).astype(compute)
  widened = tuple(through(x.astype(jnp.float32), y) for x, y in zip((q, k, v), at))
  return widened, rest, compute, None


def compute_dtype(q, descales):
  """The dtype a call computes in: q's, or bfloat16 for FP8 q, k, v with their ``descales``
  (``_scales``' rule where every operand is FP8)."""
  return jnp.dtype(q.dtype if descales is None else jnp.bfloat16)


def backward_operands(q, k, v, descales, primals=None):
  """A custom VJP's backward operands: ``((q, k, v), cotangents)``, FP8 q, k, v dequantized
  (``compute_dtype``) where ``descales`` is given (else as they are), and ``cotangents(dq, dk,
  dv)`` casting the backward's gradients to the primal operands' dtypes (FP8 ones through the
  dequantization's VJP: the descales are constants). ``primals``: arrays of the dtypes of the
  16/32-bit operands that the VJP quantized itself (``straight_through``), whose gradients are
  the backward's, cast."""
  cast = lambda dtypes: lambda *g: tuple(x.astype(p.dtype) for x, p in zip(g, dtypes))
  if descales is None:
    return (q, k, v), cast((q, k, v))
  dtype = compute_dtype(q, descales)
  if primals is not None:
    return dequantize(q, k, v, descales, dtype), cast(primals)
  wide, vjp = jax.vjp(lambda *x: dequantize(*x, descales, dtype), q, k, v)
  return wide, lambda *g: vjp(tuple(x.astype(w.dtype) for x, w in zip(g, wide)))


def ring_operands(q, k, v, terms: dict, primals, lowering):
  """``backward_operands`` for a backward ring: ``((q, (k, v), step_kv, terms), cotangents)`` with
  FP8 k and v kept as they are, so that they travel as FP8 bytes, and ``step_kv((k, v))``
  dequantizing a step's pair, the ``fp8`` operand dropped from ``terms`` (the ring's operands).
  Where ``lowering``'s backward reads FP8 (``Backend.backward_reads_fp8``) and no term is
  differentiable (their gradients read q and k), q stays FP8 too, ``step_kv`` is the identity and
  ``terms`` keep the descales. The ring's shards share their descales (``quantize=``'s are the
  ring's maxima; FP8 inputs' are the caller's, for the whole sequence)."""
  descales = terms.get("fp8")
  (q_wide, k_wide, v_wide), cotangents = backward_operands(q, k, v, descales, primals)
  if descales is None:
    return (q_wide, (k_wide, v_wide), lambda kv: kv, terms), cotangents
  if lowering.backward_reads_fp8 and not any(
      operands.BY_NAME[name].differentiable for name in terms):
    return (q, (k, v), lambda kv: kv, terms), cotangents
  group = q.shape[2] // k.shape[2]
  step_kv = lambda kv: dequantize_kv(*kv, descales, group, q_wide.dtype)
  rest = {name: x for name, x in terms.items() if name != "fp8"}
  return (q_wide, (k, v), step_kv, rest), cotangents


def quantized_primals(q, k, v, descales, dtype):
  """A custom VJP's forward under ``quantize=`` (``dtype``; None: off, or the backend took the
  quantized values already: ``for_backend``): ``((q8, k8, v8), primals)``, ``primals`` the
  dtypes ``backward_operands`` casts the gradients to; else ``((q, k, v), None)``."""
  if dtype is None or descales is None:
    return (q, k, v), None
  return quantize(q, k, v, descales, dtype), tuple(jnp.zeros((0,), x.dtype) for x in (q, k, v))


@jax.custom_vjp
def watched(*operands):
  """The identity on FP8 operands that warns when they are differentiated: their cotangents are
  FP8 too (the dequantized value's gradient times its descale), so most entries underflow to
  zero, silently otherwise."""
  return operands


def _watch(*operands):
  """``operands`` with the FP8 ones ``watched`` (forward mode raises the entry points' error)."""
  at = [i for i, x in enumerate(operands) if is_fp8(x)]
  if not at:
    return operands
  with pair.forward_mode_errors():
    watched_ops = watched(*(operands[i] for i in at))
  out = list(operands)
  for i, x in zip(at, watched_ops):
    out[i] = x
  return tuple(out)


def _watched_fwd(*operands):
  if any(x.perturbed for x in operands):
    warnings.warn(
        "Differentiating attention with respect to FP8 q, k or v (directly or through "
        "quantize_fp8): their gradients are FP8 as well (the dequantized value's gradient times "
        "its descale) and lose most entries to underflow. To train with FP8 operands, pass "
        "16-bit q, k and v with flash_attention(..., quantize=jnp.float8_e4m3fn).")
  return tuple(x.value for x in operands), None


def _watched_bwd(_, cts):
  return tuple(None if isinstance(ct, custom_derivatives.SymbolicZero) else ct for ct in cts)


watched.defvjp(_watched_fwd, _watched_bwd, symbolic_zeros=True)


def _to_query_heads(scale, n: int):
  """A kv head's ``[B|1, 1, K|1, 1]`` descale repeated over its query heads: ``[., 1, N|1, 1]``."""
  return scale if scale.shape[2] == 1 else jnp.repeat(scale, n // scale.shape[2], axis=2)


def fold(q, k, v, q_descale=None, k_descale=None, v_descale=None, out_dtype=None,
         names=("q", "k", "v")):
  """FP8 operands for a forward-only call whose kernels read an FP8 cache (``decode_attention``).

  The logits are linear in each key and the output in each value, so k's descale is folded into
  q (``q . (k8 d) = (q d) . k8``, per kv head group) and v's into the output: K/V stay FP8 in
  memory, read at one byte per element, and a kernel only widens them as it loads a tile.

  Returns:
    ``(q, k, v, v_scale, out_dtype)``: q widened with its and k's descale folded in, k and v
    unchanged, and ``v_scale`` (float32 ``[B|1, 1, N|1, 1]``, or None) to multiply the output by.
  """
  scales, compute, out_dtype = _scales(q, k, v, (q_descale, k_descale, v_descale), out_dtype,
                                       names)
  qs, ks, vs = scales.values()
  n = np.shape(q)[2]
  if qs is not None or ks is not None:
    scale = (1.0 if qs is None else qs) * (1.0 if ks is None else _to_query_heads(ks, n))
    q = (q.astype(jnp.float32) * scale).astype(compute)
  return q, k, v, None if vs is None else _to_query_heads(vs, n), out_dtype


def cast_output(result, out_dtype, scale=None):
  """The output of ``(out, lse)`` or ``out`` times ``scale`` (``fold``'s ``v_scale``; None for
  none) in ``out_dtype`` (the lse stays float32)."""
  out, rest = (result[0], result[1:]) if isinstance(result, tuple) else (result, None)
  if scale is not None:
    out = out.astype(jnp.float32) * scale
  out = out.astype(out_dtype)
  return out if rest is None else (out, *rest)


__all__ = ["quantize_fp8", "descale_of", "quantize_with", "prepare", "Prepared",
           "kernel_descales", "for_backend", "compute_dtype", "dequantize", "quantize",
           "straight_through", "quantized_primals", "backward_operands", "ring_operands",
           "fold", "cast_output", "is_fp8", "FP8_DTYPES"]
