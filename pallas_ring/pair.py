"""One (q shard, kv shard) pair on one device: what ``flash_attention`` and the ring share.

The kernel config of a pair, its operands, the sinks' merge and gradient, and the
custom-VJP plumbing (symbolic zero cotangents, first-order-only backward, clear forward-mode
errors). An internal module: its names are documented for the package's entry points and tools,
not part of the public surface.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import jax
from jax import custom_derivatives
import jax.numpy as jnp

from pallas_ring import dropout, operands
from pallas_ring.kernels import common, tuning
from pallas_ring.kernels import xla as xla_kernels


def merge_sinks(o, lse, sinks):
  """Adds per-head sink logits ``[N]`` once to each row's denominator.

  Args:
    o: ``[B, T, N, H]`` normalised output; lse: ``[B, N, T]``, both in the accumulation dtype.

  Returns:
    ``(o', lse')`` with ``lse' = logaddexp(lse, sink)`` and ``o' = o * exp(lse - lse')``.
  """
  sk = sinks.astype(lse.dtype)[None, :, None]
  new_lse = jnp.logaddexp(lse, sk)
  # 0 on empty rows (lse = -inf); a sink of -inf is "no sink", also on empty rows (-inf - -inf).
  w = jnp.where(new_lse == -jnp.inf, 0.0, jnp.exp(lse - common.safe_lse(new_lse)))
  return o * jnp.swapaxes(w, 1, 2)[..., None], new_lse


def sinks_grad(sinks, lse, delta):
  """d loss / d sinks from the final lse and the row term ``delta`` (see ``common.row_delta``)."""
  p_sink = jnp.exp(sinks.astype(lse.dtype)[None, :, None] - common.safe_lse(lse))
  return -jnp.sum(p_sink * delta, axis=(0, 2))


def finish_forward(o, lse, sinks, dtype):
  """Merges the sinks (once per row) into a kernel's ``(o, lse)`` and casts o to ``dtype``."""
  if sinks is not None:
    o, lse = merge_sinks(o.astype(lse.dtype), lse, sinks)
  return o.astype(dtype), lse


def kernel_head_dim(q, v) -> int:
  """The head dim the kernels run at: q/k's ``H`` and v's ``Hv`` zero-padded to the larger.

  Zero columns change no logit (``q . k``) and give zero output columns (``p @ v``), so a
  separate value head dim (DeepSeek-style MLA: 192 / 128) runs on every backend's kernels; the
  caller slices the output back to ``Hv`` (and autodiff slices dv). ``flash_attention`` pads v
  only to ``Backend.padded_value_dim`` (Mosaic GPU: v's own head dim)."""
  return max(q.shape[-1], v.shape[-1])


def pad_tokens(x, length, head_dim):
  """Zero-pads ``x [B, L, heads, H]`` to ``[B, length, heads, head_dim]``."""
  pads = ((0, 0), (0, length - x.shape[1]), (0, 0), (0, head_dim - x.shape[3]))
  return x if not any(p for _, p in pads) else jnp.pad(x, pads)


_AUTODIFF_HELP = (
    "pallas_ring attention is differentiable once, in reverse mode: jax.grad, jax.vjp, "
    "jax.value_and_grad and jax.jacrev (under jit, vmap and checkpoint). {what} is not "
    "implemented: the kernels have a custom VJP and no JVP or second derivative. For "
    "higher-order derivatives at small sizes use the dense pallas_ring.reference.attention.")


@contextlib.contextmanager
def forward_mode_errors():
  """Turns JAX's generic custom_vjp forward-mode error into one that says what is supported."""
  try:
    yield
  except TypeError as e:
    if "forward-mode" not in str(e):
      raise
    raise NotImplementedError(_AUTODIFF_HELP.format(
        what="Forward-mode autodiff (jax.jvp, jax.linearize, jax.jacfwd, jax.hessian)")) from e


def first_order_only(backward: Callable) -> Callable:
  """Wraps a backward pass so that differentiating it again (grad of grad, hessian) raises clearly.

  Args:
    backward: the backward computation, a function of arrays (static arguments closed over).
  """
  once = jax.custom_jvp(backward)

  @once.defjvp
  def _second_order(primals, tangents):
    del primals, tangents
    raise NotImplementedError(_AUTODIFF_HELP.format(
        what="A second derivative (grad of grad, jax.hessian)"))

  return once


def defvjp_symbolic(fun, fwd, bwd):
  """``fun.defvjp`` with symbolic zero cotangents (``symbolic_zeros=True``).

  ``fwd`` receives plain primal values, as without the option. ``bwd`` receives the output
  cotangents ``(do, dlse)`` with ``dlse`` None when it is zero (no caller used the lse: the
  common case), so no backward materializes and reads a zero ``[B, N, T]`` array, and ``do`` as
  zeros when only the lse was used.
  """
  is_primal = lambda x: isinstance(x, custom_derivatives.CustomVJPPrimal)

  def fwd_values(*args):
    return fwd(*jax.tree.map(lambda x: x.value if is_primal(x) else x, args, is_leaf=is_primal))

  def bwd_cts(*args):
    *static, res, (do, dlse) = args
    if isinstance(do, custom_derivatives.SymbolicZero):
      do = jnp.zeros(do.shape, do.dtype)
    if isinstance(dlse, custom_derivatives.SymbolicZero):
      dlse = None
    return bwd(*static, res, (do, dlse))

  fun.defvjp(fwd_values, bwd_cts, symbolic_zeros=True)


def ops_grad(q, k, v, do, lse, delta, ops: common.Operands, cfg: common.KernelConfig) -> dict:
  """``{name: cotangent}`` of the differentiable operands in ``ops`` (``operands.DECLARED``):
  each an additive logit term, whose gradient is ``dS`` summed over the axes it broadcasts
  along, computed densely in XLA for every lowering (dead code when nobody asks for it)."""
  grads = {}
  for name in differentiable(ops):
    x = getattr(ops, name)
    grads[name] = xla_kernels.logit_term_grad(q, k, v, do.astype(q.dtype), lse, delta, ops, cfg,
                                              x.shape).astype(x.dtype)
  return grads


def differentiable(ops: common.Operands) -> tuple:
  """The names of the differentiable operands present in ``ops``."""
  return tuple(o.name for o in operands.DECLARED
               if o.in_kernel and o.differentiable and getattr(ops, o.name) is not None)


def ops_cotangent(ops: common.Operands, grads: dict) -> common.Operands:
  """``ops``' cotangent for a custom VJP: ``grads`` where given, None elsewhere."""
  return jax.tree.map(lambda _: None, ops)._replace(**grads)


def kernel_config(tiles: tuning.Tiles, *, mask, scale, softcap, q_len, kv_len,
                  out_dtype, interpret, dropout_rate=0.0) -> common.KernelConfig:
  """The static KernelConfig of one call (shared by flash_attention and the ring)."""
  return common.KernelConfig(
      mask=mask, scale=float(scale), softcap=None if softcap is None else float(softcap),
      q_len=q_len, kv_len=kv_len, block_q=tiles.block_q, block_kv=tiles.block_kv,
      block_q_bwd=tiles.block_q_bwd, block_kv_bwd=tiles.block_kv_bwd, out_dtype=out_dtype,
      num_warps=tiles.num_warps, num_stages=tiles.num_stages, interpret=interpret,
      dropout_rate=float(dropout_rate), variants=tiles.variants)


def kernel_operands(q_info, kv_info, terms: dict, seeds, offsets, batch: int, heads: int, *,
                    broadcast=False) -> common.Operands:
  """The kernels' ``Operands`` of one pair: token info, the in-kernel operands of ``terms``
  (cut to this pair's keys and padded by the caller) and the dropout keys of ``seeds`` /
  ``offsets`` (``call.Arrays``; None: no dropout)."""
  keys = None
  if seeds is not None:
    keys = dropout.keys(seeds, batch, heads, q_info.positions, kv_info.positions,
                        batch_offset=offsets[0], head_offset=offsets[1], broadcast=broadcast)
  return common.Operands(q_info, kv_info, dropout=keys, **operands.in_kernel(terms))
