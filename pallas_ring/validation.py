"""Trace-time argument checks. Each error names the argument, its value or shape, the rule and
the fix."""

from __future__ import annotations

import functools
import os
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def warn(message: str, category=UserWarning) -> None:
  """``warnings.warn`` pointing at the user's line: the first frame outside this package (and
  outside generated code such as a dataclass's ``__init__``), JAX and Flax."""
  level, frame = 1, sys._getframe(1)
  while frame is not None:
    name = os.path.abspath(frame.f_code.co_filename)
    if not (name.startswith(_PACKAGE_DIR) or frame.f_code.co_filename == "<string>"
            or f"{os.sep}jax{os.sep}" in name or f"{os.sep}flax{os.sep}" in name):
      break
    frame, level = frame.f_back, level + 1
  warnings.warn(message, category, stacklevel=level + 1)


def _shape(x):
  return tuple(np.shape(x))


def check_float(name, x):
  dt = jnp.result_type(x)
  if not jnp.issubdtype(dt, jnp.floating):
    raise TypeError(f"`{name}` has dtype {dt}; attention needs a real floating dtype "
                    f"(bfloat16, float16 or float32). Cast it, e.g. `{name}.astype(jnp.bfloat16)`.")


def check_qkv(q, k, v) -> None:
  """Ranks, head counts, head dims and dtypes of q ``[B, T, N, H]``, k ``[B, S, K, H]`` and
  v ``[B, S, K, Hv]`` (``Hv`` may differ from ``H``: DeepSeek-style MLA)."""
  for name, x in (("q", q), ("k", k), ("v", v)):
    if np.ndim(x) != 4:
      raise ValueError(f"`{name}` must have rank 4 ([batch, seq, heads, head_dim]), got shape "
                       f"{_shape(x)}. Add the missing axes, e.g. `x[None]` for batch 1.")
    check_float(name, x)
  (b, _, n, h), (bk, s, kh, hk), vs = _shape(q), _shape(k), _shape(v)
  if vs[:3] != (bk, s, kh):
    raise ValueError(f"`k` and `v` must agree on [batch, seq, kv_heads], got k {(bk, s, kh, hk)} "
                     f"and v {vs} (only their head dims may differ: v [B, S, K, Hv]).")
  if vs[3] == 0:
    raise ValueError(f"`v` has head dim 0 (shape {vs}); it must be >= 1.")
  if bk != b:
    raise ValueError(f"batch sizes differ: q has {b} (shape {_shape(q)}), k/v have {bk}.")
  if hk != h:
    raise ValueError(f"head dims differ: q has H={h}, k/v have H={hk}; project them to the same "
                     "head_dim.")
  if kh == 0 or n % kh:
    raise ValueError(f"q heads N={n} must be a multiple of k/v heads K={kh} (MHA: K=N, GQA: "
                     "N % K == 0, MQA: K=1); change num_heads or num_kv_heads.")
  if h == 0 or np.shape(q)[1] == 0 or s == 0:
    raise ValueError(f"empty attention: q {_shape(q)}, k {_shape(k)}; sequences and head_dim "
                     "must be >= 1.")
  varying = sorted(set().union(*(_varying_axes(x) for x in (q, k, v))))
  if varying:
    raise ValueError(
        f"pallas_ring attention was called inside `jax.shard_map` with check_vma=True (q, k, v "
        f"vary along mesh axes {varying}). Its kernels' outputs and loop carries do not carry "
        "shard_map's varying-axes types yet, so JAX would reject them: pass check_vma=False to "
        "that `jax.shard_map`, or call pallas_ring.sharded_attention on global arrays (it runs "
        "the ring in its own shard_map).")


def _varying_axes(x) -> frozenset:
  """The mesh axes ``x`` varies along under ``shard_map(check_vma=True)``; empty elsewhere."""
  try:
    aval = jax.typeof(x)
  except TypeError:  # not an array type (e.g. a nested list; converted later)
    return frozenset()
  mat = getattr(aval, "manual_axis_type", None)
  if mat is not None:
    return frozenset(getattr(mat, "varying", ()))
  return frozenset(getattr(aval, "vma", ()))


def check_positive(name: str, value, default):
  if value is None:
    return default
  if isinstance(value, (str, bytes)):
    raise TypeError(f"`{name}`={value!r} is a string: it must be a Python number.")
  try:
    fval = float(value)
  except TypeError:
    raise TypeError(f"`{name}` must be a Python number, got {type(value).__name__}.") from None
  if not fval > 0 or not np.isfinite(fval):
    raise ValueError(f"`{name}`={value!r} is invalid: it must be a finite number > 0"
                     f"{' (or None for no cap)' if name == 'softcap' else ''}.")
  return fval


def check_flag(name: str, value) -> bool:
  """A static on/off argument: a Python or NumPy bool (not a string, number or array, whose
  truth would be read silently)."""
  if isinstance(value, (bool, np.bool_)):
    return bool(value)
  raise TypeError(f"`{name}`={value!r} must be True or False (a Python or NumPy bool), got "
                  f"{type(value).__name__}.")


INT32_MIN, INT32_MAX = -2**31, 2**31 - 1  # the range of the positions and ids the kernels compare


def _wider_than_int32(dtype) -> bool:
  return jnp.iinfo(dtype).max > INT32_MAX


def dtype_of(x):
  """``x``'s own dtype: a NumPy array's (or a list's, as NumPy reads it) as it is, since with x64
  off ``jnp.result_type`` reads int64 as int32 (and the values would wrap unchecked); else JAX's.
  """
  if isinstance(x, (list, tuple)):
    x = np.asarray(x)
  return x.dtype if isinstance(x, (np.ndarray, np.generic)) else jnp.result_type(x)


def check_token_array(name: str, x, b: int, length: int, allow_1d: bool = False) -> None:
  """``[B, L]`` (or ``[L]`` when ``allow_1d``) integer per-token arrays."""
  if x is None:
    return
  shape = _shape(x)
  ok = shape == (b, length) or (allow_1d and shape in ((length,), (1, length)))
  if not ok:
    want = f"[{b}, {length}]" + (f" or [{length}]" if allow_1d else "")
    raise ValueError(f"`{name}` has shape {shape}; expected {want} to match the sequence it "
                     "describes.")
  dtype = dtype_of(x)
  if not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(f"`{name}` has dtype {dtype}; it must be an integer array "
                    f"(cast with `.astype(jnp.int32)`).")
  if _wider_than_int32(dtype) and not isinstance(x, jax.core.Tracer):
    # The kernels compare int32 values: wider ones are read here where they are concrete (traced
    # ones, under jit, poison the entry points' output: ``int32_overflow``).
    values = np.asarray(x)  # (on the host: np.min of a jax Array would stage into a trace)
    lo, hi = int(values.min()), int(values.max())
    if lo < INT32_MIN or hi > INT32_MAX:
      fix = ("renumber them into int32, q's and kv's ids alike (e.g. by their ranks in "
             "`np.unique` of both)" if "segment" in name else "pass positions that fit int32")
      raise ValueError(f"`{name}` holds values from {lo} to {hi}, outside int32 (the kernels "
                       f"compare int32 values): {fix}.")


def bnts_shape(name: str, x, b: int, n: int, t: int, s: int) -> tuple:
  """``x``'s shape padded to rank 4 after checking it broadcasts to ``[B, N, T, S]``."""
  shape = _shape(x)
  if len(shape) > 4:
    raise ValueError(f"`{name}` has shape {shape}; it must broadcast to [B, N, T, S] = "
                     f"{(b, n, t, s)}.")
  full = (1,) * (4 - len(shape)) + shape
  for dim, want, axis in zip(full, (b, n, t, s), "BNTS"):
    if dim not in (1, want):
      raise ValueError(f"`{name}` has shape {shape}, which does not broadcast to [B, N, T, S]"
                       f" = {(b, n, t, s)}: axis {axis} is {dim}, expected 1 or {want}.")
  return full


def int32_overflow(*arrays):
  """A traced bool scalar, True when a traced integer array wider than int32 (x64) holds a value
  beyond int32, which the kernels' int32 comparisons would wrap (for ``poison``); None when
  there is nothing to check (concrete values are checked by ``check_token_array``)."""
  flags = [jnp.any((x < INT32_MIN) | (x > INT32_MAX)) for x in arrays
           if isinstance(x, jax.core.Tracer) and _wider_than_int32(x.dtype)]
  return functools.reduce(jnp.logical_or, flags) if flags else None


def poison(out, *flags):
  """``out`` (an array or a tuple of them) made NaN where any traced flag (not None) is True."""
  flags = [f for f in flags if f is not None]
  if not flags:
    return out
  bad = functools.reduce(jnp.logical_or, flags)
  return jax.tree.map(lambda x: jnp.where(bad, jnp.asarray(jnp.nan, x.dtype), x), out)
