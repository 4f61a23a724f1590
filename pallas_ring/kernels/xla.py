"""Blockwise pure-jnp implementation of the kernel contract (see ``kernels.common``).

It walks exactly the plan's lists (FULL tiles with no mask arithmetic, then PARTIAL tiles with
the elementwise mask), so it is also the oracle for the block logic that the Pallas kernels share.
The default on CPU; vmapped over batch, kv heads and the query heads of each group, so GQA never
repeats K/V.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pallas_ring.block_sparse import FULL
from pallas_ring.kernels import backend, common


def _nested_vmap(fn, args, sizes):
  """vmaps ``fn`` over leading axes of sizes ``sizes``; an arg whose axis is 1 is broadcast."""
  if not sizes:
    return fn(*args)
  size = sizes[0]
  axes, squeezed = [], []
  for a in args:
    if a is None or a.shape[0] != size:
      axes.append(None)
      squeezed.append(a if a is None else a[0])
    else:
      axes.append(0)
      squeezed.append(a)
  return jax.vmap(lambda *xs: _nested_vmap(fn, xs, sizes[1:]), in_axes=axes)(*squeezed)


def _split_heads(x, kh):
  """``[Bx, Nx, ...]`` plan/mask array -> ``[Bx, Kx, Gx, ...]`` (Nx is 1 or N = K * G)."""
  if x is None:
    return None
  if x.shape[1] == 1:
    return x[:, :, None]
  return x.reshape(x.shape[0], kh, x.shape[1] // kh, *x.shape[2:])


class _HeadOps(NamedTuple):
  """One (batch, head)'s operands inside the vmaps (see ``_head_major``).

  Attributes:
    qpos, kpos: ``[Tp]`` / ``[Sp]`` positions; qseg, kseg: segment ids or None.
    dense: ``[Tp, Sp]`` mask or None; bias: ``[Tp, Sp]`` or None; slope: ``[1]`` ALiBi slope or
    None; rows, cols: ``[Tp]`` / ``[Sp]`` dropout keys or None.
  """

  qpos: Any
  kpos: Any
  qseg: Any = None
  kseg: Any = None
  dense: Any = None
  bias: Any = None
  slope: Any = None
  rows: Any = None
  cols: Any = None


def _tile(cfg, hops: _HeadOps, s_cap, q0, k0, klass):
  """Logits with bias/ALiBi, visibility and dropout keep of the tile at (q0, k0).

  Returns:
    ``(s, vis, keep)``, each ``[bq, bk]`` (keep is None without dropout).
  """
  bq, bk = s_cap.shape
  sl = lambda x, s, n: None if x is None else jax.lax.dynamic_slice_in_dim(x, s, n)
  tile = lambda x: None if x is None else jax.lax.dynamic_slice(x, (q0, k0), (bq, bk))
  q_pos = sl(hops.qpos, q0, bq)[:, None]
  k_pos = sl(hops.kpos, k0, bk)[None, :]
  k_index = (k0 + jnp.arange(bk, dtype=jnp.int32))[None, :]
  q_seg, k_seg = sl(hops.qseg, q0, bq), sl(hops.kseg, k0, bk)
  vis = (klass == FULL) | common.tile_visible(
      cfg, q_pos, k_pos, k_index, None if q_seg is None else q_seg[:, None],
      None if k_seg is None else k_seg[None, :], tile(hops.dense))
  s = common.score_terms(s_cap, tile(hops.bias), hops.slope, q_pos, k_pos)
  keep = None
  if hops.rows is not None:
    keep = common.dropout_keep(cfg.dropout_rate, sl(hops.rows, q0, bq)[:, None],
                               sl(hops.cols, k0, bk)[None, :])
  return s, vis, keep


def _block_ids(n):
  """``[n]`` int32 block numbers (int32 also under x64, so slice starts never mix dtypes)."""
  return jnp.arange(n, dtype=jnp.int32)


def _fwd_head(q, k, v, kv_index, kv_class, kv_count, *head, cfg):
  """One (batch, head): q ``[Tp, H]``, k/v ``[Sp, H]``, lists ``[nq, nk]`` -> o, lse ``[Tp]``."""
  hops = _HeadOps(*head)
  bq, bk = cfg.block_q, cfg.block_kv
  tp, h = q.shape
  nq = tp // bq
  acc = common.acc_dtype(q.dtype)

  def q_block(i, idx_row, cls_row, count):
    q0 = i * bq
    qb = jax.lax.dynamic_slice_in_dim(q, q0, bq)

    def body(j, carry):
      m, l, o = carry
      k0 = idx_row[j] * bk
      kb = jax.lax.dynamic_slice_in_dim(k, k0, bk)
      vb = jax.lax.dynamic_slice_in_dim(v, k0, bk)
      s, vis, keep = _tile(cfg, hops, common.logits(qb, kb, cfg), q0, k0, cls_row[j])
      m_new = jnp.maximum(m, jnp.max(jnp.where(vis, s, common.NEG_INF), axis=1))
      p = jnp.where(vis, jnp.exp(s - m_new[:, None]), 0.0)
      alpha = jnp.exp(m - m_new)
      l = alpha * l + jnp.sum(p, axis=1)
      pv = p if keep is None else jnp.where(keep, p, 0.0)
      o = alpha[:, None] * o + jnp.dot(pv.astype(v.dtype), vb, preferred_element_type=acc)
      return m_new, l, o

    init = (jnp.full((bq,), common.NEG_INF, acc), jnp.zeros((bq,), acc), jnp.zeros((bq, h), acc))
    m, l, o = jax.lax.fori_loop(0, count, body, init)
    return common.finalize(o, m[:, None], l[:, None], cfg.keep_scale)

  o, lse = jax.vmap(q_block)(_block_ids(nq), kv_index, kv_class, kv_count)
  return o.reshape(tp, h).astype(cfg.out_dtype), lse.reshape(tp)


def _dq_head(q, k, v, do, lse, delta, kv_index, kv_class, kv_count, *head, cfg):
  hops = _HeadOps(*head)
  bq, bk = cfg.block_q_bwd, cfg.block_kv_bwd
  tp, h = q.shape
  lse = common.safe_lse(lse)
  acc = common.acc_dtype(q.dtype)

  def q_block(i, idx_row, cls_row, count):
    q0 = i * bq
    sl = lambda x: jax.lax.dynamic_slice_in_dim(x, q0, bq)
    qb, dob, lb, db = sl(q), sl(do), sl(lse)[:, None], sl(delta)[:, None]

    def body(j, dq):
      k0 = idx_row[j] * bk
      kb = jax.lax.dynamic_slice_in_dim(k, k0, bk)
      vb = jax.lax.dynamic_slice_in_dim(v, k0, bk)
      s_cap = common.logits(qb, kb, cfg)
      s, vis, keep = _tile(cfg, hops, s_cap, q0, k0, cls_row[j])
      p = jnp.where(vis, jnp.exp(s - lb), 0.0)
      dp = jax.lax.dot_general(dob, vb, (((1,), (1,)), ((), ())), preferred_element_type=acc)
      ds = p * (common.dropped(dp, keep, cfg) - db) * common.softcap_grad(s_cap, cfg)
      return dq + jnp.dot(ds.astype(k.dtype), kb, preferred_element_type=acc)

    return jax.lax.fori_loop(0, count, body, jnp.zeros((bq, h), acc)) * cfg.scale

  dq = jax.vmap(q_block)(_block_ids(tp // bq), kv_index, kv_class, kv_count)
  return dq.reshape(tp, h)


def _dkv_head(q, k, v, do, lse, delta, q_index, q_class, q_count, *head, cfg):
  hops = _HeadOps(*head)
  bq, bk = cfg.block_q_bwd, cfg.block_kv_bwd
  sp, h = k.shape
  lse = common.safe_lse(lse)
  acc = common.acc_dtype(q.dtype)

  def kv_block(jk, idx_row, cls_row, count):
    k0 = jk * bk
    kb = jax.lax.dynamic_slice_in_dim(k, k0, bk)
    vb = jax.lax.dynamic_slice_in_dim(v, k0, bk)

    def body(i, carry):
      dk, dv = carry
      q0 = idx_row[i] * bq
      sl = lambda x: jax.lax.dynamic_slice_in_dim(x, q0, bq)
      qb, dob, lb, db = sl(q), sl(do), sl(lse)[:, None], sl(delta)[:, None]
      s_cap = common.logits(qb, kb, cfg)
      s, vis, keep = _tile(cfg, hops, s_cap, q0, k0, cls_row[i])
      p = jnp.where(vis, jnp.exp(s - lb), 0.0)
      dv = dv + jax.lax.dot_general(common.dropped(p, keep, cfg).astype(do.dtype), dob,
                                    (((0,), (0,)), ((), ())), preferred_element_type=acc)
      dp = jax.lax.dot_general(dob, vb, (((1,), (1,)), ((), ())), preferred_element_type=acc)
      ds = p * (common.dropped(dp, keep, cfg) - db) * common.softcap_grad(s_cap, cfg)
      dk = dk + jax.lax.dot_general(ds.astype(q.dtype), qb, (((0,), (0,)), ((), ())),
                                    preferred_element_type=acc)
      return dk, dv

    zeros = jnp.zeros((bk, h), acc)
    dk, dv = jax.lax.fori_loop(0, count, body, (zeros, zeros))
    return dk * cfg.scale, dv

  dk, dv = jax.vmap(kv_block)(_block_ids(sp // bk), q_index, q_class, q_count)
  return dk.reshape(sp, h), dv.reshape(sp, h)


def _head_major(q, k, v, ops, plan_lists):
  """Rearranges everything to ``[B, K, G, ...]`` leading axes for ``_nested_vmap``.

  Returns:
    ``(q5, k5, v5, lists, head_args, sizes)``; ``head_args`` are ``_HeadOps``'s fields.
  """
  b, tp, n, h = q.shape
  kh = k.shape[2]
  q5 = q.reshape(b, tp, kh, n // kh, h).transpose(0, 2, 3, 1, 4)  # [B, K, G, Tp, H]
  kv = lambda x: x.transpose(0, 2, 1, 3)[:, :, None]  # [B, K, 1, Sp, H]
  info = lambda x: None if x is None else x[:, None, None]  # [B|1, 1, 1, L]
  heads = lambda x: None if x is None else _split_heads(x, kh)  # [B|1, K|1, G|1, ...]
  drop = ops.dropout
  head_args = [info(ops.q_info.positions), info(ops.kv_info.positions),
               info(ops.q_info.segment_ids), info(ops.kv_info.segment_ids), heads(ops.dense),
               heads(ops.bias), heads(ops.alibi), None if drop is None else heads(drop.rows),
               None if drop is None else info(drop.cols)]
  lists = [_split_heads(x, kh) for x in plan_lists]
  return q5, kv(k), kv(v), lists, head_args, (b, kh, n // kh)


def _q_rows(x, kh):
  """``[B, N, Tp]`` row statistics -> ``[B, K, G, Tp]``."""
  return x.reshape(x.shape[0], kh, x.shape[1] // kh, x.shape[2])


@functools.partial(jax.jit, static_argnames=("cfg",))
def forward(q, k, v, ops: common.Operands, plan, cfg: common.KernelConfig, acc=None):
  """See ``kernels.common``: returns ``(o [B, Tp, N, H], lse [B, N, Tp])``; FP8 q, k, v
  (``ops.fp8``) are widened to bfloat16 as they are read."""
  if ops.fp8 is not None:
    q, k, v = common.dequantize(q, k, v, ops.fp8, jnp.bfloat16)
    ops = ops._replace(fp8=None)
  b, tp, n, h = q.shape
  q5, k5, v5, lists, head_args, sizes = _head_major(
      q, k, v, ops, (plan.kv_index, plan.kv_class, plan.kv_count))
  o, lse = _nested_vmap(functools.partial(_fwd_head, cfg=cfg),
                        [q5, k5, v5, *lists, *head_args], sizes)
  o = o.transpose(0, 3, 1, 2, 4).reshape(b, tp, n, h)
  return common.merged(acc, o, lse.reshape(b, n, tp))


@functools.partial(jax.jit, static_argnames=("cfg", "parts"))
def backward(q, k, v, do, lse, delta, ops: common.Operands, plan, cfg: common.KernelConfig,
             dq_acc=None, parts=common.BOTH, dkv_acc=None):
  """See ``kernels.common``: returns ``(dq, dk, dv)`` in ``cfg.out_dtype``."""
  want_dq, want_dkv = common.wants(parts)
  delta = common.delta_array(delta, do)
  b, tp, n, h = q.shape
  kh = k.shape[2]
  do5 = do.reshape(b, tp, kh, n // kh, h).transpose(0, 2, 3, 1, 4)
  rows = [_q_rows(lse, kh), _q_rows(delta, kh)]
  q5, k5, v5, lists, head_args, sizes = _head_major(
      q, k, v, ops, (plan.kv_index, plan.kv_class, plan.kv_count))
  dq = dk = dv = None
  if want_dq:
    dq = _nested_vmap(functools.partial(_dq_head, cfg=cfg),
                      [q5, k5, v5, do5, *rows, *lists, *head_args], sizes)
    dq = dq.transpose(0, 3, 1, 2, 4).reshape(b, tp, n, h).astype(cfg.out_dtype)
  if want_dkv:
    lists = [_split_heads(x, kh) for x in (plan.q_index, plan.q_class, plan.q_count)]
    dk, dv = _nested_vmap(functools.partial(_dkv_head, cfg=cfg),
                          [q5, k5, v5, do5, *rows, *lists, *head_args], sizes)
    # [B, K, G, Sp, H] -> sum the query heads of each group -> [B, Sp, K, H]
    dk, dv = (jnp.sum(x, axis=2).transpose(0, 2, 1, 3).astype(cfg.out_dtype) for x in (dk, dv))
  return common.accumulated(dq_acc, (dq, dk, dv), dkv_acc)


@functools.partial(jax.jit, static_argnames=("cfg", "shape"))
def logit_term_grad(q, k, v, do, lse, delta, ops: common.Operands, cfg: common.KernelConfig,
                    shape: tuple):
  """Gradient of an additive logit term of ``shape`` ``[Bb, Nb, Tp, Sp]`` (the bias), for every
  lowering.

  ``d term = ds = p * (keep * dp / (1 - rate) - delta)``, summed over the axes the term
  broadcasts along. A dense bias is O(T * S) by nature; this computes one ``block_q_bwd`` row band
  of all heads at a time (``lax.map``), so temporaries stay O(B * N * block * S).
  """
  b, tp, n, h = q.shape
  sp, kh = k.shape[1], k.shape[2]
  g = n // kh
  bq = cfg.block_q_bwd
  bb, nb = shape[:2]
  acc = common.acc_dtype(q.dtype)
  lse = common.safe_lse(lse)
  k_index = jnp.arange(sp, dtype=jnp.int32)[None, None, None, :]
  kpos = ops.kv_info.positions[:, None, None, :]  # [Bp, 1, 1, Sp]
  kseg = None if ops.kv_info.segment_ids is None else ops.kv_info.segment_ids[:, None, None, :]
  band = lambda x, i, axis: jax.lax.dynamic_slice_in_dim(x, i * bq, bq, axis)

  def one_band(i):
    qb, dob = band(q, i, 1), band(do, i, 1)  # [B, bq, N, H], [B, bq, N, Hv]
    group = lambda x: x.reshape(b, bq, kh, g, x.shape[-1])
    heads = lambda x: x.reshape(b, n, bq, sp)
    s_cap = jnp.einsum("bqkgh,bskh->bkgqs", group(qb), k, preferred_element_type=acc)
    s_cap = heads(s_cap) * cfg.scale
    if cfg.softcap is not None:
      s_cap = cfg.softcap * jnp.tanh(s_cap / cfg.softcap)
    qpos = band(ops.q_info.positions, i, 1)[:, None, :, None]  # [Bp, 1, bq, 1]
    qseg = ops.q_info.segment_ids
    vis = common.tile_visible(cfg, qpos, kpos, k_index,
                              None if qseg is None else band(qseg, i, 1)[:, None, :, None], kseg,
                              None if ops.dense is None else band(ops.dense, i, 2))
    slope = None if ops.alibi is None else ops.alibi[..., None]  # [Ba, N, 1, 1]
    s = common.score_terms(s_cap, band(ops.bias, i, 2), slope, qpos, kpos)
    p = jnp.where(vis, jnp.exp(s - band(lse, i, 2)[..., None]), 0.0)
    dp = heads(jnp.einsum("bqkgh,bskh->bkgqs", group(dob), v, preferred_element_type=acc))
    keep = None
    if ops.dropout is not None:
      keep = common.dropout_keep(cfg.dropout_rate, band(ops.dropout.rows, i, 2)[..., None],
                                 ops.dropout.cols[:, None, None, :])
    ds = p * (common.dropped(dp, keep, cfg) - band(delta, i, 2)[..., None])  # [B, N, bq, Sp]
    return jnp.sum(ds, axis=tuple(a for a, size in ((0, bb), (1, nb)) if size == 1),
                   keepdims=True)

  bands = jax.lax.map(one_band, _block_ids(tp // bq))  # [nq, Bb, Nb, bq, Sp]
  return bands.transpose(1, 2, 0, 3, 4).reshape(bb, nb, tp, sp)


class XlaBackend(backend.Backend):
  """Blockwise pure jnp on every platform: float64 too, every feature, any tile size."""

  name = "xla"
  computes_float64 = True
  follows_matmul_precision = True  # (its einsums take JAX's default precision)
  forward_reads_fp8 = True  # (widened as they are read: the FP8 path's bytes, not its speed)
  forward = staticmethod(forward)
  backward = staticmethod(backward)


BACKEND = XlaBackend()
