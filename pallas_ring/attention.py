"""``flash_attention``: one (q, kv) pair on one device, over any kernel backend, with custom_vjp."""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from pallas_ring import block_sparse, call, fp8, kernels, operands, packing, pair, plans
from pallas_ring import validation
from pallas_ring.config import BlockSizes
from pallas_ring.kernels import common, tile_cache, tuning


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _flash(q, k, v, sinks, ops, cfg, planner, backend, quantize):
  return _flash_fwd(q, k, v, sinks, ops, cfg, planner, backend, quantize)[0]


def _flash_fwd(q, k, v, sinks, ops, cfg, planner, backend, quantize):
  # ``quantize=``: q, k, v quantized here (``fp8.straight_through``); primals: their dtypes
  (q, k, v), primals = fp8.quantized_primals(q, k, v, ops.fp8, quantize)
  plan = planner.plan(ops)
  o, lse = pair.finish_forward(*kernels.get(backend).forward(q, k, v, ops, plan, cfg), sinks,
                               cfg.out_dtype)
  return (o, lse), (q, k, v, sinks, ops, primals, o, lse)


def _flash_bwd(cfg, planner, backend, quantize, res, cts):
  del quantize
  q, k, v, sinks, ops, primals, o, lse = res
  # FP8 q, k, v: the backward's gradients are their dequantized values' (a backend that reads
  # FP8 in its backward takes them as they are)
  given = (q, k, v)
  (q, k, v), cotangents = fp8.backward_operands(q, k, v, ops.fp8, primals)
  wide = ops._replace(fp8=None)
  reads_fp8 = ops.fp8 is not None and kernels.get(backend).backward_reads_fp8
  do, dlse = cts  # dlse: None when zero (pair.defvjp_symbolic)
  # [B, N, Tp]; left to the kernel (fused into a pass that reads do) unless needed out here.
  delta = common.RowTerm(o, dlse)
  if sinks is not None or pair.differentiable(ops):
    delta = common.delta_array(delta, do)

  def backward(q, k, v, do, lse, delta, ops):
    plan = planner.plan(ops, backward=True)
    return kernels.get(backend).backward(q, k, v, do, lse, delta, ops, plan, cfg)

  dq, dk, dv = pair.first_order_only(backward)(
      *(given if reads_fp8 else (q, k, v)), do.astype(q.dtype), lse, delta,
      ops if reads_fp8 else wide)
  dsinks = None if sinks is None else pair.sinks_grad(sinks, lse, delta).astype(sinks.dtype)
  grads = pair.ops_grad(q, k, v, do, lse, delta, wide, cfg)
  return (*cotangents(dq, dk, dv), dsinks, pair.ops_cotangent(ops, grads))


pair.defvjp_symbolic(_flash, _flash_fwd, _flash_bwd)
_flash_jit = jax.jit(_flash, static_argnums=(5, 6, 7, 8))


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


def flash_attention(q, k, v, *, mask=None, segment_ids=None, kv_segment_ids=None,
                    q_positions=None, kv_positions=None, dense_mask=None, sinks=None,
                    softcap=None, scale=None, bias=None, alibi_slopes=None,
                    dropout_rate: float = 0.0, dropout_rng=None, cu_seqlens=None,
                    kv_cu_seqlens=None, block_sizes: Optional[BlockSizes] = None,
                    backend: str = "auto", interpret=None, return_lse: bool = False,
                    dropout_broadcast: bool = False, dropout_batch_offset=0,
                    dropout_head_offset=0, q_descale=None, k_descale=None, v_descale=None,
                    out_dtype: Optional[jax.typing.DTypeLike] = None,
                    quantize: Optional[jax.typing.DTypeLike] = None):
  """Block-sparse flash attention on one device.

  Args:
    q: ``[B, T, N, H]`` queries.
    k, v: ``[B, S, K, H]`` keys and values; ``N % K == 0`` (MHA, GQA, MQA).
    mask: a ``pallas_ring.masks`` spec in global positions (default ``Full()``).
    segment_ids: ``[B, T]`` int32 document ids; tokens attend within their segment.
    kv_segment_ids: ``[B, S]``; defaults to ``segment_ids`` when ``T == S``.
    q_positions, kv_positions: ``[T]`` / ``[S]`` (or ``[B, .]``) int positions the mask compares;
      default ``arange``. Ids and positions of wider integer types (x64) must fit int32: values
      beyond it raise where they are concrete, and make the output NaN under ``jit``.
    dense_mask: bool broadcastable to ``[B, N, T, S]``, True = attend; ANDed with the rest. A
      float mask must hold 0/1 (1 = attend): other values raise when they are concrete (an
      additive ``0 / -inf`` mask belongs in ``bias``); under ``jit`` they are not checked.
    sinks: ``[N]`` per-head sink logits, counted once in each row's denominator.
    softcap: logit soft-cap ``cap * tanh(s / cap)``.
    scale: logit scale, default ``H ** -0.5``.
    bias: float additive logit bias broadcastable to ``[B, N, T, S]``, differentiable (its
      gradient has its shape). Logits are ``softcap(q.k * scale) + bias - alibi``.
    alibi_slopes: ``[N]`` or ``[B, N]`` ALiBi slopes: ``-slope * |q_pos - k_pos|`` is added to
      the logits, computed in the kernels from the positions. They have no gradient:
      differentiating them raises (a learned term goes in ``bias``).
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
    q_descale, k_descale, v_descale: float32 descales of FP8 (``float8_e4m3fn`` /
      ``float8_e5m2``) operands, a scalar or ``[B, K]`` each (``pallas_ring.quantize_fp8``).
      q, k and v all of one FP8 dtype run the forward's matmuls in FP8 on Hopper (and the
      backward's at head dims up to 128); otherwise FP8 operands are dequantized to bfloat16.
      Descales are constants: gradients reach the FP8 operands, not the descales.
    out_dtype: the output's dtype; default q's, bfloat16 when q is FP8.
    quantize: an FP8 dtype to train with: 16/32-bit q, k and v are quantized to it here
      (``quantize_fp8``'s scales per batch row and head) and run as FP8 operands (the FP8
      forward on Hopper), and their gradients pass straight through the quantization: the
      backward's gradients at the quantized values, in q's, k's and v's dtypes (gradients of
      FP8 operands themselves are FP8 and mostly underflow). The output defaults to q's dtype.

  Returns:
    ``out [B, T, N, Hv]`` in ``out_dtype``, or ``(out, lse)`` when ``return_lse``. Rows with no
    visible key return 0 with zero gradients (Flax and ``jax.nn.dot_product_attention`` return
    the mean of V there). The lse is differentiable (e.g. for a z-loss). float64 inputs (x64) are
    computed in float64 by ``backend="xla"``; the Pallas backends refuse them.

  Differentiable once in reverse mode (``jax.grad``, ``jax.vjp``); forward mode and second
  derivatives raise ``NotImplementedError``.
  """
  if kv_cu_seqlens is not None and cu_seqlens is None:
    raise ValueError("`kv_cu_seqlens` needs `cu_seqlens` (the packing of the queries).")
  q, k, v, descales, compute, out_dtype = fp8.prepare(q, k, v, q_descale, k_descale, v_descale,
                                                      out_dtype, quantize_to=quantize)
  checked = call.check(
      q, k, v, mask=mask, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
      q_positions=q_positions, kv_positions=kv_positions,
      operands=dict(dense_mask=dense_mask, bias=bias, alibi_slopes=alibi_slopes, sinks=sinks,
                    fp8_descales=descales),
      softcap=softcap, scale=scale, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
      dropout_offsets=(dropout_batch_offset, dropout_head_offset),
      dropout_broadcast=dropout_broadcast, block_sizes=block_sizes, backend=backend,
      interpret=interpret, return_lse=return_lse, dtype=compute, quantize=quantize)
  if cu_seqlens is not None:
    b, t, s = q.shape[0], q.shape[1], k.shape[1]
    seg, kv_seg = packed_segments(cu_seqlens, kv_cu_seqlens, segment_ids, b, t, s)
    checked = checked._replace(arrays=checked.arrays._replace(segment_ids=seg,
                                                              kv_segment_ids=kv_seg))
  # Values cannot be read under jit: a float dense mask's misuse (an additive 0 / -inf mask),
  # x64 ids or positions beyond int32 and invalid cu_seqlens make the output NaN instead of
  # silently wrong.
  out = fp8.cast_output(run(q, k, v, checked), out_dtype)
  return validation.poison(out, operands.dense_mask_misuse(dense_mask),
                           validation.int32_overflow(segment_ids, kv_segment_ids, q_positions,
                                                     kv_positions),
                           packing.misuse(cu_seqlens, q.shape[1]),
                           packing.misuse(kv_cu_seqlens, k.shape[1]))


def run(q, k, v, checked: call.Checked):
  """``flash_attention`` of a checked call (``call.check``): no argument is checked again."""
  with pair.forward_mode_errors():
    return kernels.dispatch(functools.partial(_flash_on, settings=checked.settings),
                            checked.per_platform, q, k, v, checked.arrays)


def _flash_on(backend, interpret, q, k, v, arrays: call.Arrays, *, settings: call.Settings):
  """``flash_attention`` on one resolved backend: pads to its tiles, runs, un-pads."""
  lowering = kernels.get(backend)
  (q, k, v), terms, compute, quantize = fp8.for_backend(lowering, q, k, v, arrays.terms,
                                                       settings.quantize)
  arrays = arrays._replace(terms=terms)
  b, t, n, _ = q.shape
  s, hv = k.shape[1], v.shape[-1]
  h = pair.kernel_head_dim(q, v)
  st = settings
  segment_ids, kv_segment_ids, q_positions, kv_positions, terms, seeds, offsets = arrays
  tiles = tuning.resolve(backend, st.block_sizes, t, s, h,
                         dtype=q.dtype if quantize is None else quantize, group=n // k.shape[2],
                         mask_class=tile_cache.mask_class(st.mask, segment_ids is not None),
                         value_dim=hv)
  tp = tuning.padded_len(t, tiles.block_q, tiles.block_q_bwd)
  sp = tuning.padded_len(s, tiles.block_kv, tiles.block_kv_bwd)
  hp = lowering.padded_head_dim(h)
  hvp = lowering.padded_value_dim(hv, hp)
  cfg = pair.kernel_config(tiles, mask=st.mask, scale=st.scale, softcap=st.softcap, q_len=t,
                           kv_len=s, out_dtype=compute, interpret=interpret,
                           dropout_rate=st.dropout_rate)
  # Default positions are the token indices: the planner builds the plans ahead.
  indexed = q_positions is None and kv_positions is None
  planner = plans.for_config(cfg, tp, sp, plans.Indexed() if indexed else None)
  q_info = block_sparse.pad_token_info(
      block_sparse.make_token_info(t, b, q_positions, segment_ids), tp)
  kv_info = block_sparse.pad_token_info(
      block_sparse.make_token_info(s, b, kv_positions, kv_segment_ids), sp)
  ops = pair.kernel_operands(q_info, kv_info, operands.pad(terms, queries=tp, keys=sp), seeds,
                             offsets, b, n, broadcast=st.dropout_broadcast)
  pad = pair.pad_tokens
  out, lse = _flash_jit(pad(q, tp, hp), pad(k, sp, hp), pad(v, sp, hvp), terms.get("sinks"),
                        ops, cfg, planner, backend, quantize)
  out = out[:, :t, :, :hv]
  if st.return_lse:
    return out, lse[:, :, :t]
  return out


__all__ = ["flash_attention"]
