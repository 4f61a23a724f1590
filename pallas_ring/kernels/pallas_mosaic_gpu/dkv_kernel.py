"""The Mosaic GPU dK/dV kernel: a CTA owns 128 keys of one kv head (two consumers of 64) and
walks, for each query head of the group, the transposed plan row of its kv block (``q_index``):
q, dO, lse and delta in ``Variants.dkv_walk_rows`` tiles. dK and dV accumulate per kv head in
registers (GQA needs no per-query-head temporary). With few kv heads the group is split over
several CTAs per block (``tiles.dkv_head_splits``), each writing float32 partials summed after
the kernel. The consumers alternate their matmuls like the forward's (``pipeline.pingpong``).

Above head dim 128 ("wide") the two consumers share the CTA's 64 keys and split the work
(``dkv_mainloop.p_and_dv``, ``ds_and_dk``). Fused (``tiles.fused_backward``, head dims up to
128) the consumers also add each tile's ``ds^T K`` to dQ (``dkv_fused``). This module holds the
CTA's context (its owned keys, the walked tiles' score terms) and the producer; the consumers'
main loops are ``dkv_mainloop``'s."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_ring.kernels import common
from pallas_ring.kernels.pallas_mosaic_gpu import dkv_mainloop
from pallas_ring.kernels.pallas_mosaic_gpu import bwd_common
from pallas_ring.kernels.pallas_mosaic_gpu.bwd_common import BwdGeometry, TileTerms
from pallas_ring.kernels.pallas_mosaic_gpu.pipeline import (
    COLS, ROWS, broadcast_info, head_view, load_ref, slot_of, step_index)
from pallas_ring.kernels.pallas_mosaic_gpu.terms import (
    TermRefs, TermStage, broadcast, copy_tile_term, logit_slope, position_slope, position_term,
    term_window)
from pallas_ring.kernels.pallas_mosaic_gpu.tiles import BWD_BLOCK, COMPUTE_WGS


class DkvRefs(NamedTuple):
  """The dK/dV kernel's refs: global memory, then shared-memory scratch and barriers."""

  plan: tuple  # (q_index, q_count, q_full): the plan's transposed lists
  q_info: Any  # int32 [Bi, info_rows, Tp]
  k_info: Any  # int32 [Bi, key_rows, Sp] (``terms.key_info``)
  terms: TermRefs  # (its tile term transposed: [Bt, Nt, Sp, Tp])
  q: Any  # [B, Tp, N, H]
  k: Any  # [B, Sp, K, H]
  v: Any  # [B, Sp, K, Hv]
  do: Any  # [B, Tp, N, Hv]
  lse: Any  # [B, N, Tp] float32, base 2
  delta: Any  # [B, N, Tp] float32
  dq: Optional[Any]  # fused: the float32 dQ [B, Tp, N, H], a mutable input
  dk: Any  # [B, Sp, K, H], or float32 partials [splits, B, Sp, K, H]
  dv: Any  # as dk, at Hv
  k_own: Any  # [COMPUTE_WGS, 64, H] ([64, H] when wide)
  v_own: Any  # as k_own, at Hv
  kinfo_own: Any  # [COMPUTE_WGS, key_rows, 64] int32 ([key_rows, 64] when wide)
  p_smem: Any  # wide: [2, 64, walk], the p^T buffers; else None
  # fused: (ds^T tiles [2, 64, walk], dQ staging [2, walk, H] float32); split dQ: ([2, 2, 64,
  # walk] by step parity, [2, walk, H/2]); else None
  dq_smem: Any
  stage: Optional[TermStage]  # a staged tile term's windows (read by warpgroup 0 alone when wide)
  q_smem: Any  # [q_slots, walk, H]
  do_smem: Any  # [slots, walk, Hv]
  lse_smem: Any  # [q_slots, walk] float32
  delta_smem: Any  # [slots, walk] float32
  qinfo_smem: Any  # [q_slots, info_rows, walk] int32
  rkey_smem: Any  # [q_slots, walk] int32: dropout's row keys (8 columns without dropout)
  out_k: Any  # [2, 64, H]: dK staging (aliases the walked slots)
  out_v: Any  # [2, 64, Hv]: dV staging (``out_k``, or aliasing it where Hv < H)
  own_bar: Any  # per consumer: its owned tiles landed
  q_bar: Any  # per q slot: q, lse (token info, row keys) landed
  do_bar: Any  # per slot: dO, delta landed
  free: Any  # per slot: both consumers are done with it (and its q slot, but with extra_q_slot)
  sched: Any  # the consumers' meetings (``pipeline.meet``)
  p_full: Any  # wide: per p^T buffer: written
  p_free: Any  # wide: per p^T buffer: read
  descales: Any = None  # FP8 mode: float32 [B, N, 4] (``fp8.backward_operands``)
  q16: Any = None  # FP8 mode: 16-bit q [B, Tp, N, H] for ds^T q
  do_t: Any = None  # FP8 mode: dO in ``fp8.v_layout`` [B, N, Hv, Tp] for p^T dO
  q16_smem: Any = None  # FP8 mode: [q_slots, walk, H], 16-bit (arrives with q)
  do_t_smem: Any = None  # FP8 mode: [slots, Hv, walk] (arrives with dO)
  q_free: Any = None  # extra_q_slot: per q slot: both consumers are done with it


def _refs(refs, g: BwdGeometry) -> DkvRefs:
  """``DkvRefs`` of the kernel's refs: the plan's lists, both sides' token info, ``g.terms``'
  inputs, q, k, v, dO, lse, delta, (fused) dQ, dK, dV, then the scratch."""
  idx_ref, cnt_ref, full_ref, qinfo_ref, kinfo_ref, *refs = refs
  extra, refs = g.terms.refs(refs)
  fp8_in, refs = (refs[:3], refs[3:]) if g.fp8 else ((None,) * 3, refs)
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs = refs
  dq_ref = refs.pop(0) if g.fused_dq else None
  dk_ref, dv_ref, owned, walked, *out, bars = refs
  *owned, stage = owned
  walked, fp8_smem = (walked[:6], walked[6:]) if g.fp8 else (walked, (None, None))
  *bars, q_free = bars
  return DkvRefs((idx_ref, cnt_ref, full_ref), qinfo_ref, kinfo_ref, extra, q_ref, k_ref, v_ref,
                 do_ref, lse_ref, delta_ref, dq_ref, dk_ref, dv_ref, *owned,
                 TermStage(*stage) if g.terms.staged else None, *walked, out[0], out[-1], *bars,
                 *fp8_in, *fp8_smem, q_free)


class OwnedKeys(NamedTuple):
  """A consumer's owned keys (``DkvCta.own_keys``) as its walked tiles' score terms see them."""

  k0: Any  # the first key
  k_info: Any  # token info rows (positions, segment ids, column keys) broadcast to the tile
  k_index: Any  # the keys' index, broadcast to the tile
  separable: Any  # separable position term: (the keys' positions, its anchor); else None


class DkvCta(NamedTuple):
  """A dK/dV CTA's context: the call's static sizes, the refs and its place in the grid."""

  cfg: common.KernelConfig
  g: BwdGeometry
  r: DkvRefs
  batch: Any
  wg: Any
  kj: Any  # the owned kv block's index along the sequence
  kv_head: Any
  share: Any  # which of the ``g.splits`` shares of the group's query heads it walks
  q_info_b: Any  # the batch index of the token info (0 where shared)
  k_info_b: Any
  k_own: Any  # this consumer's owned tiles (wide kernels: one K/V pair, shared by both)
  v_own: Any
  kinfo_own: Any

  @property
  def tile(self):
    """A walked tile: ``[keys, queries]``."""
    return (self.g.rows, self.g.walk)

  def at_step(self, start):
    """This context in the step of the walked tile from query ``start``: its warpgroup index and
    owned tiles re-derived there (``pipeline.step_index``; not for the wide kernel's consumers,
    whose owned tiles are shared)."""
    wg = step_index(self.wg, start, self.g.step_refs)
    return self._replace(wg=wg, k_own=self.r.k_own.at[wg], v_own=self.r.v_own.at[wg])

  def q_head(self, h):
    """The query head of walked rank ``h``."""
    return self.kv_head * self.g.group + self.share * self.g.walked_heads + h

  def out_at(self, ref, own):
    """The owned rows ``own`` of an output: a split kernel writes float32 partials
    ``[splits, B, S, K, H]``, its share's slice."""
    return ref.at[own] if self.g.splits == 1 else ref.at[(self.share, *own)]

  def plan_row(self, h):
    """``(q index row, count, n_full)`` of the owned kv block for walked query head ``h``."""
    at = lambda ref: head_view(ref, self.batch, self.q_head(h))
    blk = self.g.plan_block(self.kj)
    idx_ref, cnt_ref, full_ref = self.r.plan
    return at(idx_ref).at[blk], at(cnt_ref)[blk], at(full_ref)[blk]

  def walk(self, body, *acc):
    """The consumers' walk from accumulators ``acc``; returns them."""
    return bwd_common.walk(self.g, self.plan_row, body, (jnp.int32(0), *acc))[1:]

  def own_keys(self, k=True, v=True):
    """Loads this consumer's owned tiles: K with the keys' token info (``k``) and V (``v``).
    Returns the keys' output block and, with ``k``, their ``OwnedKeys``."""
    g, r, wg, rows, tile = self.g, self.r, self.wg, self.g.rows, self.tile
    k0 = self.kj * rows if g.wide else self.kj * BWD_BLOCK + wg * rows
    own, bar = (self.batch, pl.ds(k0, rows), self.kv_head), r.own_bar.at[wg]
    copies = ([(r.k.at[own], self.k_own),
               (r.k_info.at[self.k_info_b, :, pl.ds(k0, rows)], self.kinfo_own)]
              if k else []) + ([(r.v.at[own], self.v_own)] if v else [])
    for src, dst in copies:
      plgpu.copy_gmem_to_smem(src, dst, bar)
    for _ in range(3 - len(copies)):  # (wide consumers: the phase's other arrivals, no data)
      plgpu.barrier_arrive(bar)
    plgpu.barrier_wait(bar)
    if not k:
      return own, None
    k_info = broadcast_info(self.kinfo_own, ROWS, tile, 0, g.key_rows)
    k_index = k0 + plgpu.broadcasted_iota(jnp.int32, tile, 0, layout=plgpu.Layout.WGMMA)
    if not g.terms.separable:
      return own, OwnedKeys(k0, k_info, k_index, None)
    # A separable position term's anchor (``terms``): the first owned key's position.
    anchor = r.k_info[self.k_info_b, 0, k0]
    return own, OwnedKeys(k0, k_info, k_index, (load_ref(self.kinfo_own.at[0], ROWS), anchor))

  def tile_terms(self, h, start, slot, masked, keys: OwnedKeys, descale=None) -> TileTerms:
    """The ``TileTerms`` of the walked tile in ``slot`` (query head rank ``h``, queries from
    ``start``; ``descale``: the FP8 factor of its raw ``q.k``)."""
    g, r, tile = self.g, self.r, self.tile
    window = term_window(g.terms, r.terms.tile_term, masked, self.batch, self.q_head(h), keys.k0,
                         start, tile, r.stage, self.wg)
    if not g.terms.tile_info(masked):
      return TileTerms(tile=window)
    q_info = broadcast_info(r.qinfo_smem.at[slot], COLS, tile, 1, g.info_rows)
    row_keys = (broadcast(load_ref(r.rkey_smem.at[slot], COLS), tile, 1) if g.terms.dropout
                else None)
    slope, separable = position_slope(r.terms.slopes, self.batch, self.q_head(h)), None
    k_slope = logit_slope(slope, self.cfg, descale)
    if keys.separable is not None:
      k_pos, anchor = keys.separable
      separable = (broadcast(position_term(k_slope, k_pos, anchor), tile, 0),
                   position_term(slope, load_ref(r.qinfo_smem.at[slot].at[0], COLS), anchor))
    return bwd_common.tile_terms(self.cfg, g, masked, q_info, keys.k_info, keys.k_index,
                                 row_keys, k_slope, separable, window)


def dkv_kernel(*refs, cfg, g: BwdGeometry):
  """The dK/dV kernel of one CTA (``refs``: see ``_refs``): two consumers (``dkv_mainloop``)
  and the producer."""
  r = _refs(refs, g)
  batch, wg = lax.axis_index("batch"), lax.axis_index("wg")
  kj = lax.axis_index("kv_seq")  # causal-type masks give the first kv blocks the longest lists
  # The grid's heads axis: kv head x its share of the group's query heads (g.splits of them).
  heads = lax.axis_index("heads")
  splits = jnp.asarray(g.splits, heads.dtype)
  kv_head, share = lax.div(heads, splits), lax.rem(heads, splits)
  q_info_b, k_info_b = common.sel(r.q_info.shape[0], batch), common.sel(r.k_info.shape[0], batch)
  # (Refs are indexed by traced values only: JAX 0.11.2 fails on static ones inside loops.)
  own = (r.k_own, r.v_own, r.kinfo_own) if g.wide else (
      r.k_own.at[wg], r.v_own.at[wg], r.kinfo_own.at[wg])
  c = DkvCta(cfg, g, r, batch, wg, kj, kv_head, share, q_info_b, k_info_b, *own)
  if not g.wide:
    pl.when(wg < COMPUTE_WGS)(lambda: dkv_mainloop.consumer(c))
  if g.wide:
    pl.when(wg == 0)(lambda: dkv_mainloop.p_and_dv(c))
    pl.when(wg == 1)(lambda: dkv_mainloop.ds_and_dk(c))
  pl.when(wg == COMPUTE_WGS)(lambda: _producer(c))


def _producer(c: DkvCta):
  """The producer warpgroup: streams the walked q, lse, (token info, row keys,) dO and delta
  tiles, and the staged tile term's windows, into the slot ring."""
  g, r, batch = c.g, c.r, c.batch
  plgpu.set_max_registers(g.regs[1], action="decrease")

  def wait_free(free, slot, slots, n):
    @pl.when(n >= slots)
    def _():
      plgpu.barrier_wait(free.at[slot])

  def body(h, start, masked, n):
    slot, q_slot = slot_of(n, g.slots), slot_of(n, g.q_slots)
    qh, seq = c.q_head(h), pl.ds(start, g.walk)
    # The q-side tiles first: into their own ring when they have one, else into the shared one.
    wait_free(r.q_free if g.extra_q_slot else r.free, q_slot, g.q_slots, n)
    q_bar = r.q_bar.at[q_slot]
    plgpu.copy_gmem_to_smem(r.q.at[batch, seq, qh], r.q_smem.at[q_slot], q_bar)
    plgpu.copy_gmem_to_smem(r.lse.at[batch, qh, seq], r.lse_smem.at[q_slot], q_bar)
    if g.terms.tile_info(masked):
      plgpu.copy_gmem_to_smem(r.q_info.at[c.q_info_b, :, seq], r.qinfo_smem.at[q_slot], q_bar)
    else:
      plgpu.barrier_arrive(q_bar)  # the phase's third arrival, without data
    if g.terms.dropout:
      plgpu.copy_gmem_to_smem(head_view(r.terms.row_keys, batch, qh).at[seq],
                              r.rkey_smem.at[q_slot], q_bar)
    if g.extra_q_slot:
      wait_free(r.free, slot, g.slots, n)
    plgpu.copy_gmem_to_smem(r.do.at[batch, seq, qh], r.do_smem.at[slot], r.do_bar.at[slot])
    if g.fp8:
      plgpu.copy_gmem_to_smem(r.q16.at[batch, seq, qh], r.q16_smem.at[q_slot], q_bar)
      plgpu.copy_gmem_to_smem(r.do_t.at[batch, qh, :, seq], r.do_t_smem.at[slot],
                              r.do_bar.at[slot])
    plgpu.copy_gmem_to_smem(r.delta.at[batch, qh, seq], r.delta_smem.at[slot],
                            r.do_bar.at[slot])
    copy_tile_term(g.terms, r.terms.tile_term, r.stage, g.owners, masked, batch, qh,
                   c.kj * g.cta_rows, start, c.tile)
    return n + 1

  bwd_common.walk(g, c.plan_row, body, jnp.int32(0))
