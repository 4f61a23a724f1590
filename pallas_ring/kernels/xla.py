"""Blockwise pure-jnp implementation of the kernel contract (see ``kernels.common``).

It walks exactly the plan's lists (FULL tiles with no mask arithmetic, then PARTIAL tiles with
the elementwise mask), so it is also the oracle for the block logic that the Pallas kernels share.
The default on CPU; vmapped over batch, kv heads and the query heads of each group, so GQA never
repeats K/V.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_ring.kernels import common

FULL = 2


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


def _tile_mask(cfg, qpos, kpos, qseg, kseg, dense, q0, k0, bq, bk):
  """Visibility ``[bq, bk]`` of the tile starting at (q0, k0) of one head."""
  sl = lambda x, s, n: jax.lax.dynamic_slice_in_dim(x, s, n)
  q_pos = sl(qpos, q0, bq)[:, None]
  k_pos = sl(kpos, k0, bk)[None, :]
  k_index = (k0 + jnp.arange(bk, dtype=jnp.int32))[None, :]
  q_seg = None if qseg is None else sl(qseg, q0, bq)[:, None]
  k_seg = None if kseg is None else sl(kseg, k0, bk)[None, :]
  d = None if dense is None else jax.lax.dynamic_slice(dense, (q0, k0), (bq, bk))
  return common.tile_visible(cfg, q_pos, k_pos, k_index, q_seg, k_seg, d)


def _block_ids(n):
  """``[n]`` int32 block numbers (int32 also under x64, so slice starts never mix dtypes)."""
  return jnp.arange(n, dtype=jnp.int32)


def _fwd_head(q, k, v, qpos, kpos, qseg, kseg, dense, kv_index, kv_class, kv_count, *, cfg):
  """One (batch, head): q ``[Tp, H]``, k/v ``[Sp, H]``, lists ``[nq, nk]`` -> o, lse ``[Tp]``."""
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
      s = common.logits(qb, kb, cfg)
      vis = (cls_row[j] == FULL) | _tile_mask(cfg, qpos, kpos, qseg, kseg, dense, q0, k0, bq, bk)
      m_new = jnp.maximum(m, jnp.max(jnp.where(vis, s, common.NEG_INF), axis=1))
      p = jnp.where(vis, jnp.exp(s - m_new[:, None]), 0.0)
      alpha = jnp.exp(m - m_new)
      l = alpha * l + jnp.sum(p, axis=1)
      o = alpha[:, None] * o + jnp.dot(p.astype(v.dtype), vb, preferred_element_type=acc)
      return m_new, l, o

    init = (jnp.full((bq,), common.NEG_INF, acc), jnp.zeros((bq,), acc), jnp.zeros((bq, h), acc))
    m, l, o = jax.lax.fori_loop(0, count, body, init)
    return common.finalize(o, m[:, None], l[:, None])

  o, lse = jax.vmap(q_block)(_block_ids(nq), kv_index, kv_class, kv_count)
  return o.reshape(tp, h).astype(cfg.out_dtype), lse.reshape(tp)


def _dq_head(q, k, v, do, lse, delta, qpos, kpos, qseg, kseg, dense, kv_index, kv_class,
             kv_count, *, cfg):
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
      s = common.logits(qb, kb, cfg)
      vis = (cls_row[j] == FULL) | _tile_mask(cfg, qpos, kpos, qseg, kseg, dense, q0, k0, bq, bk)
      p = jnp.where(vis, jnp.exp(s - lb), 0.0)
      dp = jax.lax.dot_general(dob, vb, (((1,), (1,)), ((), ())), preferred_element_type=acc)
      ds = p * (dp - db) * common.softcap_grad(s, cfg)
      return dq + jnp.dot(ds.astype(k.dtype), kb, preferred_element_type=acc)

    return jax.lax.fori_loop(0, count, body, jnp.zeros((bq, h), acc)) * cfg.scale

  dq = jax.vmap(q_block)(_block_ids(tp // bq), kv_index, kv_class, kv_count)
  return dq.reshape(tp, h)


def _dkv_head(q, k, v, do, lse, delta, qpos, kpos, qseg, kseg, dense, q_index, q_class, q_count,
              *, cfg):
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
      s = common.logits(qb, kb, cfg)
      vis = (cls_row[i] == FULL) | _tile_mask(cfg, qpos, kpos, qseg, kseg, dense, q0, k0, bq, bk)
      p = jnp.where(vis, jnp.exp(s - lb), 0.0)
      dv = dv + jax.lax.dot_general(p.astype(do.dtype), dob, (((0,), (0,)), ((), ())),
                                    preferred_element_type=acc)
      dp = jax.lax.dot_general(dob, vb, (((1,), (1,)), ((), ())), preferred_element_type=acc)
      ds = p * (dp - db) * common.softcap_grad(s, cfg)
      dk = dk + jax.lax.dot_general(ds.astype(q.dtype), qb, (((0,), (0,)), ((), ())),
                                    preferred_element_type=acc)
      return dk, dv

    zeros = jnp.zeros((bk, h), acc)
    dk, dv = jax.lax.fori_loop(0, count, body, (zeros, zeros))
    return dk * cfg.scale, dv

  dk, dv = jax.vmap(kv_block)(_block_ids(sp // bk), q_index, q_class, q_count)
  return dk.reshape(sp, h), dv.reshape(sp, h)


def _head_major(q, k, v, ops, plan_lists):
  """Rearranges everything to ``[B, K, G, ...]`` leading axes for ``_nested_vmap``."""
  b, tp, n, h = q.shape
  kh = k.shape[2]
  q5 = q.reshape(b, tp, kh, n // kh, h).transpose(0, 2, 3, 1, 4)  # [B, K, G, Tp, H]
  kv = lambda x: x.transpose(0, 2, 1, 3)[:, :, None]  # [B, K, 1, Sp, H]
  info = lambda x: None if x is None else x[:, None, None]  # [B|1, 1, 1, L]
  dense = None if ops.dense is None else _split_heads(ops.dense, kh)
  lists = [_split_heads(x, kh) for x in plan_lists]
  head_args = [info(ops.q_info.positions), info(ops.kv_info.positions),
               info(ops.q_info.segment_ids), info(ops.kv_info.segment_ids), dense, *lists]
  return q5, kv(k), kv(v), head_args, (b, kh, n // kh)


def _q_rows(x, kh):
  """``[B, N, Tp]`` row statistics -> ``[B, K, G, Tp]``."""
  return x.reshape(x.shape[0], kh, x.shape[1] // kh, x.shape[2])


@functools.partial(jax.jit, static_argnames=("cfg",))
def forward(q, k, v, ops: common.Operands, plan, cfg: common.KernelConfig):
  """See ``kernels.common``: returns ``(o [B, Tp, N, H], lse [B, N, Tp])``."""
  b, tp, n, h = q.shape
  q5, k5, v5, head_args, sizes = _head_major(
      q, k, v, ops, (plan.kv_index, plan.kv_class, plan.kv_count))
  o, lse = _nested_vmap(functools.partial(_fwd_head, cfg=cfg), [q5, k5, v5, *head_args], sizes)
  o = o.transpose(0, 3, 1, 2, 4).reshape(b, tp, n, h)
  return o, lse.reshape(b, n, tp)


@functools.partial(jax.jit, static_argnames=("cfg",))
def backward(q, k, v, do, lse, delta, ops: common.Operands, plan, cfg: common.KernelConfig):
  """See ``kernels.common``: returns ``(dq, dk, dv)`` in ``acc_dtype``."""
  b, tp, n, h = q.shape
  kh = k.shape[2]
  do5 = do.reshape(b, tp, kh, n // kh, h).transpose(0, 2, 3, 1, 4)
  rows = [_q_rows(lse, kh), _q_rows(delta, kh)]
  q5, k5, v5, head_args, sizes = _head_major(
      q, k, v, ops, (plan.kv_index, plan.kv_class, plan.kv_count))
  dq = _nested_vmap(functools.partial(_dq_head, cfg=cfg), [q5, k5, v5, do5, *rows, *head_args],
                    sizes)
  _, _, _, head_args, _ = _head_major(q, k, v, ops, (plan.q_index, plan.q_class, plan.q_count))
  dk, dv = _nested_vmap(functools.partial(_dkv_head, cfg=cfg),
                        [q5, k5, v5, do5, *rows, *head_args], sizes)
  dq = dq.transpose(0, 3, 1, 2, 4).reshape(b, tp, n, h)
  # [B, K, G, Sp, H] -> sum the query heads of each group -> [B, Sp, K, H]
  dk = jnp.sum(dk, axis=2).transpose(0, 2, 1, 3)
  dv = jnp.sum(dv, axis=2).transpose(0, 2, 1, 3)
  return dq, dk, dv
