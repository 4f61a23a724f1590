"""The Mosaic GPU backward: the dK/dV and dQ kernels (deterministic; see below)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_ring.kernels import common, pallas_triton
from pallas_ring.kernels.pallas_mosaic_gpu.pipeline import (
    COLS, ROWS, broadcast_info, head_view, load_ref, meet, pingpong, slot_of, swizzled_smem,
    token_info)
from pallas_ring.kernels.pallas_mosaic_gpu.terms import (
    BiasStage, Terms, bias_window, broadcast, copy_bias, keep, kept, kept_delta, key_info,
    logit_slope, logits, open_stage, position_term, slope2, stage_scratch, terms_of,
    tile_bias_dtype, with_terms)
from pallas_ring.kernels.pallas_mosaic_gpu.tiles import (
    BWD_BLOCK, BWD_ROWS, COMPUTE_WGS, CONSUMER_REGS, PRODUCER_REGS, SMEM_BYTES, Variants,
    backward_unsupported, dkv_head_splits, ops_call, staged_bias_bytes, unsupported)


# Two kernels, each warp-specialized like the forward (a producer warpgroup streams tiles by TMA
# into `slots` shared-memory slots, consumer warpgroups own 64 rows each), and neither
# accumulates across CTAs, so results are bitwise reproducible:
#   dK/dV: a CTA owns 128 keys of one kv head (two consumers of 64) and walks, for each query head
#     of the group, the transposed plan row of its kv block (q_index): q, dO, lse and delta in
#     ``Variants.dkv_walk_rows`` tiles. dK and dV accumulate per kv head in registers (GQA needs no
#     per-query-head temporary). With few kv heads the group is split over several CTAs per block
#     (``tiles.dkv_head_splits``), each writing float32 partials summed after the kernel. The
#     consumers alternate their matmuls like the forward's (H100,
#     T=16k: dK/dV 5% faster dense, 8% causal; the same schedule made the dQ kernel slower,
#     4.4 -> 5.4 ms dense with 64-key tiles, forward+backward 0.89x -> 0.86x cuDNN with 128,
#     so it has none).
#   dQ: a CTA owns 128 query rows of one head (two consumers of 64) and walks its plan row
#     (kv_index): K and V in ``Variants.dq_walk_rows`` tiles. It runs first: given delta as a
#     RowTerm, it computes delta = sum(o * dO) - dlse of its rows (o read from global memory
#     into registers once) and writes it for dK/dV, so no separate pass reads o and dO.
# Above head dim 128 ("wide"), a warpgroup's float32 dK and dV of 64 keys alone would fill its
# registers (2 x 128 per thread at H=256), so both kernels own 64 rows per CTA:
#   dK/dV: the two consumers share the CTA's 64 keys and split the work: warpgroup 0 computes
#     p^T = exp(K q^T - lse) and dV += p^T dO, warpgroup 1 dp^T = V dO^T and dK += ds^T q, with
#     ds^T = p^T (dp^T - delta); p^T passes through two shared-memory buffers. Each warpgroup
#     runs two of the four matmuls, and the wait for p^T offsets warpgroup 1 by half a step, so
#     one's elementwise work overlaps the other's matmuls.
#   dQ: one consumer owns the CTA's 64 rows (two sets of q, dO and K/V slots do not fit in
#     shared memory).
# Variants(deterministic=False), head dims <= 128: one fused kernel. The dK/dV consumers also
# write each tile's ds^T to shared memory and add ds K of their 64 keys to a float32 dQ in
# global memory by a TMA reduce-add through a staging tile, in whatever order the CTAs reach
# it: dQ is not bitwise reproducible, and q.k^T and dO.v^T are computed once instead of twice
# (5 matmuls per tile instead of 7). Where registers allow (``Variants.dq_with_dkv_up_to``) the
# ds^T K matmul is issued with dV's and dK's, else after them. Measured in BENCHMARKS.md.
# In every kernel the output staging tiles share memory with the walked slots (plgpu.RefUnion):
# the consumers meet once both are done with the slots, then write. This leaves room for longer
# walked tiles (dQ at H=128: 128 keys, wgmmas of N = 128) or more slots.

def _owners(wide: bool) -> int:
  """Owned tiles (of 64 rows) per backward CTA: one when wide, else one per consumer."""
  return 1 if wide else COMPUTE_WGS


@dataclasses.dataclass(frozen=True)
class _BwdGeometry:
  """Static sizes of one backward kernel call."""

  slots: int  # walked-tile shared-memory slots
  group: int  # query heads per kv head
  head_dim: int
  dtype: object  # the inputs' 16-bit dtype
  info_rows: int  # token-info rows: 1 (positions) or 2 (and segment ids)
  blocks: int  # CTAs along the owned sequence
  walked_heads: int  # query heads walked per CTA: `group` for dK/dV, 1 for dQ
  walk: int  # rows of a walked tile
  wide: bool  # 64 owned rows per CTA (see above): head dims above ``Variants.wide_*_above``
  splits: int = 1  # dK/dV: CTAs sharing a kv block's query heads (each walks walked_heads)
  delta_from_o: bool = False  # dQ: computes delta from o (a ``common.RowTerm``) and returns it
  add_dq: bool = False  # dQ: adds ``dq_acc`` (the ring's running dq) to its rows
  fused_dq: bool = False  # dK/dV: also adds ds K to a float32 dQ (``Variants.deterministic``)
  dq_with_dkv: bool = False  # fused: ds^T K issued with the dV/dK matmuls (else after them)
  terms: Terms = Terms()  # score terms: ALiBi, bias, dense mask, dropout (``terms``)

  rows = BWD_ROWS  # owned rows per warpgroup

  @property
  def key_rows(self) -> int:
    """Rows of the keys' token info: ``info_rows``, then the dropout column keys."""
    return self.info_rows + self.terms.dropout

  @property
  def nsub(self) -> int:
    """Walked tiles per plan block."""
    return BWD_BLOCK // self.walk

  @property
  def owners(self) -> int:
    """Owned tiles per CTA (``_owners``)."""
    return _owners(self.wide)

  @property
  def cta_rows(self) -> int:
    """Owned rows per CTA."""
    return self.owners * BWD_ROWS

  def plan_block(self, cta):
    """The plan block (row of the plan's lists) of the CTA at ``cta`` along the sequence."""
    return lax.div(cta, jnp.asarray(BWD_BLOCK // self.cta_rows, cta.dtype))


def _walk(g: _BwdGeometry, plan_row, body, carry):
  """Calls ``carry = body(head, start, masked, carry)`` for every tile the CTA walks.

  Args:
    plan_row: ``head -> (index_row_ref, count, n_full)`` for query head ``head`` (a rank in
      ``[0, g.walked_heads)``); the entries ``[0, n_full)`` are walked mask-free, the rest masked.
    body: one walked tile at row ``start``; producer and consumers walk identically, so a carried
      tile counter gives both the same ring slot.
  """

  def head(h, carry):
    idx_row, count, n_full = plan_row(h)

    def tile(t, carry, masked):
      t, nsub = jnp.asarray(t, jnp.int32), jnp.int32(g.nsub)
      start = idx_row[lax.div(t, nsub)] * BWD_BLOCK + lax.rem(t, nsub) * g.walk
      return body(h, start, masked, carry)

    carry = lax.fori_loop(0, n_full * g.nsub, functools.partial(tile, masked=False), carry)
    return lax.fori_loop(n_full * g.nsub, count * g.nsub, functools.partial(tile, masked=True),
                         carry)

  if g.walked_heads == 1:
    return head(0, carry)
  # (int32 bounds: the head index stays int32 under x64)
  return lax.fori_loop(jnp.int32(0), jnp.int32(g.walked_heads), head, carry)


def _zeros(shape):
  return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)


def _products(tile, pairs, issued=lambda: None):
  """``[a b^T for a, b in pairs]``, float32 ``tile``-shaped, from shared-memory operands (one
  wgmma wait); ``issued()`` runs once all are issued."""

  def run(refs):
    for ref, (a, b) in zip(refs, pairs):
      plgpu.wgmma(ref, a, b.transpose((1, 0)))
    issued()

  return pl.run_state(run)(tuple(plgpu.ACC.init(_zeros(tile)) for _ in pairs))


def _accumulate(terms):
  """``[acc + a b for acc, a, b in terms]``: ``a`` in registers (16-bit, wgmma layout), ``b`` in
  shared memory (one wgmma wait)."""

  def run(refs):
    for ref, (_, a, b) in zip(refs, terms):
      plgpu.wgmma(ref, a, b)

  return pl.run_state(run)(tuple(plgpu.ACC.init(acc) for acc, _, _ in terms))


class _TileTerms(NamedTuple):
  """What a walked tile applies beyond ``q.k``: visibility (masked tiles), ALiBi (``with_alibi``'s
  argument, and for a split ALiBi the query term added to the rows' base-2 lse) and a function
  computing dropout's keep mask (called where it is used, so the mask is not live across the
  softmax: registers); each None where absent."""

  vis: Any = None
  alibi: Any = None
  lse_shift: Any = None
  keep: Any = None
  bias: Any = None  # the tile's ``bias_window``

  def keep_mask(self):
    """Dropout's keep mask of the tile (computed now), or None without dropout."""
    return None if self.keep is None else self.keep()


def _tile_terms(cfg, g: _BwdGeometry, masked, q_info, k_info, k_index, row_keys, slope=None,
                split=None, bias=None):
  """The ``_TileTerms`` of a tile from its sides' token info (broadcast to the tile, queries'
  rows then keys': positions, segment ids, and the keys' dropout column keys), the broadcast
  dropout ``row_keys``, ALiBi: ``slope`` in ``with_terms``' units (unsplit) or ``split = (key
  term in those units broadcast to the tile, base-2 query term)`` (``terms.position_term``), and
  its ``bias_window``."""
  vis = (common.tile_visible(cfg, q_info[0], k_info[0], k_index, *q_info[1:],
                             *k_info[1:g.info_rows]) if g.terms.vis_on(masked) else None)
  alibi, lse_shift = split if split is not None else (
      None if slope is None else (slope, q_info[0], k_info[0]), None)
  return _TileTerms(vis, alibi, lse_shift,
                    (lambda: keep(cfg, row_keys, k_info[-1])) if g.terms.dropout else None, bias)


def _probs(s_raw, lse2, terms: _TileTerms, cfg, row_axis: int):
  """``(p, dlogits)`` of a tile from raw ``q.k`` products: ``lse2`` (base 2) is a vector along
  axis ``row_axis`` of the tile's query rows (0 for dQ's ``[q, k]`` tiles, 1 for dK/dV's
  transposed ``[k, q]`` ones); ``dlogits`` is the soft-cap's derivative (None without)."""
  s, c = logits(s_raw, cfg)
  dlogits = None if cfg.softcap is None else common.softcap_grad(s * common.LN2, cfg)
  s = with_terms(s, c, terms.alibi, terms.bias)
  if terms.lse_shift is not None:
    lse2 = lse2 + terms.lse_shift
  p = jnp.exp2(s * c - lax.broadcast_in_dim(lse2, s.shape, [row_axis]))
  if terms.vis is not None:
    p = jnp.where(terms.vis, p, 0.0)
  return p, dlogits


def _grad_logits(p, dp, delta, dlogits, row_axis: int, keep_mask=None):
  """``ds``, the raw-logit gradient / (scale x keep scale), from ``p`` and ``dp = dO.v``
  (``_probs``); ``delta`` is ``kept_delta``'s."""
  ds = p * (kept(dp, keep_mask) - lax.broadcast_in_dim(delta, p.shape, [row_axis]))
  return ds if dlogits is None else ds * dlogits


def _signed_grad_logits(ps, dp, delta):
  """``_grad_logits`` of the wide dK/dV kernel's second warpgroup under dropout, from ``ps``: the
  first's probabilities (soft-cap folded) with dropped ones negated, so the keep mask needs no
  second computation: kept ``ps * (dp - delta)``, dropped ``-ps * -delta`` (``delta`` along the
  tile's columns, ``kept_delta``'s)."""
  delta = lax.broadcast_in_dim(delta, ps.shape, [1])
  return jnp.where(ps >= 0.0, ps * (dp - delta), ps * delta)


def _finish(done, stage, *results):
  """Writes a consumer's ``(dst, value)`` results, ``[rows, H]`` float32 tiles, to global memory
  through its staging tile ``stage``, once the consumers have met at ``done`` (None: the only
  consumer): the staging tiles alias the walked slots."""
  if done is not None:
    meet(done)
  for dst, value in results:
    stage[...] = value.astype(stage.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(stage, dst)
    plgpu.wait_smem_to_gmem(0)


def _dkv_kernel(idx_ref, cnt_ref, full_ref, qinfo_ref, kinfo_ref, *refs, cfg, g: _BwdGeometry):
  extra, refs = g.terms.refs(refs)  # (``TermRefs``; the dK/dV kernel's tile bias: transposed)
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs = refs
  dq_ref = refs.pop(0) if g.fused_dq else None  # (fused: the float32 dQ, a mutable input)
  dk_ref, dv_ref, owned, walked, out2, bars = refs
  # p_smem: the wide kernel's p^T buffers; dq_smem: the fused kernel's ds^T tiles and dQ staging;
  # stage: a staged bias's windows (``BiasStage``; read by warpgroup 0 alone when wide)
  k_own2, v_own2, kinfo_own2, p_smem, dq_smem, stage = owned
  stage = BiasStage(*stage) if g.terms.staged else None
  q_smem, do_smem, lse_smem, delta_smem, qinfo_smem, rkey_smem = walked
  own_bar, q_bar, do_bar, free, sched, p_full, p_free = bars
  batch, wg = lax.axis_index("batch"), lax.axis_index("wg")
  kj = lax.axis_index("kv_seq")  # causal-type masks give the first kv blocks the longest lists
  # The grid's heads axis: kv head x its share of the group's query heads (g.splits of them).
  heads = lax.axis_index("heads")
  splits = jnp.asarray(g.splits, heads.dtype)
  kv_head, share = lax.div(heads, splits), lax.rem(heads, splits)
  rows = g.rows
  q_info_b, k_info_b = common.sel(qinfo_ref.shape[0], batch), common.sel(kinfo_ref.shape[0], batch)
  q_head = lambda h: kv_head * g.group + share * g.walked_heads + h
  # A split kernel writes float32 partials [splits, B, S, K, H], its share's slice.
  out_at = (lambda ref, own: ref.at[own]) if g.splits == 1 else (
      lambda ref, own: ref.at[(share, *own)])
  tile = (rows, g.walk)  # [keys, queries]

  def plan_row(h):
    at = lambda ref: head_view(ref, batch, q_head(h))
    blk = g.plan_block(kj)
    return at(idx_ref).at[blk], at(cnt_ref)[blk], at(full_ref)[blk]

  # The owned tiles of this consumer (wide kernels: one K/V pair, shared by both consumers).
  # (Refs are indexed by traced values only: JAX 0.11.2 fails on static ones inside loops.)
  k_own, v_own, kinfo_own = (k_own2, v_own2, kinfo_own2) if g.wide else (
      k_own2.at[wg], v_own2.at[wg], kinfo_own2.at[wg])

  def own_keys(k=True, v=True):
    """Loads this consumer's owned tiles: K with the keys' token info (``k``) and V (``v``).
    Returns the keys' output block and, with ``k``, their token info and index in a tile."""
    k0 = kj * rows if g.wide else kj * BWD_BLOCK + wg * rows
    own, bar = (batch, pl.ds(k0, rows), kv_head), own_bar.at[wg]
    copies = ([(k_ref.at[own], k_own), (kinfo_ref.at[k_info_b, :, pl.ds(k0, rows)], kinfo_own)]
              if k else []) + ([(v_ref.at[own], v_own)] if v else [])
    for src, dst in copies:
      plgpu.copy_gmem_to_smem(src, dst, bar)
    for _ in range(3 - len(copies)):  # (wide consumers: the phase's other arrivals, no data)
      plgpu.barrier_arrive(bar)
    plgpu.barrier_wait(bar)
    if not k:
      return own, None
    k_info = broadcast_info(kinfo_own, ROWS, tile, 0, g.key_rows)
    k_index = k0 + plgpu.broadcasted_iota(jnp.int32, tile, 0, layout=plgpu.Layout.WGMMA)
    if not g.terms.alibi_split:
      return own, (k0, k_info, k_index, None)
    # A split ALiBi's anchor (``terms``): the first owned key's position.
    anchor = kinfo_ref[k_info_b, 0, k0]
    return own, (k0, k_info, k_index, (load_ref(kinfo_own.at[0], ROWS), anchor))

  def tile_terms(h, start, slot, masked, keys):
    """The ``_TileTerms`` of the walked tile in ``slot`` (query head rank ``h``, queries from
    ``start``)."""
    k0, k_info, k_index, split_keys = keys
    bias = bias_window(g.terms, extra.tile_bias, masked, batch, q_head(h), k0, start, tile,
                       stage, wg)
    if not g.terms.tile_info(masked):
      return _TileTerms(bias=bias)
    q_info = broadcast_info(qinfo_smem.at[slot], COLS, tile, 1, g.info_rows)
    row_keys = (broadcast(load_ref(rkey_smem.at[slot], COLS), tile, 1) if g.terms.dropout
                else None)
    slope, split = slope2(extra.slopes, batch, q_head(h)), None
    k_slope = logit_slope(slope, cfg)
    if split_keys is not None:
      k_pos, anchor = split_keys
      split = (broadcast(position_term(k_slope, k_pos, anchor), tile, 0),
               position_term(slope, load_ref(qinfo_smem.at[slot].at[0], COLS), anchor))
    return _tile_terms(cfg, g, masked, q_info, k_info, k_index, row_keys, k_slope, split, bias)

  def walk(body, *acc):
    """The consumers' walk from accumulators ``acc``; returns them."""
    return _walk(g, plan_row, body, (jnp.int32(0), *acc))[1:]

  if not g.wide:
    @pl.when(wg < COMPUTE_WGS)
    def _consumer():  # each consumer: its own 64 keys' p, ds, dK and dV
      plgpu.set_max_registers(CONSUMER_REGS, action="increase")
      open_stage(g.terms, stage, wg)
      own, keys = own_keys()

      def stage_ds(ds):
        """Fused: this consumer's ``ds^T`` tile to shared memory (the A operand of ds^T K)."""
        ds_t = dq_smem[0].at[wg]
        ds_t[...] = ds
        plgpu.commit_smem()
        return (_zeros((g.walk, g.head_dim)), ds_t.transpose((1, 0)), k_own)

      def add_dq(dq, h, start):
        """Fused: ``dq[start:start + walk] += dq`` (``ds^T K`` over this consumer's keys) by a
        TMA reduce-add from its staging tile, once the previous one has read it."""
        stage = dq_smem[1].at[wg]
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        stage[...] = dq * (cfg.scale * cfg.keep_scale)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(stage, dq_ref.at[batch, pl.ds(start, g.walk), q_head(h)],
                                reduction_op="add")

      def body(h, start, masked, carry):
        n, dk, dv = carry
        slot = slot_of(n, g.slots)
        q, do = q_smem.at[slot], do_smem.at[slot]
        plgpu.barrier_wait(q_bar.at[slot])
        plgpu.barrier_wait(do_bar.at[slot])
        # s^T = K q^T, dp^T = V dO^T
        s, dp = _products(tile, ((k_own, q), (v_own, do)),
                          functools.partial(meet, sched))
        terms = tile_terms(h, start, slot, masked, keys)
        p, dlogits = _probs(s, load_ref(lse_smem.at[slot], COLS), terms, cfg, row_axis=1)
        keep_mask = terms.keep_mask()
        ds = _grad_logits(p, dp, kept_delta(load_ref(delta_smem.at[slot], COLS), cfg), dlogits,
                          row_axis=1, keep_mask=keep_mask)
        p, ds = lax.optimization_barrier((kept(p, keep_mask).astype(g.dtype),
                                          ds.astype(g.dtype)))
        meet(sched)  # the other warpgroup's matmuls are issued
        # dV += p^T dO, dK += ds^T q (and the fused dQ's ds^T K where it fits beside them)
        with_dkv = (stage_ds(ds),) if g.dq_with_dkv else ()
        dv, dk, *dq = _accumulate(((dv, p, do), (dk, ds, q), *with_dkv))
        plgpu.barrier_arrive(free.at[slot])
        if g.fused_dq:
          (dq,) = dq or _accumulate((stage_ds(ds),))
          add_dq(dq, h, start)
        return n + 1, dk, dv

      acc = _zeros((rows, g.head_dim))
      meet_other = functools.partial(meet, sched)
      dk, dv = pingpong(lambda: walk(body, acc, acc), meet_other, meet_other)
      _finish(sched, out2.at[wg], (out_at(dk_ref, own), dk * (cfg.scale * cfg.keep_scale)),
              (out_at(dv_ref, own), dv * cfg.keep_scale))

  if g.wide:
    @pl.when(wg == 0)
    def _p_and_dv():  # p^T = exp(K q^T - lse) to warpgroup 1, dV += p^T dO
      plgpu.set_max_registers(CONSUMER_REGS, action="increase")
      open_stage(g.terms, stage, wg)
      own, keys = own_keys(v=False)

      def body(h, start, masked, carry):
        n, dv = carry
        slot, buf = slot_of(n, g.slots), slot_of(n, 2)
        plgpu.barrier_wait(q_bar.at[slot])
        (s,) = _products(tile, ((k_own, q_smem.at[slot]),))
        terms = tile_terms(h, start, slot, masked, keys)
        p, dlogits = _probs(s, load_ref(lse_smem.at[slot], COLS), terms, cfg, row_axis=1)

        @pl.when(n >= 2)
        def _():
          plgpu.barrier_wait(p_free.at[buf])

        # (soft-cap folded; with dropout, dropped terms negated: ``_signed_grad_logits``)
        ps = p if dlogits is None else p * dlogits
        keep_mask = terms.keep_mask()
        p_smem.at[buf][...] = (ps if keep_mask is None else jnp.where(keep_mask, ps, -ps)
                               ).astype(g.dtype)
        plgpu.barrier_arrive(p_full.at[buf])
        plgpu.barrier_wait(do_bar.at[slot])
        (dv,) = _accumulate(((dv, kept(p, keep_mask).astype(g.dtype), do_smem.at[slot]),))
        plgpu.barrier_arrive(free.at[slot])
        return n + 1, dv

      (dv,) = walk(body, _zeros((rows, g.head_dim)))
      _finish(sched, out2.at[wg], (out_at(dv_ref, own), dv * cfg.keep_scale))

    @pl.when(wg == 1)
    def _ds_and_dk():  # dp^T = V dO^T; ds^T from warpgroup 0's p^T; dK += ds^T q
      plgpu.set_max_registers(CONSUMER_REGS, action="increase")
      own, _ = own_keys(k=False)

      def body(h, start, masked, carry):
        n, dk = carry
        slot, buf = slot_of(n, g.slots), slot_of(n, 2)
        plgpu.barrier_wait(do_bar.at[slot])
        (dp,) = _products(tile, ((v_own, do_smem.at[slot]),))
        plgpu.barrier_wait(p_full.at[buf])
        p = load_ref(p_smem.at[buf], plgpu.Layout.WGMMA).astype(jnp.float32)  # (soft-cap folded)
        plgpu.barrier_arrive(p_free.at[buf])
        delta = kept_delta(load_ref(delta_smem.at[slot], COLS), cfg)
        ds = (_signed_grad_logits(p, dp, delta) if g.terms.dropout else
              _grad_logits(p, dp, delta, None, row_axis=1))
        plgpu.barrier_wait(q_bar.at[slot])
        (dk,) = _accumulate(((dk, ds.astype(g.dtype), q_smem.at[slot]),))
        plgpu.barrier_arrive(free.at[slot])
        return n + 1, dk

      (dk,) = walk(body, _zeros((rows, g.head_dim)))
      _finish(sched, out2.at[wg], (out_at(dk_ref, own), dk * (cfg.scale * cfg.keep_scale)))

  @pl.when(wg == COMPUTE_WGS)
  def _producer():
    plgpu.set_max_registers(PRODUCER_REGS, action="decrease")

    def body(h, start, masked, n):
      slot = slot_of(n, g.slots)
      qh, seq = q_head(h), pl.ds(start, g.walk)

      @pl.when(n >= g.slots)
      def _():
        plgpu.barrier_wait(free.at[slot])

      plgpu.copy_gmem_to_smem(q_ref.at[batch, seq, qh], q_smem.at[slot], q_bar.at[slot])
      plgpu.copy_gmem_to_smem(lse_ref.at[batch, qh, seq], lse_smem.at[slot], q_bar.at[slot])
      if g.terms.tile_info(masked):
        plgpu.copy_gmem_to_smem(qinfo_ref.at[q_info_b, :, seq], qinfo_smem.at[slot],
                                q_bar.at[slot])
      else:
        plgpu.barrier_arrive(q_bar.at[slot])  # the phase's third arrival, without data
      if g.terms.dropout:
        plgpu.copy_gmem_to_smem(head_view(extra.row_keys, batch, qh).at[seq],
                                rkey_smem.at[slot], q_bar.at[slot])
      plgpu.copy_gmem_to_smem(do_ref.at[batch, seq, qh], do_smem.at[slot], do_bar.at[slot])
      plgpu.copy_gmem_to_smem(delta_ref.at[batch, qh, seq], delta_smem.at[slot], do_bar.at[slot])
      copy_bias(g.terms, extra.tile_bias, stage, g.owners, masked, batch, qh, kj * g.cta_rows,
                start, tile)
      return n + 1

    _walk(g, plan_row, body, jnp.int32(0))


def _dq_kernel(idx_ref, cnt_ref, full_ref, qinfo_ref, kinfo_ref, *refs, cfg, g: _BwdGeometry):
  # After ``g.terms``' inputs, q, k, v, dO and lse: the row term's refs: delta in, or
  # (``g.delta_from_o``) o and optionally dlse in, delta out; then dq_acc in (``g.add_dq``).
  extra, (q_ref, k_ref, v_ref, do_ref, lse_ref, *refs) = g.terms.refs(refs)
  *io, owned, walked, out2, bars = refs
  outs = 2 if g.delta_from_o else 1
  ins, (dq_ref, *delta_out) = io[:-outs], io[-outs:]
  acc_ref = ins[-1] if g.add_dq else None
  ins = ins[:-1] if g.add_dq else ins
  if g.delta_from_o:
    o_ref, *dlse_ref = ins
    row_in, delta_out = (dlse_ref[0] if dlse_ref else None), delta_out[0]
  else:
    (row_in,), o_ref = ins, None
  q_own2, do_own2, lse_own2, delta_own2, qinfo_own2, rkey_own2, stage = owned
  stage = BiasStage(*stage) if g.terms.staged else None  # (a staged bias's windows)
  k_smem, v_smem, kinfo_smem = walked
  own_bar, k_bar, v_bar, free, done = bars
  batch, head, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
  qi = g.blocks - 1 - lax.axis_index("q_seq")  # longest causal rows first, as in the forward
  rows, consumers = g.rows, g.owners
  q_info_b, k_info_b = common.sel(qinfo_ref.shape[0], batch), common.sel(kinfo_ref.shape[0], batch)
  kv_head = lax.div(head, jnp.asarray(g.group, head.dtype))

  def plan_row(h):
    del h
    at = lambda ref: head_view(ref, batch, head)
    blk = g.plan_block(qi)
    return at(idx_ref).at[blk], at(cnt_ref)[blk], at(full_ref)[blk]

  @pl.when(wg < consumers)
  def _consumer():
    plgpu.set_max_registers(CONSUMER_REGS, action="increase")
    open_stage(g.terms, stage, wg)
    q_own, do_own = q_own2.at[wg], do_own2.at[wg]
    q0 = qi * g.cta_rows + wg * rows
    own, seq = (batch, pl.ds(q0, rows), head), pl.ds(q0, rows)
    delta_own = delta_own2.at[wg]  # delta, dlse, or nothing (then computed from o alone)
    for src, dst in ((q_ref.at[own], q_own), (do_ref.at[own], do_own),
                     (lse_ref.at[batch, head, seq], lse_own2.at[wg]),
                     (qinfo_ref.at[q_info_b, :, seq], qinfo_own2.at[wg]),
                     *([(row_in.at[batch, head, seq], delta_own)] if row_in is not None else []),
                     *([(head_view(extra.row_keys, batch, head).at[seq], rkey_own2.at[wg])]
                       if g.terms.dropout else [])):
      plgpu.copy_gmem_to_smem(src, dst, own_bar.at[wg])
    if g.delta_from_o:  # (global loads issued while the copies fly; o is read only here)
      o = load_ref(o_ref.at[own], plgpu.Layout.WGMMA, optimized=False)
    plgpu.barrier_wait(own_bar.at[wg])
    tile = (rows, g.walk)  # [queries, keys]
    q_info = broadcast_info(qinfo_own2.at[wg], ROWS, tile, 0, g.info_rows)
    lse2 = load_ref(lse_own2.at[wg], ROWS)
    if g.delta_from_o:  # delta = sum(o * dO) - dlse, also the dK/dV kernel's
      delta = (o.astype(jnp.float32) * load_ref(do_own, plgpu.Layout.WGMMA).astype(jnp.float32)
               ).sum(axis=1)
      if row_in is not None:
        delta = delta - load_ref(delta_own, ROWS)
      delta_own[...] = delta
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(delta_own, delta_out.at[batch, head, seq])  # (waited in _finish)
    else:
      delta = load_ref(delta_own, ROWS)
    delta = kept_delta(delta, cfg)
    slope = slope2(extra.slopes, batch, head)
    k_slope = logit_slope(slope, cfg)  # (the keys' side, in the units of ``with_terms``)
    row_keys = load_ref(rkey_own2.at[wg], ROWS) if g.terms.dropout else None
    if g.terms.alibi_split:  # (``terms``: the anchor is the first owned row's position)
      anchor = qinfo_ref[q_info_b, 0, q0]
      q_term = position_term(slope, load_ref(qinfo_own2.at[wg].at[0], ROWS), anchor)

    def body(h, start, masked, carry):
      n, dq = carry
      slot = slot_of(n, g.slots)
      k, v = k_smem.at[slot], v_smem.at[slot]
      plgpu.barrier_wait(k_bar.at[slot])
      plgpu.barrier_wait(v_bar.at[slot])

      s, dp = _products(tile, ((q_own, k), (do_own, v)))  # s = q K^T, dp = dO V^T
      bias = bias_window(g.terms, extra.tile_bias, masked, batch, head, q0, start, tile, stage,
                         wg)
      terms = _TileTerms(bias=bias)
      if g.terms.tile_info(masked):
        k_info = broadcast_info(kinfo_smem.at[slot], COLS, tile, 1, g.key_rows)
        k_index = start + plgpu.broadcasted_iota(jnp.int32, tile, 1, layout=plgpu.Layout.WGMMA)
        split = None
        if g.terms.alibi_split:
          k_term = position_term(k_slope, load_ref(kinfo_smem.at[slot].at[0], COLS), anchor)
          split = (broadcast(k_term, tile, 1), q_term)
        terms = _tile_terms(cfg, g, masked, q_info, k_info, k_index,
                            None if row_keys is None else broadcast(row_keys, tile, 0), k_slope,
                            split, bias)
      p, dlogits = _probs(s, lse2, terms, cfg, row_axis=0)
      ds = _grad_logits(p, dp, delta, dlogits, row_axis=0,
                        keep_mask=terms.keep_mask())
      (dq,) = _accumulate(((dq, ds.astype(g.dtype), k),))  # dq += ds K
      plgpu.barrier_arrive(free.at[slot])
      return n + 1, dq

    _, dq = _walk(g, plan_row, body, (jnp.int32(0), _zeros((rows, g.head_dim))))
    dq = dq * (cfg.scale * cfg.keep_scale)
    if acc_ref is not None:  # (read once the walk is done: no registers are free before)
      dq = dq + load_ref(acc_ref.at[own], plgpu.Layout.WGMMA, optimized=False).astype(jnp.float32)
    _finish(done, out2.at[wg], (dq_ref.at[own], dq))

  @pl.when(wg == consumers)
  def _producer():
    plgpu.set_max_registers(PRODUCER_REGS, action="decrease")

    def body(h, start, masked, n):
      slot = slot_of(n, g.slots)
      keys = pl.ds(start, g.walk)
      src = (batch, keys, kv_head)

      @pl.when(n >= g.slots)
      def _():
        plgpu.barrier_wait(free.at[slot])

      plgpu.copy_gmem_to_smem(k_ref.at[src], k_smem.at[slot], k_bar.at[slot])
      if g.terms.tile_info(masked):
        plgpu.copy_gmem_to_smem(kinfo_ref.at[k_info_b, :, keys], kinfo_smem.at[slot],
                                k_bar.at[slot])
      else:
        plgpu.barrier_arrive(k_bar.at[slot])  # the phase's second arrival, without data
      plgpu.copy_gmem_to_smem(v_ref.at[src], v_smem.at[slot], v_bar.at[slot])
      copy_bias(g.terms, extra.tile_bias, stage, consumers, masked, batch, head, qi * g.cta_rows,
                start, (rows, g.walk))
      return n + 1

    _walk(g, plan_row, body, jnp.int32(0))


def _bwd_call(kernel, consumers: int, scratch, out_shapes, grid, grid_names, args, *, cfg, g):
  """Runs a backward kernel: ``consumers`` warpgroups and the producer over ``grid``, with
  ``scratch = (owned, walked, out staging, barriers)`` (the staging aliases the walked slots)."""
  owned, walked, out, bars = scratch
  shared = plgpu.RefUnion(walked, out)

  def entry(*refs):
    pl.run_scoped(lambda own, sh, b: kernel(*refs, own, *sh, b, cfg=cfg, g=g),
                  owned, shared, bars, collective_axes="wg")

  params = plgpu.CompilerParams(approx_math=True)
  if not g.fused_dq:
    return plgpu.kernel(entry, out_type=out_shapes, grid=grid, grid_names=grid_names,
                        num_threads=consumers + 1, thread_name="wg", compiler_params=params)(*args)
  # The fused kernel adds to dQ in place: its last argument, float32, is the start of a ref that
  # it updates, as are dK/dV (``pl.run_state``; ``pl.kernel`` aliases ref arguments, which
  # plgpu.kernel's batching wrapper does not take). Returns ``(dq, *outputs)``; under vmap, one
  # call per element (run_state has no batching rule).
  mesh = plgpu.Mesh(grid=grid, grid_names=grid_names, num_threads=consumers + 1,
                    thread_name="wg")

  @jax.custom_batching.custom_vmap
  def fused(*args):
    run = lambda refs: pl.kernel(entry, out_type=(), mesh=mesh, compiler_params=params)(
        *args[:-1], *refs)
    return pl.run_state(run)((args[-1], *(jnp.zeros(o.shape, o.dtype) for o in out_shapes)))

  @fused.def_vmap
  def _(size, batched, *args):
    args = [x if b else jnp.broadcast_to(x, (size, *x.shape)) for x, b in zip(args, batched)]
    outs = lax.map(lambda xs: fused(*xs), args)
    return outs, (True,) * len(outs)

  return fused(*args)


@functools.partial(jax.jit, static_argnames=("cfg", "parts"))
def backward(q, k, v, do, lse, delta, ops: common.Operands, plan, cfg: common.KernelConfig,
             dq_acc=None, parts=common.BOTH, dkv_acc=None):
  """See ``kernels.common``: returns ``(dq, dk, dv)`` in ``cfg.out_dtype`` (the dQ kernel adds
  ``dq_acc``, the ring's running dq, to its rows before writing them, and the fused kernel
  starts dQ from it; ``dkv_acc`` is added after the dK/dV kernel).

  Backward tiles other than 128 x 128 (``backward_unsupported``) and interpret mode run the
  ``pallas_triton`` backward on the same plan instead (``cfg.num_stages`` means the forward's
  K/V slots here, so Triton gets its own default).
  """
  b, tp, n, hp = q.shape
  sp, kh = k.shape[1], k.shape[2]
  if cfg.interpret or backward_unsupported(cfg, hp) is not None:
    return pallas_triton.backward(q, k, v, do, lse, delta, ops, plan,
                                  dataclasses.replace(cfg, num_stages=None), dq_acc, parts,
                                  dkv_acc)
  want_dq, want_dkv = common.wants(parts)
  why = unsupported(ops_call(q, ops))
  variants = cfg.variants or Variants()
  if why is not None:
    raise NotImplementedError(f"backend 'pallas_mosaic_gpu' cannot serve {why}.")
  info_rows = 1 if ops.q_info.segment_ids is None else 2
  terms = terms_of(ops, cfg)
  bias_dt = tile_bias_dtype(ops)
  drop = int(terms.dropout)
  out_dt = jnp.dtype(cfg.out_dtype)
  dt, rows, f32, i32 = q.dtype, BWD_ROWS, jnp.float32, jnp.int32
  tile_bytes = rows * hp * dt.itemsize  # one owned [64, H] tile

  def geometry(dkv: bool, seq, heads, walk=None, staged=out_dt, fused=False, stage=True):
    """The dK/dV (``dkv``) or dQ kernel's tiles walked ``walk`` rows at a time (default
    ``variants.dkv_walk_rows`` / ``dq_walk_rows``) in as many slots as fit beside its owned
    tiles (the output staging tiles, of dtype ``staged``, alias the slots) and, where ``stage``
    and room allow, a staged bias's windows (one per owner); ``fused``: the fused dK/dV
    kernel's."""
    wide = hp > (variants.wide_dkv_above if dkv else variants.wide_dq_above)
    owners = _owners(wide)
    if walk is None:
      walk = (dict(variants.dkv_walk_rows).get(hp, rows) if dkv else
              rows if wide else variants.dq_walk_rows)
    # Owned: dK/dV: K and V of 64 keys (and their token info) per owner, and the wide kernel's
    # p^T buffers; dQ: q, dO, lse, delta and token info of 64 rows per owner.
    # Dropout: the keys' column keys (an extra token-info row) and the queries' row keys.
    owned = owners * (2 * tile_bytes + 4 * rows * (info_rows if dkv else 2 + info_rows) +
                      4 * rows * drop)
    owned += 2 * rows * walk * dt.itemsize if dkv and wide else 0
    # Fused: ds^T and the dQ staging tiles (float32) of each owner.
    owned += owners * walk * (rows * dt.itemsize + 4 * hp) if fused else 0
    bias_bytes = (staged_bias_bytes(bias_dt, variants, owners, rows, walk)
                  if stage and (terms.bias or terms.dense) else 0)
    owned += bias_bytes
    staging = (2 if dkv else owners) * rows * hp * jnp.dtype(staged).itemsize
    per_slot = walk * (2 * hp * dt.itemsize + 4 * (2 + info_rows + drop))
    room = SMEM_BYTES - owned
    n_slots = min(4, room // per_slot)
    if n_slots < 2 and walk > rows:  # shorter walked tiles
      return geometry(dkv, seq, heads, rows, staged, fused, stage)
    if n_slots < 2 and bias_bytes:  # the bias from global memory
      return geometry(dkv, seq, heads, walk, staged, fused, False)
    assert n_slots >= 2 and staging <= room, (hp, out_dt)  # (holds for every served head dim)
    return _BwdGeometry(slots=n_slots, group=n // kh, head_dim=hp, dtype=dt,
                        info_rows=info_rows, blocks=seq // (owners * rows),
                        walked_heads=heads, walk=walk, wide=wide,
                        terms=dataclasses.replace(terms, staged=bias_bytes > 0), fused_dq=fused,
                        dq_with_dkv=fused and hp <= variants.dq_with_dkv_up_to)

  lse2 = common.safe_lse(lse) * common.LOG2E  # base 2; empty rows: +inf, so p = 0
  # Token info and the score terms' inputs (the dK/dV kernel's tile bias transposed).
  infos = lambda dkv: (token_info(ops.q_info), key_info(ops), *terms.inputs(ops, cfg, dkv))
  # `num` barriers (one per owned tile or per slot) of `count` arrivals each.
  barriers = lambda count, num: plgpu.Barrier(num_arrivals=count, num_barriers=num)
  smem = functools.partial(swizzled_smem, dt)
  # A staged bias's windows: one [64, walk] tile per owner (``terms.BiasStage``).
  stage_of = lambda g: stage_scratch(bias_dt, g.owners, (rows, g.walk)) if g.terms.staged else ()

  # dQ first: the owned tiles are q, dO, lse, delta (and token info), the walked ones K/V. Given
  # a RowTerm it computes delta from o and returns it for the dK/dV kernel (H100, 16 causal
  # documents of 1024: forward+backward 0.800 ms against 0.848 with XLA's separate pass).
  # Fused (``Variants.deterministic=False``): no dQ kernel; the dK/dV kernel adds to dQ.
  fused = (not variants.deterministic and want_dq and want_dkv and
           hp <= variants.wide_dkv_above)
  if not variants.delta_in_dq or not want_dq or fused:
    delta = common.delta_array(delta, do)
  dq = None
  if want_dq and not fused:
    from_o = isinstance(delta, common.RowTerm)
    row_in = delta.dlse if from_o else delta  # the owned row input: delta, dlse or None
    row_in = () if row_in is None else (row_in.astype(f32),)
    g = dataclasses.replace(geometry(False, tp, 1), delta_from_o=from_o,
                            add_dq=dq_acc is not None)
    sl, w, owners = g.slots, g.walk, g.owners
    out = _bwd_call(
        _dq_kernel, owners,
        ((smem(owners, rows, hp), smem(owners, rows, hp), plgpu.SMEM((owners, rows), f32),
          plgpu.SMEM((owners, rows), f32), plgpu.SMEM((owners, info_rows, rows), i32),
          plgpu.SMEM((owners, rows if drop else 8), i32), stage_of(g)),  # (dropout row keys)
         (smem(sl, w, hp), smem(sl, w, hp), plgpu.SMEM((sl, g.key_rows, w), i32)),
         swizzled_smem(out_dt, owners, rows, hp),
         (barriers(4 + len(row_in) + drop, owners), barriers(2, sl), barriers(1, sl),
          barriers(owners, sl), barriers(owners, 1) if owners > 1 else None)),
        (jax.ShapeDtypeStruct(q.shape, out_dt), *([jax.ShapeDtypeStruct((b, n, tp), f32)]
                                                  if from_o else [])),
        (n, g.blocks, b), ("heads", "q_seq", "batch"),
        (plan.kv_index, plan.kv_count, plan.kv_full, *infos(False), q, k, v, do, lse2,
         *([delta.o] if from_o else []), *row_in,
         *([] if dq_acc is None else [dq_acc.astype(out_dt)])), cfg=cfg, g=g)
    dq, delta = out if from_o else (out[0], *row_in)
  if not want_dkv:
    return dq, None, None

  # dK/dV: the owned tiles are K/V, the walked ones q, dO, lse, delta (and q token info).
  group = n // kh
  g = geometry(True, sp, group, fused=fused)
  splits = dkv_head_splits(group, kh * g.blocks * b, variants)
  if splits > 1:  # float32 partials
    out_dt = jnp.dtype(f32)
    g = dataclasses.replace(geometry(True, sp, group // splits, staged=f32, fused=fused),
                            splits=splits)
  sl, w, two, wide = g.slots, g.walk, COMPUTE_WGS, g.wide
  own = () if wide else (two,)  # owned K/V tiles: one pair (wide) or one per consumer
  dq_smem, dq_in = None, ()
  if fused:  # a ds^T tile and a dQ staging tile per consumer; dQ's start
    dq_smem = (smem(two, rows, w), swizzled_smem(f32, two, w, hp))
    dq_in = (jnp.zeros(q.shape, f32) if dq_acc is None else dq_acc.astype(f32),)
  dkv_shape = jax.ShapeDtypeStruct((splits,) * (splits > 1) + (b, sp, kh, hp), out_dt)
  *dq_out, dk, dv = _bwd_call(
      _dkv_kernel, two,
      ((smem(*own, rows, hp), smem(*own, rows, hp), plgpu.SMEM((*own, g.key_rows, rows), i32),
        smem(2, rows, w) if wide else None, dq_smem, stage_of(g)),
       (smem(sl, w, hp), smem(sl, w, hp), plgpu.SMEM((sl, w), f32), plgpu.SMEM((sl, w), f32),
        plgpu.SMEM((sl, info_rows, w), i32), plgpu.SMEM((sl, w if drop else 8), i32)),
       swizzled_smem(out_dt, two, rows, hp),
       (barriers(3, two), barriers(3 + drop, sl), barriers(2, sl), barriers(two, sl),
        barriers(two, 1), barriers(1, 2) if wide else None, barriers(1, 2) if wide else None)),
      (dkv_shape, dkv_shape), (kh * splits, g.blocks, b), ("heads", "kv_seq", "batch"),
      (plan.q_index, plan.q_count, plan.q_full, *infos(True), q, k, v, do, lse2, delta, *dq_in),
      cfg=cfg, g=g)
  if splits > 1:  # the partials in a fixed order (bitwise reproducible)
    total = lambda x: functools.reduce(jnp.add, [x[i] for i in range(splits)])
    dk, dv = (total(x).astype(cfg.out_dtype) for x in (dk, dv))
  if fused:
    dq = dq_out[0].astype(cfg.out_dtype)
  return common.accumulated(None, (dq, dk, dv), dkv_acc)
