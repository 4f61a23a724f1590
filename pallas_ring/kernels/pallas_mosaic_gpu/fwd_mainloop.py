"""The forward's main loop: a consumer warpgroup's walk over one work item's K/V tiles, serial
(q.k^T, softmax, p.v per tile) or overlapped (tile j's softmax while tile j-1's p.v runs), with
the online softmax in registers; and the consumer's q loads."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional

from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_ring.kernels import common
from pallas_ring.kernels.pallas_mosaic_gpu import fp8
from pallas_ring.kernels.pallas_mosaic_gpu.fwd_scheduler import FwdGeometry, plan_row, work_item
from pallas_ring.kernels.pallas_mosaic_gpu.pipeline import (
    COLS, ROWS, broadcast_info, head_view, keep_alive, load_ref, mark_issued, slot_of,
    step_index, wait_to_issue, wgmma_accumulator_load)
from pallas_ring.kernels.pallas_mosaic_gpu.terms import (
    TermRefs, TermStage, broadcast, keep, kept, logit_slope, logits, position_slope,
    position_term, term_window, with_terms)
from pallas_ring.kernels.pallas_mosaic_gpu.tiles import COMPUTE_WGS


class FwdRefs(NamedTuple):
  """The forward kernel's refs: global memory, then shared-memory scratch and barriers."""

  plan: tuple  # (kv_index, kv_count, kv_full): the plan's lists [Bp, Np, q_blocks, ...]
  q_info: Any  # int32 [Bi, info_rows, Tp]: the queries' token info
  k_info: Any  # int32 [Bi, key_rows, Sp]: the keys' (``terms.key_info``)
  terms: TermRefs  # the score terms' inputs
  q: Any  # [B, Tp, N, H]
  k: Any  # [B, Sp, K, H]
  v: Any  # [B, Sp, K, Hv]; FP8: [B, K, Hv, Sp] (``fp8.v_layout``)
  descales: Any  # FP8: float32 [Bs, N, 3], q's, k's and v's descales (``fp8.descales``); None
  acc: tuple  # merging: the earlier passes' (o [B, Tp, N, Hv], lse [B, N, Tp]) float32; else ()
  o: Any  # [B, Tp, N, Hv]
  lse: Any  # [B, N, Tp] float32
  q_smem: Any  # [COMPUTE_WGS, bq, H]: each consumer's q tile
  k_smem: Any  # [slots, bk, H]
  v_smem: Any  # [slots, bk, Hv]; FP8: [slots, Hv, bk]
  lse_smem: Any  # [COMPUTE_WGS, bq] float32: lse staging
  qinfo_smem: Any  # [COMPUTE_WGS, info_rows, bq] int32
  kinfo_smem: Any  # [slots, key_rows, bk] int32
  rkey_smem: Any  # [COMPUTE_WGS, bq] int32: dropout's row keys (8 columns without dropout)
  k_bar: Any  # per slot: K (and its token info) landed
  v_bar: Any  # per slot: V landed
  q_bar: Any  # per consumer: its q tile (token info, row keys) landed
  k_free: Any  # per slot: both consumers are done with K
  v_free: Any  # per slot: both consumers are done with V
  stage: Optional[TermStage]  # a staged tile term's windows
  o_smem: Any  # [COMPUTE_WGS, bq, Hv]: each consumer's o staging (``FwdGeometry.o_staging``)


class Consumer(NamedTuple):
  """A consumer warpgroup's static context and its own shared-memory tiles."""

  cfg: common.KernelConfig
  g: FwdGeometry
  r: FwdRefs
  wg: Any  # this warpgroup's index
  q_smem: Any  # [bq, H]
  o_smem: Any  # [bq, Hv]: o staging (``FwdGeometry.o_staging``)
  lse_smem: Any  # [bq]
  qinfo_smem: Any  # [info_rows, bq]
  rkey_smem: Any  # [bq]
  m0: Any  # [bq] the row max before the first tile (``NEG_INF``)
  l0: Any  # [bq] the row sum before the first tile (0)

  def q_at(self, k0):
    """This consumer's q tile in the step of the key tile from ``k0`` (``pipeline.step_index``)."""
    return self.r.q_smem.at[step_index(self.wg, k0, self.g.step_refs)]

  def first_row(self, qi):
    """This consumer's first row in q block ``qi``."""
    return qi * (COMPUTE_WGS * self.g.bq) + self.wg * self.g.bq


class ItemRows(NamedTuple):
  """A consumer's rows of one work item (``open_item``): what its walk and epilogue read."""

  batch: Any
  head: Any
  q0: Any  # the first row
  idx_row: Any  # the plan row's kv block indices (a ref)
  count: Any  # live kv blocks
  n_full: Any  # of which the first are mask-free
  base: Any  # the CTA's earlier tiles: the slot ring runs on across items
  q_info: Any  # token info rows (positions, then segment ids) broadcast to [bq, bk]
  slope: Any  # the position term's slope (base 2), or None
  k_slope: Any  # the same in ``with_terms``' units
  anchor: Any  # separable position term: its anchor (the first row's position); else None
  q_term: Any  # separable position term: the rows' query term [bq] (base 2); else None
  descale: Any  # FP8: the raw q.k's descale (a scalar); else None
  out_descale: Any  # FP8: the output's (v's descale); else None

  def slot(self, g: FwdGeometry, j):
    """The slot of the item's tile j."""
    return slot_of(self.base + j, g.slots)


def load_q(c: Consumer, i) -> None:
  """Issues the loads of this consumer's q rows of item ``i`` and their token info."""
  g, r = c.g, c.r
  batch, head, qi = work_item(g, i)
  q0 = c.first_row(qi)
  plgpu.copy_gmem_to_smem(r.q.at[batch, pl.ds(q0, g.bq), head], c.q_smem, r.q_bar.at[c.wg])
  plgpu.copy_gmem_to_smem(r.q_info.at[common.sel(r.q_info.shape[0], batch), :,
                                      pl.ds(q0, g.bq)], c.qinfo_smem, r.q_bar.at[c.wg])
  if g.terms.dropout:
    plgpu.copy_gmem_to_smem(head_view(r.terms.row_keys, batch, head).at[pl.ds(q0, g.bq)],
                            c.rkey_smem, r.q_bar.at[c.wg])


def open_item(c: Consumer, i, base) -> ItemRows:
  """Waits for this consumer's q rows of item ``i`` and returns them (``base``: the CTA's
  earlier tiles)."""
  g, r = c.g, c.r
  batch, head, qi = work_item(g, i)
  q0 = c.first_row(qi)
  idx_row, count, n_full = plan_row(r.plan, batch, head, qi)
  plgpu.barrier_wait(r.q_bar.at[c.wg])
  # Token info rows (positions, then segment ids) broadcast to the [bq, bk] tile.
  q_info = broadcast_info(c.qinfo_smem, ROWS, (g.bq, g.bk), 0, g.info_rows)
  slope = position_slope(r.terms.slopes, batch, head)
  descale, out_descale = fp8.descales(r.descales, batch, head)
  # (the keys' side, in the units of ``with_terms``)
  k_slope = logit_slope(slope, c.cfg, descale)
  anchor = q_term = None
  if g.terms.separable:  # (``terms``: the anchor is this consumer's first row's position)
    anchor = r.q_info[common.sel(r.q_info.shape[0], batch), 0, q0]
    q_term = position_term(slope, load_ref(c.qinfo_smem.at[0], ROWS), anchor)
  return ItemRows(batch, head, q0, idx_row, count, n_full, base, q_info, slope, k_slope, anchor,
                  q_term, descale, out_descale)


def walk(c: Consumer, rows: ItemRows):
  """This consumer's walk over the item's tiles: ``(acc, m, l)``, the unnormalised output
  ``[bq, Hv]`` float32 and the rows' base-2 max and sum."""
  if c.g.overlap:
    return pl.run_scoped(functools.partial(_overlapped_walk, c, rows),
                         plgpu.ACC((c.g.bq, c.g.value_dim), jnp.float32))
  return _serial_walk(c, rows)


def _softmax(c: Consumer, rows: ItemRows, s_raw, k0, slot, m, l, masked):
  """``(p, m, l, alpha)`` (``p`` as ``fp8.p_tile``) after the raw logits of the tile of keys
  from ``k0``; releases the tile's K slot."""
  g, cfg, r = c.g, c.cfg, c.r
  shape = (g.bq, g.bk)
  # The slot's key info is read before the slot is released to the producer (which then
  # overwrites it with a later tile's).
  k_info = (broadcast_info(r.kinfo_smem.at[slot], COLS, shape, 1, g.key_rows)
            if g.terms.tile_info(masked) else None)
  vis = None
  if g.terms.vis_on(masked):
    k_index = k0 + plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
    vis = common.tile_visible(cfg, rows.q_info[0], k_info[0], k_index, *rows.q_info[1:],
                              *k_info[1:g.info_rows])
  position = None
  if g.terms.separable:
    k_term = position_term(rows.k_slope, load_ref(r.kinfo_smem.at[slot].at[0], COLS),
                           rows.anchor)
    position = broadcast(k_term, shape, 1)
  elif rows.slope is not None:
    position = (rows.k_slope, rows.q_info[0], k_info[0])
  tile = term_window(g.terms, r.terms.tile_term, masked, rows.batch, rows.head, rows.q0, k0,
                     shape, r.stage, c.wg)
  s, scale = logits(s_raw, cfg, rows.descale)
  s = with_terms(s, scale, position, tile)
  plgpu.barrier_arrive(r.k_free.at[slot])
  if vis is not None:
    s = jnp.where(vis, s, common.NEG_INF)
  row_max, shift = s.max(axis=1) * scale, fp8.row_max_shift(g.dtype)  # base 2
  if shift:  # (FP8: p scaled up, the lse shifted back)
    row_max = row_max - shift
  m_new = jnp.maximum(m, row_max)
  alpha = jnp.exp2(m - m_new)
  p = jnp.exp2(s * scale - lax.broadcast_in_dim(m_new, s.shape, [0]))
  if vis is not None:
    p = jnp.where(vis, p, 0.0)
  p_kept = p
  if g.terms.dropout:  # (after the row reductions: the mask is not live across them)
    p_kept = kept(p, keep(cfg, broadcast(load_ref(c.rkey_smem, ROWS), shape, 0), k_info[-1]))
  return fp8.p_tile(p_kept, g.dtype), m_new, l * alpha + p.sum(axis=1), alpha


def _serial_step(c: Consumer, rows: ItemRows, j, carry, masked):
  """Tile j: q.k^T, its softmax, then p.v, complete before tile j+1's q.k^T."""
  g, r = c.g, c.r
  acc, m, l = carry
  slot, k0 = rows.slot(g, j), rows.idx_row[j] * g.bk

  def qk(acc_ref):
    plgpu.wgmma(acc_ref, c.q_at(k0), r.k_smem.at[slot].transpose((1, 0)))
    mark_issued()
    return acc_ref[...]

  p16, m_new, l, alpha = _softmax(c, rows, pl.run_scoped(qk, plgpu.ACC((g.bq, g.bk), jnp.float32)),
                                  k0, slot, m, l, masked)
  acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
  acc, l, m_new, a = lax.optimization_barrier((acc, l, m_new, fp8.a_operand(p16, g.dtype)))
  plgpu.barrier_wait(r.v_bar.at[slot])
  wait_to_issue()

  def pv(acc_ref):
    plgpu.wgmma(acc_ref, a, fp8.v_operand(r.v_smem.at[slot], g.fp8))
    nxt = j + 1

    @pl.when(nxt < rows.count)
    def _():
      plgpu.barrier_wait(r.k_bar.at[rows.slot(g, nxt)])

  acc = pl.run_state(pv)(plgpu.ACC.init(acc))
  plgpu.barrier_arrive(r.v_free.at[slot])
  return acc, m_new, l


def _serial_walk(c: Consumer, rows: ItemRows):
  @pl.when(rows.count > 0)
  def _():
    plgpu.barrier_wait(c.r.k_bar.at[rows.slot(c.g, 0)])

  acc = plgpu.layout_cast(jnp.zeros((c.g.bq, c.g.value_dim), jnp.float32), plgpu.Layout.WGMMA)
  full = lax.fori_loop(0, rows.n_full, functools.partial(_serial_step, c, rows, masked=False),
                       (acc, c.m0, c.l0))
  return lax.fori_loop(rows.n_full, rows.count,
                       functools.partial(_serial_step, c, rows, masked=True), full)


def _overlapped_step(c: Consumer, rows: ItemRows, o_ref, j, p16_prev, m, l, masked):
  """Issues tile j's q.k^T and (unless ``p16_prev`` is None) tile j-1's p.v into ``o_ref``, and
  returns tile j's ``(p16, m, l)`` from its softmax, run while p.v runs; then waits for p.v and
  rescales ``o_ref``."""
  g, r = c.g, c.r
  slot, prev = rows.slot(g, j), rows.slot(g, j + g.slots - 1)
  k0 = rows.idx_row[j] * g.bk
  a_prev = None if p16_prev is None else fp8.a_operand(p16_prev, g.dtype)
  plgpu.barrier_wait(r.k_bar.at[slot])
  wait_to_issue()

  def qk(s_ref):
    plgpu.wgmma(s_ref, c.q_at(k0), r.k_smem.at[slot].transpose((1, 0)))
    if p16_prev is not None:
      plgpu.barrier_wait(r.v_bar.at[prev])
      plgpu.wgmma(o_ref, a_prev, fp8.v_operand(r.v_smem.at[prev], g.fp8))
    mark_issued()
    # q.k^T was issued first, so it is done once at most p.v is in flight.
    return wgmma_accumulator_load(s_ref, wait_n=0 if p16_prev is None else 1)

  p16, m_new, l, alpha = _softmax(c, rows, pl.run_scoped(qk, plgpu.ACC((g.bq, g.bk), jnp.float32)),
                                  k0, slot, m, l, masked)
  if p16_prev is not None:
    plgpu.wgmma_wait(0)
    keep_alive(a_prev, fp8.a_layout(g.dtype))
    plgpu.barrier_arrive(r.v_free.at[prev])
    o_ref[...] = o_ref[...] * lax.broadcast_in_dim(alpha, (g.bq, g.value_dim), [0])
  return p16, m_new, l


def _overlapped_walk(c: Consumer, rows: ItemRows, o_ref):
  g, r, count = c.g, c.r, rows.count
  step = lambda masked: lambda j, carry: _overlapped_step(c, rows, o_ref, j, *carry,
                                                          masked=masked)
  # The first tile is always masked (its token info is loaded for that), as only it has no p.v
  # to overlap.
  first = lambda: _overlapped_step(c, rows, o_ref, jnp.int32(0), None, c.m0, c.l0, masked=True)
  p16 = plgpu.layout_cast(jnp.zeros((g.bq, g.bk), fp8.p_tile_dtype(g.dtype)),
                          plgpu.Layout.WGMMA)
  carry = lax.cond(count > 0, first, lambda: (p16, c.m0, c.l0))
  carry = lax.fori_loop(1, rows.n_full, step(False), carry)
  p16, m, l = lax.fori_loop(jnp.maximum(rows.n_full, 1), count, step(True), carry)

  @pl.when(count > 0)
  def _():  # the last tile's p.v
    last = rows.slot(g, count - 1)
    wait_to_issue()
    plgpu.barrier_wait(r.v_bar.at[last])
    plgpu.wgmma(o_ref, fp8.a_operand(p16, g.dtype), fp8.v_operand(r.v_smem.at[last], g.fp8))
    mark_issued()
    plgpu.wgmma_wait(0)
    plgpu.barrier_arrive(r.v_free.at[last])

  return o_ref[...], m, l
