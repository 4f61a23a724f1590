"""Pallas kernels lowered through Triton (GPU), implementing ``kernels.common``'s contract.

Triton has no scalar prefetch and no dynamic grid, so the plan's per-row lists are ordinary inputs
and each program loops over its live blocks: ``[0, n_full)`` with no mask arithmetic, then
``[n_full, n_live)`` with the elementwise mask. K/V (forward, dQ) or Q/dO (dK/dV) are whole-
sequence BlockSpecs sliced with ``pl.ds(pl.multiple_of(j * b, b), b)``. Every in-kernel array has
power-of-two sizes: the caller pads the head dim, and the lists are padded here.

Grids: forward and dQ ``(nq, B, N)``; dK/dV ``(nk, B, K)``, one program per kv head that loops
over the query heads of its GQA group, so dK/dV accumulate per kv head (no per-query-head
temporary, and K/V are never repeated).

Exponentials run in base 2 (``exp2`` of logits pre-scaled by log2(e)); lse is returned in natural
log as the contract says.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_ring import masks as masks_lib
from pallas_ring.block_sizes import BlockSizes
from pallas_ring.kernels import backend, common, pallas_triton_decode
from pallas_ring.kernels.triton_logits import dot, dot_nt, logits2

# dK/dV programs unroll the loop over their GQA group's query heads up to this group size.
UNROLL_GROUP = 8


def _pad_last(x, n):
  return x if x.shape[-1] == n else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, n - x.shape[-1])],
                                            mode="edge")


def _block_start(idx_ref, j, block):
  """Row offset of the j-th listed block. (Addressing the plan's consecutive FULL run as
  ``idx_ref[0] + j`` measured slower on the sparse cases: BENCHMARKS.md, "Kernel rules".)"""
  return pl.multiple_of(idx_ref[j] * block, block)


class _Info(NamedTuple):
  """The kernels' token-info refs (None where absent), in ``_info_specs`` order."""

  qpos: Any
  kpos: Any
  qseg: Any
  kseg: Any
  dense: Any  # int8 [., .] tile source of the dense mask
  bias: Any  # additive bias
  alibi: Any  # [1] ALiBi slope of this (batch, head)
  rows: Any  # dropout row keys
  cols: Any  # dropout column keys


class _Side(NamedTuple):
  """One side's per-token vectors of a tile: positions, segment ids, dropout keys."""

  pos: Any
  seg: Any
  key: Any


def _q_side(info: _Info, sl) -> _Side:
  get = lambda r: None if r is None else r[sl]
  return _Side(info.qpos[sl], get(info.qseg), get(info.rows))


def _k_side(info: _Info, sl) -> _Side:
  get = lambda r: None if r is None else r[sl]
  return _Side(info.kpos[sl], get(info.kseg), get(info.cols))


def _causal_alibi(cfg, info: _Info) -> bool:
  """ALiBi under a mask that only sees ``k <= q``: there ``-slope * |q - k|`` splits into a
  column term ``slope * (k - a)``, added to the logits (fused into their scaling), and a row
  term ``slope * (q - a)`` that is constant along a row, so it only shifts the lse. The anchor
  ``a`` is a position of the program's own block (its smallest), so the terms of the tiles that
  matter (near the diagonal) stay small in float32; far tiles have tiny probabilities."""
  return info.alibi is not None and masks_lib.is_causal(cfg.mask)


def _alibi_rows(cfg, info: _Info, q_pos, anchor):
  """The row term (base 2) ``slope * (q - anchor) * log2(e)`` ``[bq]``, or None (no split)."""
  if not _causal_alibi(cfg, info):
    return None
  return (info.alibi[0] * common.LOG2E) * (q_pos - anchor).astype(jnp.float32)


def _tile(cfg, info: _Info, s, qs: _Side, ks: _Side, k0, bk, tile_idx, masked, anchor):
  """Adds bias / ALiBi to base-2 logits ``s`` and computes the tile's mask and dropout keep.

  With ``_causal_alibi`` the logits get only the column term; the caller owns the row term.

  Returns:
    ``(s, vis, keep)``; ``vis`` is None on unmasked tiles; ``keep`` is None without dropout, else
    a function that computes the keep mask: called where it is used, after the row reductions,
    so a ``[bq, bk]`` predicate never stays live across them (registers).
  """
  q_pos, k_pos = qs.pos[:, None], ks.pos[None, :]
  split = _causal_alibi(cfg, info)
  s = common.score_terms(s, None if info.bias is None else info.bias[tile_idx],
                         None if info.alibi is None or split else info.alibi[0], q_pos, k_pos,
                         weight=common.LOG2E)
  if split:
    s = s + ((info.alibi[0] * common.LOG2E) * (ks.pos - anchor).astype(jnp.float32))[None, :]
  vis = None
  if masked:
    k_index = (k0 + jnp.arange(bk, dtype=jnp.int32))[None, :]
    vis = common.tile_visible(
        cfg, q_pos, k_pos, k_index, None if qs.seg is None else qs.seg[:, None],
        None if ks.seg is None else ks.seg[None, :],
        None if info.dense is None else info.dense[tile_idx])
  keep = None
  if cfg.dropout_rate:
    keep = lambda: common.dropout_keep(cfg.dropout_rate, qs.key[:, None], ks.key[None, :])
  return s, vis, keep


def _dropped(x, keep):
  """``x`` where kept, 0 where dropped. The ``1 / (1 - rate)`` scale of kept terms is applied
  once per row or output instead (``o``, ``dq``, ``dk``, ``dv``, with ``delta`` pre-divided)."""
  return x if keep is None else jnp.where(keep(), x, 0.0)


# ----------------------------------------------------------------------------------- forward --

def _fwd_kernel(idx_ref, cnt_ref, nfull_ref, *refs, cfg):
  info = _Info(*refs[:9])
  q_ref, k_ref, v_ref, o_ref, lse_ref = refs[9:]
  bq, bk = cfg.block_q, cfg.block_kv
  hp = q_ref.shape[-1]
  q = q_ref[...]
  qs = _q_side(info, slice(None))
  anchor = jnp.min(qs.pos)

  def step(j, carry, masked):
    m, l, acc = carry
    k0 = _block_start(idx_ref, j, bk)
    kv_slice = pl.ds(k0, bk)
    k = k_ref[kv_slice, :]
    v = v_ref[kv_slice, :]
    s, vis, keep = _tile(cfg, info, logits2(q, k, cfg), qs, _k_side(info, kv_slice), k0, bk,
                         (slice(None), kv_slice), masked, anchor)
    if masked:
      s = jnp.where(vis, s, common.NEG_INF)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    p = jnp.exp2(s - m_new[:, None])
    if masked:
      p = jnp.where(vis, p, 0.0)
    alpha = jnp.exp2(m - m_new)
    l = alpha * l + jnp.sum(p, axis=1)
    pv = _dropped(p, keep)
    acc = alpha[:, None] * acc + dot(pv.astype(v.dtype), v)
    return m_new, l, acc

  carry = (jnp.full((bq,), common.NEG_INF, jnp.float32), jnp.zeros((bq,), jnp.float32),
           jnp.zeros((bq, hp), jnp.float32))
  n_full, n_live = nfull_ref[0], cnt_ref[0]
  carry = jax.lax.fori_loop(0, n_full, functools.partial(step, masked=False), carry)
  m, l, acc = jax.lax.fori_loop(n_full, n_live, functools.partial(step, masked=True), carry)
  empty = l == 0.0
  l_safe = jnp.where(empty, 1.0, l) * (1.0 - cfg.dropout_rate)
  o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
  rows = _alibi_rows(cfg, info, qs.pos, anchor)
  if rows is not None:
    m = m - rows
  lse_ref[...] = jnp.where(empty, -jnp.inf, m * common.LN2 + jnp.log(jnp.where(empty, 1.0, l)))


def _info_specs(ops, tp_block, sp_block, q_grid_axis, kv_grid_axis, group=None):
  """BlockSpecs and arrays of ``_Info`` (token info, dense mask, bias, ALiBi, dropout keys) for
  grids ``(i, b, n)``.

  ``tp_block`` / ``sp_block`` are the query / key extents one program sees; the grid axis 0
  indexes the query side when ``q_grid_axis`` else the key side. With ``group`` the grid's last
  axis is a kv head and per-head arrays get a block of its ``group`` query heads (an extra
  leading block axis; see ``_HeadRef``).

  Returns:
    ``(specs, arrays, grouped)``; ``grouped`` says which fields carry that head-group axis.
  """
  per_head = lambda nx: group is not None and nx > 1
  heads = lambda nx: group if per_head(nx) else None

  def seq_spec(arr, block, blocked):  # [Bp, L] per-token vectors
    if arr is None:
      return None
    bsz = arr.shape[0]
    return pl.BlockSpec((None, block), lambda i, b, n: (common.sel(bsz, b), i if blocked else 0))

  def tile_spec(arr):  # [Bm, Nm, Tp, Sp] dense mask / bias
    if arr is None:
      return None
    bm, nm = arr.shape[:2]
    if q_grid_axis:
      idx = lambda i, b, n: (common.sel(bm, b), common.sel(nm, n), i, 0)
    else:
      idx = lambda i, b, n: (common.sel(bm, b), common.sel(nm, n), 0, i)
    return pl.BlockSpec((None, heads(nm), tp_block, sp_block), idx)

  def head_spec(arr, block, blocked):  # [Bx, Nx, L] per-(batch, head) vectors
    if arr is None:
      return None
    bx, nx = arr.shape[:2]
    return pl.BlockSpec((None, heads(nx), block), lambda i, b, n: (
        common.sel(bx, b), common.sel(nx, n), i if blocked else 0))

  drop = ops.dropout
  dense = None if ops.dense is None else ops.dense.astype(jnp.int8)
  args = _Info(ops.q_info.positions, ops.kv_info.positions, ops.q_info.segment_ids,
               ops.kv_info.segment_ids, dense, ops.bias, ops.alibi,
               None if drop is None else drop.rows, None if drop is None else drop.cols)
  specs = _Info(seq_spec(args.qpos, tp_block, q_grid_axis),
                seq_spec(args.kpos, sp_block, kv_grid_axis),
                seq_spec(args.qseg, tp_block, q_grid_axis),
                seq_spec(args.kseg, sp_block, kv_grid_axis),
                tile_spec(dense), tile_spec(ops.bias), head_spec(ops.alibi, 1, False),
                head_spec(args.rows, tp_block, q_grid_axis),
                seq_spec(args.cols, sp_block, kv_grid_axis))
  grouped = _Info(*(a is not None and a.ndim >= 3 and per_head(a.shape[1]) for a in args))
  return list(specs), list(args), grouped


def _list_specs(index, count, nfull, group=None):
  """BlockSpecs for one program's list row: ``index [Bp, Np, nrows, L]`` (L padded to pow2).

  With ``group`` (and per-head lists, Np > 1) a program's grid head is a kv head and its block
  holds the rows of that head's ``group`` query heads (see ``_HeadRef``).
  """
  bp, np_ = index.shape[:2]
  length = backend.next_pow2(index.shape[-1])
  index = _pad_last(index, length)
  heads = group if group is not None and np_ > 1 else None
  row = lambda i, b, n: (common.sel(bp, b), common.sel(np_, n), i, 0)
  one = lambda i, b, n: (common.sel(bp, b), common.sel(np_, n), i)
  specs = [pl.BlockSpec((None, heads, None, length), row),
           pl.BlockSpec((None, heads, 1), one), pl.BlockSpec((None, heads, 1), one)]
  return specs, [index, count, nfull], heads is not None


class _HeadRef:
  """A ref seen at query head ``g`` of its head-group block axis ``axis`` (``ref[..]`` inserts
  ``g`` there), so per-head code runs unchanged over the heads of a GQA group."""

  def __init__(self, ref, g, axis=0):
    self.ref, self.g, self.axis = ref, g, axis

  def __getitem__(self, idx):
    idx = idx if isinstance(idx, tuple) else (idx,)
    if idx == (Ellipsis,):
      idx = ()
    return self.ref[idx[:self.axis] + (self.g,) + idx[self.axis:]]


def _params(cfg, bwd=False):
  warps = cfg.num_warps or 4
  stages = cfg.num_stages or (2 if bwd else 3)
  return plgpu.CompilerParams(num_warps=warps, num_stages=stages)


@functools.partial(jax.jit, static_argnames=("cfg",))
def forward(q, k, v, ops: common.Operands, plan, cfg: common.KernelConfig, acc=None):
  """See ``kernels.common``: returns ``(o [B, Tp, N, Hp], lse [B, N, Tp] float32)``."""
  b, tp, n, hp = q.shape
  sp, kh = k.shape[1], k.shape[2]
  g = n // kh
  bq = cfg.block_q
  list_specs, list_args, _ = _list_specs(plan.kv_index, plan.kv_count, plan.kv_full)
  info_specs, info_args, _ = _info_specs(ops, bq, sp, True, False)
  in_specs = list_specs + info_specs + [
      pl.BlockSpec((None, bq, None, hp), lambda i, b_, n_: (b_, i, n_, 0)),
      pl.BlockSpec((None, sp, None, hp), lambda i, b_, n_: (b_, 0, n_ // g, 0)),
      pl.BlockSpec((None, sp, None, hp), lambda i, b_, n_: (b_, 0, n_ // g, 0)),
  ]
  out_specs = [pl.BlockSpec((None, bq, None, hp), lambda i, b_, n_: (b_, i, n_, 0)),
               pl.BlockSpec((None, None, bq), lambda i, b_, n_: (b_, n_, i))]
  out_shape = [jax.ShapeDtypeStruct((b, tp, n, hp), cfg.out_dtype),
               jax.ShapeDtypeStruct((b, n, tp), jnp.float32)]
  o, lse = pl.pallas_call(
      functools.partial(_fwd_kernel, cfg=cfg), grid=(tp // bq, b, n), in_specs=in_specs,
      out_specs=out_specs, out_shape=out_shape, compiler_params=_params(cfg),
      interpret=cfg.interpret, name="pallas_ring_fwd")(*list_args, *info_args, q, k, v)
  # (Merging in the kernel's epilogue measured slower: BENCHMARKS.md, "Kernel rules".)
  return common.merged(acc, o, lse)


# ---------------------------------------------------------------------------------- backward --

def _dq_kernel(idx_ref, cnt_ref, nfull_ref, *refs, cfg):
  info = _Info(*refs[:9])
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *acc_ref, dq_ref = refs[9:]  # acc: running dq
  bk = cfg.block_kv_bwd
  q, do = q_ref[...], do_ref[...]
  lse2 = common.safe_lse(lse_ref[...]) * common.LOG2E
  delta = delta_ref[...] * (1.0 - cfg.dropout_rate)  # see _dropped
  qs = _q_side(info, slice(None))
  anchor = jnp.min(qs.pos)
  rows = _alibi_rows(cfg, info, qs.pos, anchor)
  if rows is not None:
    lse2 = lse2 + rows

  def step(j, dq, masked):
    k0 = _block_start(idx_ref, j, bk)
    kv_slice = pl.ds(k0, bk)
    k = k_ref[kv_slice, :]
    v = v_ref[kv_slice, :]
    s_cap = logits2(q, k, cfg)
    s, vis, keep = _tile(cfg, info, s_cap, qs, _k_side(info, kv_slice), k0, bk,
                         (slice(None), kv_slice), masked, anchor)
    p = jnp.exp2(s - lse2[:, None])
    if masked:
      p = jnp.where(vis, p, 0.0)
    dp = _dropped(dot_nt(do, v), keep)
    ds = p * (dp - delta[:, None]) * common.softcap_grad(s_cap * common.LN2, cfg)
    return dq + dot(ds.astype(k.dtype), k)

  dq = jnp.zeros(dq_ref.shape, jnp.float32)
  dq = jax.lax.fori_loop(0, nfull_ref[0], functools.partial(step, masked=False), dq)
  dq = jax.lax.fori_loop(nfull_ref[0], cnt_ref[0], functools.partial(step, masked=True), dq)
  dq = dq * (cfg.scale * cfg.keep_scale)
  if acc_ref:
    dq = dq + acc_ref[0][...].astype(jnp.float32)
  dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkv_kernel(idx_ref, cnt_ref, nfull_ref, *refs, cfg, group, grouped, grouped_lists):
  """dK/dV of one (kv block, batch, kv head): loops over the ``group`` query heads of the kv head
  (q, dO, lse, delta blocks hold all of them), so dK/dV accumulate per kv head in registers."""
  info = _Info(*refs[:9])
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref = refs[9:]
  bq, bk = cfg.block_q_bwd, cfg.block_kv_bwd
  k, v = k_ref[...], v_ref[...]
  k0 = pl.program_id(0) * bk
  ks = _k_side(info, slice(None))
  anchor = jnp.min(ks.pos)  # once per program (a reduction in the loop would cost barriers)

  def one_head(g, carry):
    at = lambda r, axis=0: _HeadRef(r, g, axis)
    hinfo = _Info(*(r if not f else at(r) for r, f in zip(info, grouped)))
    lists = [at(r) if grouped_lists else r for r in (idx_ref, cnt_ref, nfull_ref)]
    idx, cnt, nfull = lists
    q_h, do_h, lse_h, delta_h = at(q_ref, 1), at(do_ref, 1), at(lse_ref), at(delta_ref)

    def step(i, carry, masked):
      dk, dv = carry
      q0 = _block_start(idx, i, bq)
      q_slice = pl.ds(q0, bq)
      q = q_h[q_slice, :]
      do = do_h[q_slice, :]
      lse2 = common.safe_lse(lse_h[q_slice]) * common.LOG2E
      delta = delta_h[q_slice] * (1.0 - cfg.dropout_rate)  # see _dropped
      qs = _q_side(hinfo, q_slice)
      rows = _alibi_rows(cfg, hinfo, qs.pos, anchor)
      if rows is not None:
        lse2 = lse2 + rows
      s_cap = logits2(q, k, cfg)
      s, vis, keep = _tile(cfg, hinfo, s_cap, qs, ks, k0, bk, (q_slice, slice(None)), masked,
                           anchor)
      p = jnp.exp2(s - lse2[:, None])
      if masked:
        p = jnp.where(vis, p, 0.0)
      if keep is not None:  # one hash evaluation for both uses
        kept = keep()
        keep = lambda: kept
      dv = dv + dot(_dropped(p, keep).astype(do.dtype).T, do)
      dp = _dropped(dot_nt(do, v), keep)
      ds = p * (dp - delta[:, None]) * common.softcap_grad(s_cap * common.LN2, cfg)
      dk = dk + dot(ds.astype(q.dtype).T, q)
      return dk, dv

    carry = jax.lax.fori_loop(0, nfull[0], functools.partial(step, masked=False), carry)
    return jax.lax.fori_loop(nfull[0], cnt[0], functools.partial(step, masked=True), carry)

  carry = (jnp.zeros(dk_ref.shape, jnp.float32),) * 2
  if group <= UNROLL_GROUP:  # static head indices: plain strided addressing
    for g in range(group):
      carry = one_head(g, carry)
    dk, dv = carry
  else:
    dk, dv = jax.lax.fori_loop(0, group, one_head, carry)
  dk_ref[...] = (dk * (cfg.scale * cfg.keep_scale)).astype(dk_ref.dtype)
  dv_ref[...] = (dv * cfg.keep_scale).astype(dv_ref.dtype)


@functools.partial(jax.jit, static_argnames=("cfg", "parts"))
def backward(q, k, v, do, lse, delta, ops: common.Operands, plan, cfg: common.KernelConfig,
             dq_acc=None, parts=common.BOTH, dkv_acc=None):
  """See ``kernels.common``: returns ``(dq, dk, dv)`` in ``cfg.out_dtype`` (the dQ kernel adds
  ``dq_acc`` to its rows; ``dkv_acc`` is added after the dK/dV kernel)."""
  want_dq, want_dkv = common.wants(parts)
  delta = common.delta_array(delta, do)
  dq = dk = dv = None
  if want_dq:
    dq = _dq_call(q, k, v, do, lse, delta, ops, plan, cfg, dq_acc)
  if want_dkv:
    dk, dv = _dkv_call(q, k, v, do, lse, delta, ops, plan, cfg)
  return common.accumulated(None, (dq, dk, dv), dkv_acc)


def _dq_call(q, k, v, do, lse, delta, ops, plan, cfg, dq_acc):
  """The dQ kernel: one program per (q block, batch, head), walking its live kv blocks."""
  b, tp, n, hp = q.shape
  sp, kh = k.shape[1], k.shape[2]
  g = n // kh
  bq = cfg.block_q_bwd
  params = _params(cfg, bwd=True)
  list_specs, list_args, _ = _list_specs(plan.kv_index, plan.kv_count, plan.kv_full)
  info_specs, info_args, _ = _info_specs(ops, bq, sp, True, False)
  q_block = pl.BlockSpec((None, bq, None, hp), lambda i, b_, n_: (b_, i, n_, 0))
  kv_whole = pl.BlockSpec((None, sp, None, hp), lambda i, b_, n_: (b_, 0, n_ // g, 0))
  row_block = pl.BlockSpec((None, None, bq), lambda i, b_, n_: (b_, n_, i))
  return pl.pallas_call(
      functools.partial(_dq_kernel, cfg=cfg), grid=(tp // bq, b, n),
      in_specs=list_specs + info_specs + [q_block, kv_whole, kv_whole, q_block, row_block,
                                          row_block] + ([] if dq_acc is None else [q_block]),
      out_specs=q_block, out_shape=jax.ShapeDtypeStruct((b, tp, n, hp), cfg.out_dtype),
      compiler_params=params, interpret=cfg.interpret, name="pallas_ring_dq",
  )(*list_args, *info_args, q, k, v, do, lse, delta, *(() if dq_acc is None else (dq_acc,)))


def _dkv_call(q, k, v, do, lse, delta, ops, plan, cfg):
  """The dK/dV kernel: one program per (kv block, batch, kv head), looping over the group's
  query heads."""
  b, tp, n, hp = q.shape
  sp, kh = k.shape[1], k.shape[2]
  g = n // kh
  bk = cfg.block_kv_bwd
  params = _params(cfg, bwd=True)
  list_specs, list_args, grouped_lists = _list_specs(plan.q_index, plan.q_count, plan.q_full,
                                                     group=g)
  info_specs, info_args, grouped = _info_specs(ops, tp, bk, False, True, group=g)
  q_whole = pl.BlockSpec((None, tp, g, hp), lambda j, b_, kvh: (b_, 0, kvh, 0))
  kv_block = pl.BlockSpec((None, bk, None, hp), lambda j, b_, kvh: (b_, j, kvh, 0))
  rows_whole = pl.BlockSpec((None, g, tp), lambda j, b_, kvh: (b_, kvh, 0))
  dkv_shape = jax.ShapeDtypeStruct((b, sp, kh, hp), cfg.out_dtype)
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, cfg=cfg, group=g, grouped=grouped,
                        grouped_lists=grouped_lists),
      grid=(sp // bk, b, kh),
      in_specs=list_specs + info_specs + [q_whole, kv_block, kv_block, q_whole, rows_whole,
                                          rows_whole],
      out_specs=[kv_block, kv_block], out_shape=[dkv_shape, dkv_shape],
      compiler_params=params, interpret=cfg.interpret, name="pallas_ring_dkv",
  )(*list_args, *info_args, q, k, v, do, lse, delta)
  return dk, dv


class TritonBackend(backend.Backend):
  """Pallas through Triton on any GPU: every feature; tiles are powers of two >= 16."""

  name = "pallas_triton"
  platform = "gpu"

  def default_block_sizes(self, head_dim, device_kind, dtype=None, value_dim=None):
    del value_dim  # (v is padded to q's head dim)
    if head_dim <= 64:
      return BlockSizes(128, 128, 64, 64, 4, 3)
    if head_dim <= 128:
      return BlockSizes(128, 64, 64, 64, 4, 3)
    return BlockSizes(64, 32, 32, 32, 4, 2)

  def block_size_error(self, field, value):
    if value < 16 or value & (value - 1):
      return (f"Triton tiles must be powers of two >= 16 (tl.dot's minimum). Use "
              f"{max(16, backend.next_pow2(value))}, or None for the tuned default.")
    return None

  def tile_caps(self, q_len, kv_len):
    cap_k = max(16, backend.next_pow2(kv_len))
    return max(16, backend.next_pow2(q_len)), cap_k, cap_k

  def padded_head_dim(self, head_dim):
    return max(16, backend.next_pow2(head_dim))  # Triton arrays: powers of two >= 16

  def tuning_candidates(self, head_dim, interpret):
    if interpret:
      return {"fwd": [dict(block_q=16, block_kv=16), dict(block_q=32, block_kv=16)],
              "bwd": [dict(block_q_bwd=16, block_kv_bwd=16), dict(block_q_bwd=16,
                                                                  block_kv_bwd=32)]}
    tiles = [64, 128] if head_dim <= 128 else [32, 64]
    fwd = [dict(block_q=q, block_kv=k, num_warps=w, num_stages=s)
           for q in tiles for k in tiles for w in (4, 8) for s in (2, 3, 4)]
    bwd_tiles = sorted({32, *tiles})
    return {"fwd": fwd, "bwd": [dict(block_q_bwd=q, block_kv_bwd=k)
                                for q in bwd_tiles for k in bwd_tiles]}

  def decode_programs(self, interpret, fp8=False):
    # One per SM: the dedicated decode kernel read the caches of BENCHMARKS.md's decode table
    # 0-4% faster than with two (and merges fewer chunks). Two on an FP8 cache, whose tiles
    # (half the bytes, widened in registers) leave one program per SM latency-bound
    # (BENCHMARKS.md, "Decode from an FP8 cache").
    return backend.gpu_programs(interpret, per_sm=2 if fp8 else 1)

  forward = staticmethod(forward)
  backward = staticmethod(backward)
  decode_reads_fp8 = True

  decode = staticmethod(pallas_triton_decode.decode)


BACKEND = TritonBackend()
