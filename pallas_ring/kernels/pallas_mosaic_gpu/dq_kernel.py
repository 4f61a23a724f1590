"""The Mosaic GPU dQ kernel: a CTA owns 128 query rows of one head (two consumers of 64; one of
64 when wide) and walks its plan row (``kv_index``): K and V in ``Variants.dq_walk_rows`` tiles.
It runs before the dK/dV kernel: given delta as a ``common.RowTerm``, it computes
``delta = sum(o * dO) - dlse`` of its rows (o read from global memory into registers once) and
writes it for dK/dV, so no separate pass reads o and dO. Its consumers keep no schedule between
them (the forward's made it slower)."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional

from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_ring.kernels import common
from pallas_ring.kernels.pallas_mosaic_gpu import fp8
from pallas_ring.kernels.pallas_mosaic_gpu.bwd_common import (
    BwdGeometry, TileTerms, accumulate, finish, grad_logits, probs, products, tile_terms, walk,
    zeros)
from pallas_ring.kernels.pallas_mosaic_gpu.pipeline import (
    COLS, ROWS, broadcast_info, head_view, load_ref, slot_of, step_index)
from pallas_ring.kernels.pallas_mosaic_gpu.terms import (
    TermRefs, TermStage, broadcast, copy_tile_term, kept_delta, logit_slope, open_stage,
    position_slope, position_term, term_window)


class DqRefs(NamedTuple):
  """The dQ kernel's refs: global memory, then shared-memory scratch and barriers."""

  plan: tuple  # (kv_index, kv_count, kv_full): the plan's lists
  q_info: Any  # int32 [Bi, info_rows, Tp]
  k_info: Any  # int32 [Bi, key_rows, Sp] (``terms.key_info``)
  terms: TermRefs
  q: Any  # [B, Tp, N, H]
  k: Any  # [B, Sp, K, H]
  v: Any  # [B, Sp, K, Hv]
  do: Any  # [B, Tp, N, Hv]
  lse: Any  # [B, N, Tp] float32, base 2
  o: Optional[Any]  # ``g.delta_from_o``: [B, Tp, N, Hv]
  row_in: Optional[Any]  # [B, N, Tp] float32: delta, or (``g.delta_from_o``) dlse; or None
  dq_acc: Optional[Any]  # ``g.add_dq``: the ring's running dq [B, Tp, N, H]
  dq: Any  # [B, Tp, N, H]
  delta_out: Optional[Any]  # ``g.delta_from_o``: [B, N, Tp] float32
  q_own: Any  # [owners, 64, H]
  do_own: Any  # [owners, 64, Hv]
  lse_own: Any  # [owners, 64] float32
  delta_own: Any  # [owners, 64] float32: delta, dlse, or nothing (then computed from o alone)
  qinfo_own: Any  # [owners, info_rows, 64] int32
  rkey_own: Any  # [owners, 64] int32: dropout's row keys (8 columns without dropout)
  stage: Optional[TermStage]  # a staged tile term's windows
  k_smem: Any  # [slots, walk, H]
  v_smem: Any  # [slots, walk, Hv]
  kinfo_smem: Any  # [slots, key_rows, walk] int32
  out: Any  # [owners, 64, H]: dq staging (aliases the walked slots)
  own_bar: Any  # per owner: its owned tiles landed
  k_bar: Any  # per slot: K (and its token info) landed
  v_bar: Any  # per slot: V landed
  free: Any  # per slot: the consumers are done with it
  done: Any  # both consumers are done with the slots (None with one consumer)
  descales: Any = None  # FP8 mode: float32 [B, N, 4] (``fp8.backward_operands``)
  k16: Any = None  # FP8 mode: 16-bit K [B, Sp, K, H] for ds K
  k16_smem: Any = None  # FP8 mode: [slots, walk, H], 16-bit


def _refs(refs, g: BwdGeometry) -> DqRefs:
  """``DqRefs`` of the kernel's refs: the plan's lists, both sides' token info, ``g.terms``'
  inputs, q, k, v, dO and lse; the row term's refs: delta in, or (``g.delta_from_o``) o and
  optionally dlse in, delta out; dq_acc in (``g.add_dq``); then the scratch."""
  idx_ref, cnt_ref, full_ref, qinfo_ref, kinfo_ref, *refs = refs
  extra, refs = g.terms.refs(refs)
  fp8_in, refs = (refs[:2], refs[2:]) if g.fp8 else ((None, None), refs)
  q_ref, k_ref, v_ref, do_ref, lse_ref, *refs = refs
  *io, owned, walked, out2, bars = refs
  walked, k16_smem = (walked[:3], walked[3]) if g.fp8 else (walked, None)
  outs = 2 if g.delta_from_o else 1
  ins, (dq_ref, *delta_out) = io[:-outs], io[-outs:]
  acc_ref = ins[-1] if g.add_dq else None
  ins = ins[:-1] if g.add_dq else ins
  if g.delta_from_o:
    o_ref, *dlse_ref = ins
    row_in, delta_out = (dlse_ref[0] if dlse_ref else None), delta_out[0]
  else:
    (row_in,), o_ref, delta_out = ins, None, None
  *owned, stage = owned
  return DqRefs((idx_ref, cnt_ref, full_ref), qinfo_ref, kinfo_ref, extra, q_ref, k_ref, v_ref,
                do_ref, lse_ref, o_ref, row_in, acc_ref, dq_ref, delta_out, *owned,
                TermStage(*stage) if g.terms.staged else None, *walked, out2, *bars, *fp8_in,
                k16_smem)


class DqCta(NamedTuple):
  """A dQ CTA's context: the call's static sizes, the refs and its place in the grid."""

  cfg: common.KernelConfig
  g: BwdGeometry
  r: DqRefs
  batch: Any
  head: Any
  wg: Any
  qi: Any  # the owned q block: longest causal rows first, as in the forward
  q_info_b: Any  # the batch index of the token info (0 where shared)
  k_info_b: Any
  kv_head: Any

  @property
  def tile(self):
    """A walked tile: ``[queries, keys]``."""
    return (self.g.rows, self.g.walk)

  def own_at(self, start):
    """This consumer's owned q and dO tiles in the step of the K/V tile from ``start``
    (``pipeline.step_index``)."""
    wg = step_index(self.wg, start, self.g.step_refs)
    return self.r.q_own.at[wg], self.r.do_own.at[wg]

  def plan_row(self, h):
    """``(kv index row, count, n_full)`` of the owned block (``h``: the only query head)."""
    del h
    at = lambda ref: head_view(ref, self.batch, self.head)
    blk = self.g.plan_block(self.qi)
    idx_ref, cnt_ref, full_ref = self.r.plan
    return at(idx_ref).at[blk], at(cnt_ref)[blk], at(full_ref)[blk]


class DqRows(NamedTuple):
  """A consumer's owned rows (``_open_rows``)."""

  q0: Any  # the first row
  own: tuple  # the rows' index into [B, Tp, N, H]
  q_info: Any  # token info rows broadcast to the walked tile
  lse2: Any  # [64] base 2
  delta: Any  # [64] ``kept_delta``'s
  k_slope: Any  # the position term's slope in ``with_terms``' units, or None
  row_keys: Any  # [64] dropout's row keys, or None
  anchor: Any  # separable position term: its anchor (the first owned row's position)
  q_term: Any  # separable position term: the rows' query term (base 2)
  descale: Any = None  # FP8 mode: the raw q.k's factor (a scalar)
  dp_scale: Any = None  # FP8 mode: the raw dO.v's factor (a scalar)


def dq_kernel(*refs, cfg, g: BwdGeometry):
  """The dQ kernel of one CTA (``refs``: see ``_refs``): ``g.owners`` consumers and the
  producer."""
  r = _refs(refs, g)
  batch, head, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
  qi = g.blocks - 1 - lax.axis_index("q_seq")  # longest causal rows first, as in the forward
  c = DqCta(cfg, g, r, batch, head, wg, qi, common.sel(r.q_info.shape[0], batch),
            common.sel(r.k_info.shape[0], batch), lax.div(head, jnp.asarray(g.group, head.dtype)))
  pl.when(wg < g.owners)(lambda: _consumer(c))
  pl.when(wg == g.owners)(lambda: _producer(c))


def _consumer(c: DqCta):
  """A consumer warpgroup: dQ of its 64 owned rows."""
  g, cfg, r = c.g, c.cfg, c.r
  plgpu.set_max_registers(g.regs[0], action="increase")
  open_stage(g.terms, r.stage, c.wg)
  rows = _open_rows(c)
  _, dq = walk(g, c.plan_row, functools.partial(_step, c, rows),
               (jnp.int32(0), zeros((g.rows, g.head_dim))))
  dq = dq * (cfg.scale * cfg.keep_scale)
  if r.dq_acc is not None:  # (read once the walk is done: no registers are free before)
    dq = dq + load_ref(r.dq_acc.at[rows.own], plgpu.Layout.WGMMA,
                       optimized=False).astype(jnp.float32)
  finish(r.done, (r.out.at[c.wg], r.dq.at[rows.own], dq))


def _open_rows(c: DqCta) -> DqRows:
  """Loads this consumer's owned rows (q, dO, lse, the row term, token info, row keys) and
  computes their delta (from o when ``g.delta_from_o``, also written for dK/dV)."""
  g, cfg, r, batch, head, wg = c.g, c.cfg, c.r, c.batch, c.head, c.wg
  rows = g.rows
  q_own, do_own = r.q_own.at[wg], r.do_own.at[wg]
  q0 = c.qi * g.cta_rows + wg * rows
  own, seq = (batch, pl.ds(q0, rows), head), pl.ds(q0, rows)
  delta_own = r.delta_own.at[wg]  # delta, dlse, or nothing (then computed from o alone)
  for src, dst in ((r.q.at[own], q_own), (r.do.at[own], do_own),
                   (r.lse.at[batch, head, seq], r.lse_own.at[wg]),
                   (r.q_info.at[c.q_info_b, :, seq], r.qinfo_own.at[wg]),
                   *([(r.row_in.at[batch, head, seq], delta_own)] if r.row_in is not None
                     else []),
                   *([(head_view(r.terms.row_keys, batch, head).at[seq], r.rkey_own.at[wg])]
                     if g.terms.dropout else [])):
    plgpu.copy_gmem_to_smem(src, dst, r.own_bar.at[wg])
  if g.delta_from_o:  # (global loads issued while the copies fly; o is read only here)
    o = load_ref(r.o.at[own], plgpu.Layout.WGMMA, optimized=False)
  plgpu.barrier_wait(r.own_bar.at[wg])
  q_info = broadcast_info(r.qinfo_own.at[wg], ROWS, c.tile, 0, g.info_rows)
  lse2 = load_ref(r.lse_own.at[wg], ROWS)
  if g.delta_from_o:  # delta = sum(o * dO) - dlse, also the dK/dV kernel's
    delta = (o.astype(jnp.float32) * load_ref(do_own, plgpu.Layout.WGMMA).astype(jnp.float32)
             ).sum(axis=1)
    if r.row_in is not None:
      delta = delta - load_ref(delta_own, ROWS)
    delta_own[...] = delta
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(delta_own, r.delta_out.at[batch, head, seq])  # (waited in finish)
  else:
    delta = load_ref(delta_own, ROWS)
  delta = kept_delta(delta, cfg)
  descale = dp_scale = None
  if g.fp8:
    descale, dp_scale = fp8.bwd_descales(r.descales, batch, head)
  slope = position_slope(r.terms.slopes, batch, head)
  k_slope = logit_slope(slope, cfg, descale)  # (the keys' side, in ``with_terms``' units)
  row_keys = load_ref(r.rkey_own.at[wg], ROWS) if g.terms.dropout else None
  anchor = q_term = None
  if g.terms.separable:  # (``terms``: the anchor is the first owned row's position)
    anchor = r.q_info[c.q_info_b, 0, q0]
    q_term = position_term(slope, load_ref(r.qinfo_own.at[wg].at[0], ROWS), anchor)
  return DqRows(q0, own, q_info, lse2, delta, k_slope, row_keys, anchor, q_term,
                descale, dp_scale)


def _step(c: DqCta, rows: DqRows, h, start, masked, carry):
  """Main loop: the walked K/V tile of keys from ``start``: ``dq += ds K``."""
  del h
  g, cfg, r, tile = c.g, c.cfg, c.r, c.tile
  n, dq = carry
  slot = slot_of(n, g.slots)
  k, v = r.k_smem.at[slot], r.v_smem.at[slot]
  plgpu.barrier_wait(r.k_bar.at[slot])
  plgpu.barrier_wait(r.v_bar.at[slot])

  q_own, do_own = c.own_at(start)
  s, dp = products(tile, ((q_own, k), (do_own, v)))  # s = q K^T, dp = dO V^T
  window = term_window(g.terms, r.terms.tile_term, masked, c.batch, c.head, rows.q0, start, tile,
                       r.stage, c.wg)
  terms = TileTerms(tile=window)
  if g.terms.tile_info(masked):
    k_info = broadcast_info(r.kinfo_smem.at[slot], COLS, tile, 1, g.key_rows)
    k_index = start + plgpu.broadcasted_iota(jnp.int32, tile, 1, layout=plgpu.Layout.WGMMA)
    separable = None
    if g.terms.separable:
      k_term = position_term(rows.k_slope, load_ref(r.kinfo_smem.at[slot].at[0], COLS),
                             rows.anchor)
      separable = (broadcast(k_term, tile, 1), rows.q_term)
    terms = tile_terms(cfg, g, masked, rows.q_info, k_info, k_index,
                       None if rows.row_keys is None else broadcast(rows.row_keys, tile, 0),
                       rows.k_slope, separable, window)
  p, dlogits = probs(s, rows.lse2, terms, cfg, row_axis=0, descale=rows.descale)
  if g.fp8:
    dp = dp * rows.dp_scale
  ds = grad_logits(p, dp, rows.delta, dlogits, row_axis=0, keep_mask=terms.keep_mask())
  k16 = r.k16_smem.at[slot] if g.fp8 else k
  (dq,) = accumulate(((dq, ds.astype(g.dtype), k16),))  # dq += ds K
  plgpu.barrier_arrive(r.free.at[slot])
  return n + 1, dq


def _producer(c: DqCta):
  """The producer warpgroup: streams the walked K/V tiles (with the keys' token info and the
  staged tile term's windows) into the slot ring."""
  g, r = c.g, c.r
  plgpu.set_max_registers(g.regs[1], action="decrease")

  def body(h, start, masked, n):
    slot = slot_of(n, g.slots)
    keys = pl.ds(start, g.walk)
    src = (c.batch, keys, c.kv_head)

    @pl.when(n >= g.slots)
    def _():
      plgpu.barrier_wait(r.free.at[slot])

    plgpu.copy_gmem_to_smem(r.k.at[src], r.k_smem.at[slot], r.k_bar.at[slot])
    if g.terms.tile_info(masked):
      plgpu.copy_gmem_to_smem(r.k_info.at[c.k_info_b, :, keys], r.kinfo_smem.at[slot],
                              r.k_bar.at[slot])
    else:
      plgpu.barrier_arrive(r.k_bar.at[slot])  # the phase's second arrival, without data
    plgpu.copy_gmem_to_smem(r.v.at[src], r.v_smem.at[slot], r.v_bar.at[slot])
    if g.fp8:
      plgpu.copy_gmem_to_smem(r.k16.at[src], r.k16_smem.at[slot], r.v_bar.at[slot])
    copy_tile_term(g.terms, r.terms.tile_term, r.stage, g.owners, masked, c.batch, c.head,
                   c.qi * g.cta_rows, start, (g.rows, g.walk))
    return n + 1

  walk(g, c.plan_row, body, jnp.int32(0))
