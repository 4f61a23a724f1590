"""``flash_attention``: one (q, kv) pair on one device, over any kernel backend, with custom_vjp."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
from jax import custom_derivatives
import jax.numpy as jnp

from pallas_ring import block_sparse, dropout, kernels, packing, validation
from pallas_ring import masks as masks_lib
from pallas_ring.config import BlockSizes
from pallas_ring.kernels import common, tile_cache, tuning
from pallas_ring.kernels import xla as xla_kernels

Array = Any


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


def pad_tokens(x, length, head_dim):
  """Zero-pads ``x [B, L, heads, H]`` to ``[B, length, heads, head_dim]``."""
  pads = ((0, 0), (0, length - x.shape[1]), (0, 0), (0, head_dim - x.shape[3]))
  return x if not any(p for _, p in pads) else jnp.pad(x, pads)


# The most tiles (q blocks x kv blocks) of a plan built ahead of the call (``make_plan``):
# larger ones would put megabytes of constants into the program, and their device ops cost
# little next to the kernels of such lengths.
STATIC_PLAN_TILES = 1 << 16


def make_plan(ops: common.Operands, cfg: common.KernelConfig, backward: bool = False):
  """The block plan of one (q, kv) pair for the forward or the backward tile sizes.

  With ``cfg.indexed_positions`` (and at most ``STATIC_PLAN_TILES`` tiles) the plan's position
  part is built while tracing, in numpy, and enters the program as constants; without segment
  ids or a dense mask that is the whole plan, built once per configuration
  (``block_sparse.indexed_plan``), so a call runs no plan ops (H100, T=4096, N=16: a causal
  forward ran 9 small XLA ops beside its 0.124 ms kernel, 0.135 ms a call).
  """
  bq, bk = (cfg.block_q_bwd, cfg.block_kv_bwd) if backward else (cfg.block_q, cfg.block_kv)
  q_info, kv_info = ops.q_info, ops.kv_info
  tp, sp = q_info.positions.shape[-1], kv_info.positions.shape[-1]
  if cfg.indexed_positions and (tp // bq) * (sp // bk) <= STATIC_PLAN_TILES:
    if ops.dense is None and q_info.segment_ids is None and kv_info.segment_ids is None:
      plan = block_sparse.indexed_plan(cfg.mask, cfg.q_len, cfg.kv_len, tp, sp, bq, bk)
      return block_sparse.BlockPlan(*(jnp.asarray(x) for x in plan))
    q_info = q_info._replace(positions=block_sparse.indexed_positions(cfg.q_len, tp))
    kv_info = kv_info._replace(positions=block_sparse.indexed_positions(cfg.kv_len, sp))
  return block_sparse.make_plan(cfg.mask, q_info, kv_info, block_q=bq, block_kv=bk,
                                q_len=cfg.q_len, kv_len=cfg.kv_len, dense_mask=ops.dense)


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _flash(q, k, v, sinks, ops, cfg, backend):
  return _flash_fwd(q, k, v, sinks, ops, cfg, backend)[0]


def _flash_fwd(q, k, v, sinks, ops, cfg, backend):
  plan = make_plan(ops, cfg)
  o, lse = finish_forward(*kernels.get(backend).forward(q, k, v, ops, plan, cfg), sinks, q.dtype)
  return (o, lse), (q, k, v, sinks, ops, o, lse)


def _flash_bwd(cfg, backend, res, cts):
  q, k, v, sinks, ops, o, lse = res
  do, dlse = cts  # dlse: None when zero (defvjp_symbolic)
  # [B, N, Tp]; left to the kernel (fused into a pass that reads do) unless needed out here.
  delta = common.RowTerm(o, dlse)
  if sinks is not None or ops.bias is not None:
    delta = common.delta_array(delta, do)

  def backward(q, k, v, do, lse, delta, ops):
    plan = make_plan(ops, cfg, backward=True)
    return kernels.get(backend).backward(q, k, v, do, lse, delta, ops, plan, cfg)

  dq, dk, dv = first_order_only(backward)(q, k, v, do.astype(q.dtype), lse, delta, ops)
  dsinks = None if sinks is None else sinks_grad(sinks, lse, delta).astype(sinks.dtype)
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dsinks,
          ops_grad(q, k, v, do, lse, delta, ops, cfg))


def ops_grad(q, k, v, do, lse, delta, ops: common.Operands, cfg: common.KernelConfig):
  """The cotangent of ``ops``: the bias gradient (computed densely in XLA for every lowering,
  and dead code when nobody asks for it); every other operand is not differentiable."""
  grads = jax.tree.map(lambda _: None, ops)
  if ops.bias is None:
    return grads
  dbias = xla_kernels.bias_grad(q, k, v, do.astype(q.dtype), lse, delta, ops, cfg)
  return grads._replace(bias=dbias.astype(ops.bias.dtype))


defvjp_symbolic(_flash, _flash_fwd, _flash_bwd)
_flash_jit = jax.jit(_flash, static_argnums=(5, 6))


def kernel_config(tiles: tuning.Tiles, *, mask, scale, softcap, q_len, kv_len,
                  out_dtype, interpret, dropout_rate=0.0,
                  indexed_positions=False) -> common.KernelConfig:
  """The static KernelConfig of one call (shared by flash_attention and the ring)."""
  return common.KernelConfig(
      mask=mask, scale=float(scale), softcap=None if softcap is None else float(softcap),
      q_len=q_len, kv_len=kv_len, block_q=tiles.block_q, block_kv=tiles.block_kv,
      block_q_bwd=tiles.block_q_bwd, block_kv_bwd=tiles.block_kv_bwd, out_dtype=out_dtype,
      num_warps=tiles.num_warps, num_stages=tiles.num_stages, interpret=interpret,
      dropout_rate=float(dropout_rate), indexed_positions=indexed_positions,
      variants=tiles.variants)


class Extras(NamedTuple):
  """The optional score terms of one call, validated (arrays; see ``check_extras``).

  Attributes:
    bias: ``[Bb, Nb, T, S]`` additive bias or None.
    alibi: float32 ``[Ba, N, 1]`` ALiBi slopes or None.
    seeds: int32 ``[2]`` dropout words (``dropout.seeds``) or None (no dropout).
    offsets: int32 ``[2]``: global index of the first local batch row and query head (dropout
      hashes global indices), or None.
  """

  bias: Optional[Array] = None
  alibi: Optional[Array] = None
  seeds: Optional[Array] = None
  offsets: Optional[Array] = None


def check_extras(q, t, s, bias, alibi_slopes, dropout_rate, dropout_rng, offsets=(0, 0)):
  """Validates bias / ALiBi / dropout arguments -> ``(Extras, dropout rate)``."""
  b, _, n, _ = q.shape
  rate = dropout.check_dropout(dropout_rate, dropout_rng)
  on = rate > 0
  return Extras(validation.normalize_bias(bias, b, n, t, s),
                None if alibi_slopes is None else
                jax.lax.stop_gradient(validation.normalize_alibi(alibi_slopes, b, n)),
                dropout.seeds(dropout_rng) if on else None,
                jnp.asarray(offsets, jnp.int32) if on else None), rate


def extras_operands(extras: Extras, q_info, kv_info, batch: int, heads: int, *, broadcast=False):
  """``(alibi, DropoutKeys)`` of the Operands (the bias is padded by the caller)."""
  keys = None
  if extras.seeds is not None:
    keys = dropout.keys(extras.seeds, batch, heads, q_info.positions, kv_info.positions,
                        batch_offset=extras.offsets[0], head_offset=extras.offsets[1],
                        broadcast=broadcast)
  return extras.alibi, keys


def packed_segments(cu_seqlens, kv_cu_seqlens, segment_ids, b, t, s):
  """Segment ids ``(q [1, T], kv [1, S])`` from ``cu_seqlens`` (padding tails invisible)."""
  packing.check_cu_seqlens("cu_seqlens", cu_seqlens, t, b, segment_ids)
  if kv_cu_seqlens is None:
    if t != s:
      raise ValueError(f"`kv_cu_seqlens` is required when T != S (T={t}, S={s}): pass the "
                       "cumulative lengths of the packed keys.")
    kv_cu_seqlens = cu_seqlens
  packing.check_cu_seqlens("kv_cu_seqlens", kv_cu_seqlens, s, b)
  return (packing.packed_segment_ids(cu_seqlens, jnp.arange(t), packing.Q_PAD),
          packing.packed_segment_ids(kv_cu_seqlens, jnp.arange(s), packing.KV_PAD))


def backend_variants(backend: str, interpret, q, block_sizes, dense=None,
                     extras: Optional[Extras] = None):
  """Validated ``(BlockSizes, {platform: (backend, interpret)})`` of a call (see ``kernels``).

  ``dense`` and ``extras`` are the call's optional operands: a kernel that lacks one is skipped by
  ``"auto"`` and refused (with the reason and the fallback) when asked for by name.
  """
  block_sizes = tuning.as_block_sizes(block_sizes)
  ex = extras or Extras()
  call = kernels.Call(jnp.result_type(q), q.shape[-1], dense=dense is not None,
                      bias=ex.bias is not None, alibi=ex.alibi is not None,
                      dropout=ex.seeds is not None, block_sizes=block_sizes)
  if backend != "auto":
    kernels.check_explicit(backend, call)
  return block_sizes, kernels.variants(backend, interpret, call)


def flash_attention(q, k, v, *, mask=None, segment_ids=None, kv_segment_ids=None,
                    q_positions=None, kv_positions=None, dense_mask=None, sinks=None,
                    softcap=None, scale=None, bias=None, alibi_slopes=None,
                    dropout_rate: float = 0.0, dropout_rng=None, cu_seqlens=None,
                    kv_cu_seqlens=None, block_sizes: Optional[BlockSizes] = None,
                    backend: str = "auto", interpret=None, return_lse: bool = False,
                    dropout_broadcast: bool = False, dropout_batch_offset=0,
                    dropout_head_offset=0):
  """Block-sparse flash attention on one device.

  Args:
    q: ``[B, T, N, H]`` queries.
    k, v: ``[B, S, K, H]`` keys and values; ``N % K == 0`` (MHA, GQA, MQA).
    mask: a ``pallas_ring.masks`` spec in global positions (default ``Full()``).
    segment_ids: ``[B, T]`` int32 document ids; tokens attend within their segment.
    kv_segment_ids: ``[B, S]``; defaults to ``segment_ids`` when ``T == S``.
    q_positions, kv_positions: ``[T]`` / ``[S]`` (or ``[B, .]``) int positions the mask compares;
      default ``arange``.
    dense_mask: bool broadcastable to ``[B, N, T, S]``, True = attend; ANDed with the rest. A
      float mask is read as 0/1 (nonzero = attend): an additive ``-inf`` mask is not a dense
      mask (it is a bias).
    sinks: ``[N]`` per-head sink logits, counted once in each row's denominator.
    softcap: logit soft-cap ``cap * tanh(s / cap)``.
    scale: logit scale, default ``H ** -0.5``.
    bias: float additive logit bias broadcastable to ``[B, N, T, S]``, differentiable (its
      gradient has its shape). Logits are ``softcap(q.k * scale) + bias - alibi``.
    alibi_slopes: ``[N]`` or ``[B, N]`` ALiBi slopes: ``-slope * |q_pos - k_pos|`` is added to
      the logits, computed in the kernels from the positions (not differentiated).
    dropout_rate: attention-probability dropout rate in ``[0, 1)``; kept probabilities are scaled
      by ``1 / (1 - rate)``; sinks are never dropped.
    dropout_rng: a JAX PRNG key, required when ``dropout_rate > 0``. Each keep decision is a hash
      of (key, batch index, query head, q position, k position): ``dropout_keep_mask`` returns it.
    cu_seqlens: int ``[D + 1]`` cumulative lengths of D sequences packed along T (B must be 1):
      the same as ``segment_ids=segment_ids_from_cu_seqlens(cu_seqlens, T)``, except that tokens
      at or past ``cu_seqlens[-1]`` are padding (invisible; their output and gradients are 0).
    kv_cu_seqlens: the same for the keys; defaults to ``cu_seqlens`` when ``T == S``.
    block_sizes: ``BlockSizes`` overrides of the backend's tuned tiles.
    backend: ``"auto" | "pallas_tpu" | "pallas_mosaic_gpu" | "pallas_triton" | "xla"``.
      ``"auto"`` is resolved for the platform the computation is lowered for (TPU: pallas_tpu;
      GPU: pallas_mosaic_gpu on sm_90+ for bfloat16 / float16 where it serves the call, else
      pallas_triton; CPU and float64 inputs: xla; xla also where the given ``block_sizes`` break
      a kernel's rules).
    interpret: Pallas interpret mode; None = exactly when the platform the computation is lowered
      for cannot run the kernel natively.
    return_lse: also return ``lse [B, N, T]`` float32 (natural log, ``-inf`` on empty rows).
    dropout_broadcast: one dropout mask for every batch row and head (Flax's
      ``broadcast_dropout=True``).
    dropout_batch_offset, dropout_head_offset: global index of the first batch row / query head
      here (inside your own ``shard_map`` over batch or heads), so the dropout mask is the one of
      the unsharded call.

  Returns:
    ``out [B, T, N, H]`` in q's dtype, or ``(out, lse)`` when ``return_lse``. Rows with no visible
    key return 0 with zero gradients (Flax and ``jax.nn.dot_product_attention`` return the mean
    of V there). The lse is differentiable (e.g. for a z-loss). float64 inputs (x64) are
    computed in float64 by ``backend="xla"``; the Pallas backends refuse them.

  Differentiable once in reverse mode (``jax.grad``, ``jax.vjp``); forward mode and second
  derivatives raise ``NotImplementedError``.
  """
  mask = masks_lib.as_spec(mask)
  validation.check_qkv(q, k, v)
  b, t, n, h = q.shape
  s = k.shape[1]
  scale = validation.check_positive("scale", scale, h ** -0.5)
  softcap = validation.check_positive("softcap", softcap, None)
  extras, rate = check_extras(q, t, s, bias, alibi_slopes, dropout_rate, dropout_rng,
                              (dropout_batch_offset, dropout_head_offset))
  if cu_seqlens is not None:
    segment_ids, kv_segment_ids = packed_segments(cu_seqlens, kv_cu_seqlens, segment_ids, b, t, s)
  elif kv_cu_seqlens is not None:
    raise ValueError("`kv_cu_seqlens` needs `cu_seqlens` (the packing of the queries).")
  if kv_segment_ids is None and segment_ids is not None:
    if t != s:
      raise ValueError(f"`kv_segment_ids` is required when T != S (T={t}, S={s}): pass the [B, S] "
                       "segment ids of the keys.")
    kv_segment_ids = segment_ids
  validation.check_token_array("segment_ids", segment_ids, b, t)
  validation.check_token_array("kv_segment_ids", kv_segment_ids, b, s)
  validation.check_token_array("q_positions", q_positions, b, t, allow_1d=True)
  validation.check_token_array("kv_positions", kv_positions, b, s, allow_1d=True)
  if (segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("`segment_ids` and `kv_segment_ids` must be given together (or neither).")
  dense = validation.normalize_dense_mask(dense_mask, b, n, t, s)
  if sinks is not None:
    validation.check_sinks(sinks, n)
  block_sizes, per_platform = backend_variants(backend, interpret, q, block_sizes, dense, extras)
  run = functools.partial(_flash_on, mask=mask, scale=scale, softcap=softcap,
                          block_sizes=block_sizes, return_lse=return_lse, dropout_rate=rate,
                          dropout_broadcast=bool(dropout_broadcast))
  with forward_mode_errors():
    return kernels.dispatch(run, per_platform, q, k, v, segment_ids, kv_segment_ids, q_positions,
                            kv_positions, dense, sinks, extras)


def _flash_on(backend, interpret, q, k, v, segment_ids, kv_segment_ids, q_positions,
              kv_positions, dense, sinks, extras, *, mask, scale, softcap, block_sizes,
              return_lse, dropout_rate, dropout_broadcast):
  """``flash_attention`` on one resolved backend: pads to its tiles, runs, un-pads."""
  b, t, n, h = q.shape
  s = k.shape[1]
  tiles = tuning.resolve(backend, block_sizes, t, s, h, dtype=q.dtype, group=n // k.shape[2],
                         mask_class=tile_cache.mask_class(mask, segment_ids is not None))
  tp = tuning.padded_len(t, tiles.block_q, tiles.block_q_bwd)
  sp = tuning.padded_len(s, tiles.block_kv, tiles.block_kv_bwd)
  hp = tuning.padded_head_dim(backend, h)
  cfg = kernel_config(tiles, mask=mask, scale=scale, softcap=softcap, q_len=t,
                      kv_len=s, out_dtype=q.dtype, interpret=interpret,
                      dropout_rate=dropout_rate,
                      indexed_positions=q_positions is None and kv_positions is None)
  q_info = block_sparse.pad_token_info(
      block_sparse.make_token_info(t, b, q_positions, segment_ids), tp)
  kv_info = block_sparse.pad_token_info(
      block_sparse.make_token_info(s, b, kv_positions, kv_segment_ids), sp)
  if dense is not None:
    dense = jnp.pad(dense, ((0, 0), (0, 0), (0, tp - t), (0, sp - s)))
  bias = extras.bias
  if bias is not None:
    bias = jnp.pad(bias, ((0, 0), (0, 0), (0, tp - t), (0, sp - s)))
  ops = common.Operands(q_info, kv_info, dense, bias, *extras_operands(
      extras, q_info, kv_info, b, n, broadcast=dropout_broadcast))
  out, lse = _flash_jit(pad_tokens(q, tp, hp), pad_tokens(k, sp, hp), pad_tokens(v, sp, hp),
                        sinks, ops, cfg, backend)
  out = out[:, :t, :, :h]
  if return_lse:
    return out, lse[:, :, :t]
  return out


__all__ = ["flash_attention", "merge_sinks", "sinks_grad", "make_plan"]
