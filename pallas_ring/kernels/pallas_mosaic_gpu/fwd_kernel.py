"""The Mosaic GPU forward: work items and their launch order, the consumers' main loop (serial
and overlapped walks), the producer, and the epilogue (normalise, or merge into the ring's
running result)."""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_ring.kernels import common, pallas_triton
from pallas_ring.kernels.pallas_mosaic_gpu.pipeline import (
    COLS, ROWS, broadcast_info, head_view, keep_alive, load_ref, mark_issued, pingpong,
    row_vector, slot_of, swizzled_smem, token_info, wait_to_issue, wgmma_accumulator_load)
from pallas_ring.kernels.pallas_mosaic_gpu.terms import (
    BiasStage, Terms, bias_window, broadcast, copy_bias, keep, kept, key_info, logit_slope,
    logits, open_stage, position_term, slope2, stage_scratch, terms_of, tile_bias_dtype,
    with_terms)
from pallas_ring.kernels.pallas_mosaic_gpu.tiles import (
    COMPUTE_WGS, CONSUMER_REGS, PRODUCER_REGS, SMEM_BYTES, Variants, check_tiles, fwd_smem,
    item_order, ops_call, overlaps, persistent_ctas, slots, staged_bias_bytes, unsupported)


@dataclasses.dataclass(frozen=True)
class _Geometry:
  """Static sizes of one forward call."""

  bq: int  # rows per consumer warpgroup
  bk: int  # key tile
  slots: int  # K/V shared-memory slots
  group: int  # query heads per kv head
  head_dim: int
  dtype: object
  info_rows: int  # token-info rows: 1 (positions) or 2 (and segment ids)
  q_blocks: int  # q blocks (plan rows) along the sequence
  heads: int  # query heads
  batch: int
  ctas: int  # CTAs launched; each walks work items ctas apart (``_each_item``)
  merge: bool = False  # merge into the earlier passes' (o, lse) (``common.Partial``)
  overlap: bool = False  # each tile's softmax overlaps the previous tile's p.v (``overlaps``)
  order: str = "heads"  # work items' launch order (``item_order``)
  terms: Terms = Terms()  # score terms: ALiBi, bias, dense mask, dropout (``terms``)

  @property
  def key_rows(self) -> int:
    """Rows of the keys' token info: ``info_rows``, then the dropout column keys."""
    return self.info_rows + self.terms.dropout

  @property
  def items(self) -> int:
    """Work items: one q block (``2 * bq`` rows) of one head."""
    return self.heads * self.q_blocks * self.batch


def _item(g: _Geometry, i):
  """``(batch, head, qi)`` of work item ``i`` in ``g.order`` (``item_order``); q blocks run from
  the last (H100: causal 1.73 vs 1.98 ms with heads fastest)."""
  heads, q_blocks = (jnp.asarray(n, i.dtype) for n in (g.heads, g.q_blocks))  # (also under x64)
  if g.order == "blocks":
    qi, rest = lax.rem(i, q_blocks), lax.div(i, q_blocks)
    return lax.div(rest, heads), lax.rem(rest, heads), q_blocks - 1 - qi
  head, rest = lax.rem(i, heads), lax.div(i, heads)
  return lax.div(rest, q_blocks), head, q_blocks - 1 - lax.rem(rest, q_blocks)


def _each_item(g: _Geometry, body, carry):
  """``carry = body(i, carry)`` for each work item ``i`` of this CTA: ``cta``, ``cta + g.ctas``,
  ... (one item, ``cta``, unless persistent)."""
  cta = lax.axis_index("cta")
  ctas = jnp.asarray(g.ctas, cta.dtype)
  return lax.fori_loop(jnp.asarray(0, cta.dtype), lax.div(g.items - 1 - cta, ctas) + 1,
                       lambda t, carry: body(cta + t * ctas, carry), carry)


def _fwd_kernel(idx_ref, cnt_ref, full_ref, qinfo_ref, kinfo_ref, *refs, cfg, g: _Geometry):
  # refs: ``g.terms``' inputs (``TermRefs``), q, k, v, the earlier passes'
  # (o, lse) when merging, o, lse, and the scoped scratch (with a staged bias's ``BiasStage``).
  extra, (q_ref, k_ref, v_ref, *io) = g.terms.refs(refs)
  *acc_refs, o_ref, lse_ref, scoped = io
  (q_smem2, k_smem, v_smem, lse_smem2, qinfo_smem2, kinfo_smem, rkey_smem2), bars, stage = scoped
  stage = BiasStage(*stage) if g.terms.staged else None
  (k_bar, v_bar, q_bar), (k_free, v_free) = bars
  wg = lax.axis_index("wg")
  bq, bk, h = g.bq, g.bk, g.head_dim

  def plan_row(batch, head, qi):
    """``(kv index row, count, n_full)`` of an item's plan row."""
    lists = lambda ref: head_view(ref, batch, head)
    return lists(idx_ref).at[qi], lists(cnt_ref)[qi], lists(full_ref)[qi]

  @pl.when(wg < COMPUTE_WGS)
  def _consumer():
    plgpu.set_max_registers(CONSUMER_REGS, action="increase")
    q_smem, lse_smem, qinfo_smem = q_smem2.at[wg], lse_smem2.at[wg], qinfo_smem2.at[wg]
    rkey_smem = rkey_smem2.at[wg]
    open_stage(g.terms, stage, wg)
    m0, l0 = row_vector(common.NEG_INF, bq), row_vector(0.0, bq)

    first_row = lambda qi: qi * (COMPUTE_WGS * bq) + wg * bq  # this consumer's, in q block qi

    def load_q(i):
      """Issues the loads of this consumer's q rows of item ``i`` and their token info."""
      batch, head, qi = _item(g, i)
      q0 = first_row(qi)
      plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(q0, bq), head], q_smem, q_bar.at[wg])
      plgpu.copy_gmem_to_smem(qinfo_ref.at[common.sel(qinfo_ref.shape[0], batch), :,
                                           pl.ds(q0, bq)], qinfo_smem, q_bar.at[wg])
      if g.terms.dropout:
        plgpu.copy_gmem_to_smem(head_view(extra.row_keys, batch, head).at[pl.ds(q0, bq)],
                                rkey_smem, q_bar.at[wg])

    def item(i, base):
      """This consumer's rows of item ``i``; ``base`` counts the CTA's earlier tiles (the slot
      ring runs on across items). Returns it with this item's tiles added."""
      batch, head, qi = _item(g, i)
      q0 = first_row(qi)
      idx_row, count, n_full = plan_row(batch, head, qi)
      at = lambda j: slot_of(base + j, g.slots)  # the slot of the item's tile j
      plgpu.barrier_wait(q_bar.at[wg])
      # Token info rows (positions, then segment ids) broadcast to the [bq, bk] tile.
      q_info = broadcast_info(qinfo_smem, ROWS, (bq, bk), 0, g.info_rows)
      slope = slope2(extra.slopes, batch, head)
      k_slope = logit_slope(slope, cfg)  # (the keys' side, in the units of ``with_terms``)
      if g.terms.alibi_split:  # (``terms``: the anchor is this consumer's first row's position)
        anchor = qinfo_ref[common.sel(qinfo_ref.shape[0], batch), 0, q0]
        q_term = position_term(slope, load_ref(qinfo_smem.at[0], ROWS), anchor)

      def softmax(s_raw, k0, slot, m, l, masked):
        """``(p16, m, l, alpha)`` after the raw logits of the tile of keys from ``k0``; releases
        the tile's K slot."""
        # The slot's key info is read before the slot is released to the producer (which then
        # overwrites it with a later tile's).
        k_info = (broadcast_info(kinfo_smem.at[slot], COLS, (bq, bk), 1, g.key_rows)
                  if g.terms.tile_info(masked) else None)
        vis = None
        if g.terms.vis_on(masked):
          k_index = k0 + plgpu.broadcasted_iota(jnp.int32, (bq, bk), 1,
                                                layout=plgpu.Layout.WGMMA)
          vis = common.tile_visible(cfg, q_info[0], k_info[0], k_index, *q_info[1:],
                                    *k_info[1:g.info_rows])
        alibi = None
        if g.terms.alibi_split:
          k_term = position_term(k_slope, load_ref(kinfo_smem.at[slot].at[0], COLS), anchor)
          alibi = broadcast(k_term, (bq, bk), 1)
        elif slope is not None:
          alibi = (k_slope, q_info[0], k_info[0])
        bias = bias_window(g.terms, extra.tile_bias, masked, batch, head, q0, k0, (bq, bk),
                           stage, wg)
        s, c = logits(s_raw, cfg)
        s = with_terms(s, c, alibi, bias)
        plgpu.barrier_arrive(k_free.at[slot])
        if vis is not None:
          s = jnp.where(vis, s, common.NEG_INF)
        m_new = jnp.maximum(m, s.max(axis=1) * c)  # base 2
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s * c - lax.broadcast_in_dim(m_new, s.shape, [0]))
        if vis is not None:
          p = jnp.where(vis, p, 0.0)
        p_kept = p
        if g.terms.dropout:  # (after the row reductions: the mask is not live across them)
          p_kept = kept(p, keep(cfg, broadcast(load_ref(rkey_smem, ROWS), (bq, bk), 0),
                                k_info[-1]))
        return p_kept.astype(g.dtype), m_new, l * alpha + p.sum(axis=1), alpha

      def serial_step(j, carry, masked):
        """Tile j: q.k^T, its softmax, then p.v, complete before tile j+1's q.k^T."""
        acc, m, l = carry
        slot = at(j)

        def qk(acc_ref):
          plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
          mark_issued()
          return acc_ref[...]

        p16, m_new, l, alpha = softmax(pl.run_scoped(qk, plgpu.ACC((bq, bk), jnp.float32)),
                                       idx_row[j] * bk, slot, m, l, masked)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
        plgpu.barrier_wait(v_bar.at[slot])
        wait_to_issue()

        def pv(acc_ref):
          plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
          nxt = j + 1

          @pl.when(nxt < count)
          def _():
            plgpu.barrier_wait(k_bar.at[at(nxt)])

        acc = pl.run_state(pv)(plgpu.ACC.init(acc))
        plgpu.barrier_arrive(v_free.at[slot])
        return acc, m_new, l

      def serial_walk():
        @pl.when(count > 0)
        def _():
          plgpu.barrier_wait(k_bar.at[at(0)])

        acc = plgpu.layout_cast(jnp.zeros((bq, h), jnp.float32), plgpu.Layout.WGMMA)
        full = lax.fori_loop(0, n_full, functools.partial(serial_step, masked=False),
                             (acc, m0, l0))
        return lax.fori_loop(n_full, count, functools.partial(serial_step, masked=True), full)

      def overlapped_step(o_ref, j, p16_prev, m, l, masked):
        """Issues tile j's q.k^T and (unless ``p16_prev`` is None) tile j-1's p.v into
        ``o_ref``, and returns tile j's ``(p16, m, l)`` from its softmax, run while p.v runs;
        then waits for p.v and rescales ``o_ref``."""
        slot, prev = at(j), at(j + g.slots - 1)
        plgpu.barrier_wait(k_bar.at[slot])
        wait_to_issue()

        def qk(s_ref):
          plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
          if p16_prev is not None:
            plgpu.barrier_wait(v_bar.at[prev])
            plgpu.wgmma(o_ref, p16_prev, v_smem.at[prev])
          mark_issued()
          # q.k^T was issued first, so it is done once at most p.v is in flight.
          return wgmma_accumulator_load(s_ref, wait_n=0 if p16_prev is None else 1)

        p16, m_new, l, alpha = softmax(pl.run_scoped(qk, plgpu.ACC((bq, bk), jnp.float32)),
                                       idx_row[j] * bk, slot, m, l, masked)
        if p16_prev is not None:
          plgpu.wgmma_wait(0)
          keep_alive(p16_prev)
          plgpu.barrier_arrive(v_free.at[prev])
          o_ref[...] = o_ref[...] * lax.broadcast_in_dim(alpha, (bq, h), [0])
        return p16, m_new, l

      def overlapped_walk(o_ref):
        step = lambda masked: lambda j, carry: overlapped_step(o_ref, j, *carry, masked=masked)
        # The first tile is always masked (its token info is loaded for that), as only it has
        # no p.v to overlap.
        first = lambda: overlapped_step(o_ref, jnp.int32(0), None, m0, l0, masked=True)
        p16 = plgpu.layout_cast(jnp.zeros((bq, bk), g.dtype), plgpu.Layout.WGMMA)
        carry = lax.cond(count > 0, first, lambda: (p16, m0, l0))
        carry = lax.fori_loop(1, n_full, step(False), carry)
        p16, m, l = lax.fori_loop(jnp.maximum(n_full, 1), count, step(True), carry)

        @pl.when(count > 0)
        def _():  # the last tile's p.v
          last = at(count - 1)
          wait_to_issue()
          plgpu.barrier_wait(v_bar.at[last])
          plgpu.wgmma(o_ref, p16, v_smem.at[last])
          mark_issued()
          plgpu.wgmma_wait(0)
          plgpu.barrier_arrive(v_free.at[last])

        return o_ref[...], m, l

      if g.overlap:
        acc, m, l = pl.run_scoped(overlapped_walk, plgpu.ACC((bq, h), jnp.float32))
      else:
        acc, m, l = serial_walk()

      nxt = i + g.ctas
      if g.merge:  # (the q tile is free: the next item's q loads while these rows merge)
        pl.when(nxt < g.items)(lambda: load_q(nxt))
      if g.terms.alibi_split:
        m = m - q_term  # (the row's lse in the unsplit logits)
      empty = l == 0.0
      inv = cfg.keep_scale / jnp.where(empty, 1.0, l)  # (dropout: kept terms' 1 / (1 - rate))
      lse = jnp.where(empty, -jnp.inf, m * common.LN2 + jnp.log(jnp.where(empty, 1.0, l)))
      rows = lambda x: lax.broadcast_in_dim(x, acc.shape, [0])
      seq = pl.ds(q0, bq)
      own_o, own_lse = o_ref.at[batch, seq, head], lse_ref.at[batch, head, seq]
      if g.merge:  # the earlier passes' rows, read from and written to global memory in float32
        acc_o, acc_lse = acc_refs
        lse, c_acc, c_own = common.merge_weights(
            load_ref(acc_lse.at[batch, head, seq], ROWS, optimized=False), lse)
        earlier = load_ref(acc_o.at[batch, seq, head], plgpu.Layout.WGMMA, optimized=False)
        own_o[...] = earlier * rows(c_acc) + acc * rows(inv * c_own)
        own_lse[...] = lse
      else:  # through the q tile's shared memory, which the next item's q then overwrites
        q_smem[...] = (acc * rows(inv)).astype(g.dtype)
        lse_smem[...] = lse
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, own_o)
        plgpu.copy_smem_to_gmem(lse_smem, own_lse)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        pl.when(nxt < g.items)(lambda: load_q(nxt))
      return base + count

    load_q(lax.axis_index("cta"))
    # The consumers' schedule runs on across items, as one walk. Overlapped: one issue phase
    # per step, warpgroup 1 lets warpgroup 0 issue first and warpgroup 0 takes that extra
    # arrival last; serial: warpgroup 1 waits for warpgroup 0's first issue.
    pingpong(lambda: _each_item(g, item, jnp.int32(0)),
              *((mark_issued, wait_to_issue) if g.overlap else (wait_to_issue, mark_issued)))
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == COMPUTE_WGS)
  def _producer():
    plgpu.set_max_registers(PRODUCER_REGS, action="decrease")

    def item(i, base):
      """Streams item ``i``'s K/V tiles into the slot ring, which runs on from ``base``."""
      batch, head, qi = _item(g, i)
      idx_row, count, n_full = plan_row(batch, head, qi)
      kv_head = lax.div(head, jnp.asarray(g.group, head.dtype))
      k_info_b = common.sel(kinfo_ref.shape[0], batch)

      @pl.loop(0, count)
      def _(j):
        n = base + j  # the CTA's tile count
        slot = slot_of(n, g.slots)
        keys = pl.ds(idx_row[j] * bk, bk)
        src = (batch, keys, kv_head)

        @pl.when(n >= g.slots)
        def _():
          plgpu.barrier_wait(k_free.at[slot])

        plgpu.copy_gmem_to_smem(k_ref.at[src], k_smem.at[slot], k_bar.at[slot])

        # Only masked tiles read the keys' token info (and the overlapped walk's first tile,
        # which it always masks), unless ALiBi or dropout need it on every tile
        # (``Terms.tile_info``).
        masked = (j >= n_full) | (j == 0) if g.overlap else j >= n_full
        with_info = g.terms.tile_info(masked)

        def copy_info():
          plgpu.copy_gmem_to_smem(kinfo_ref.at[k_info_b, :, keys], kinfo_smem.at[slot],
                                  k_bar.at[slot])

        def no_info():
          plgpu.barrier_arrive(k_bar.at[slot])  # the phase's second arrival, without data

        pl.when(with_info)(copy_info)
        pl.when(not with_info if isinstance(with_info, bool) else ~with_info)(no_info)

        # Both consumers' bias windows (staged), each once its reader has loaded the last:
        # that is before it releases the V slot that the next copy waits for.
        copy_bias(g.terms, extra.tile_bias, stage, COMPUTE_WGS, masked, batch, head,
                  qi * (COMPUTE_WGS * bq), idx_row[j] * bk, (bq, bk))

        @pl.when(n >= g.slots)
        def _():
          plgpu.barrier_wait(v_free.at[slot])

        plgpu.copy_gmem_to_smem(v_ref.at[src], v_smem.at[slot], v_bar.at[slot])

      return base + count

    _each_item(g, item, jnp.int32(0))


@functools.partial(jax.jit, static_argnames=("cfg",))
def forward(q, k, v, ops: common.Operands, plan, cfg: common.KernelConfig, acc=None):
  """See ``kernels.common``: returns ``(o [B, Tp, N, Hp], lse [B, N, Tp] float32)``.

  ``o`` leaves the kernel in the inputs' 16-bit dtype (it is staged through the q tile's shared
  memory) and is cast to ``cfg.out_dtype``. Given ``acc`` (the ring's running result) the kernel
  merges into it instead: each consumer reads its rows of ``acc`` once it has finished its walk
  and writes the merged float32 rows (measured faster than merging after the kernel for a ring
  step at 8k tokens per H100, though the read after the walk stalls each CTA: BENCHMARKS.md's
  history).
  """
  if cfg.interpret:  # no Mosaic GPU interpreter for this kernel: Triton's emulates the plan walk
    return pallas_triton.forward(q, k, v, ops, plan, dataclasses.replace(cfg, num_stages=None),
                                 acc)
  why = unsupported(ops_call(q, ops))
  if why is not None:
    raise NotImplementedError(f"backend 'pallas_mosaic_gpu' cannot serve {why}.")
  terms = terms_of(ops, cfg)
  b, tp, n, hp = q.shape
  itemsize = jnp.dtype(q.dtype).itemsize
  variants = cfg.variants or Variants()
  bq, bias_dt = cfg.block_q // COMPUTE_WGS, tile_bias_dtype(ops)
  staged = (staged_bias_bytes(bias_dt, variants, COMPUTE_WGS, bq, cfg.block_kv)
            if terms.bias or terms.dense else 0)
  if fwd_smem(cfg, hp, itemsize, staged) > SMEM_BYTES:
    staged = 0  # (no room beside two K/V slots: read from global memory)
  terms = dataclasses.replace(terms, staged=staged > 0)
  check_tiles(cfg, hp, itemsize, staged)
  overlap = overlaps(cfg.block_kv, hp, ops.q_info.segment_ids is not None, variants)
  g = _Geometry(bq=bq, bk=cfg.block_kv,
                slots=slots(cfg, hp, itemsize, staged), group=n // k.shape[2], head_dim=hp,
                dtype=q.dtype, info_rows=1 if ops.q_info.segment_ids is None else 2,
                q_blocks=tp // cfg.block_q, heads=n, batch=b,
                ctas=persistent_ctas(n * (tp // cfg.block_q) * b, cfg.mask, overlap, variants),
                merge=acc is not None, overlap=overlap, order=item_order(k.shape[1], variants),
                terms=terms)
  smem = functools.partial(swizzled_smem, q.dtype)
  scratch = (smem(COMPUTE_WGS, g.bq, hp), smem(g.slots, g.bk, hp), smem(g.slots, g.bk, hp),
             plgpu.SMEM((COMPUTE_WGS, g.bq), jnp.float32),
             plgpu.SMEM((COMPUTE_WGS, g.info_rows, g.bq), jnp.int32),
             plgpu.SMEM((g.slots, g.key_rows, g.bk), jnp.int32),
             plgpu.SMEM((COMPUTE_WGS, g.bq if terms.dropout else 8), jnp.int32))  # row keys
  # q and k tiles arrive with their token info: two copies, so two arrivals per phase (q rows:
  # three with dropout's row keys).
  barriers = ((plgpu.Barrier(num_arrivals=2, num_barriers=g.slots),
               plgpu.Barrier(num_barriers=g.slots),
               plgpu.Barrier(num_arrivals=2 + terms.dropout, num_barriers=COMPUTE_WGS)),
              (plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=g.slots),) * 2)

  stage = stage_scratch(bias_dt, COMPUTE_WGS, (bq, g.bk)) if staged else ()

  def entry(*refs):
    pl.run_scoped(
        lambda *scoped: _fwd_kernel(*refs, (scoped[:7], scoped[7:9], scoped[9]), cfg=cfg, g=g),
        *scratch, *barriers, stage, collective_axes="wg")

  o_dtype = jnp.float32 if g.merge else q.dtype
  o, lse = plgpu.kernel(
      entry,
      out_type=(jax.ShapeDtypeStruct(q.shape, o_dtype), jax.ShapeDtypeStruct((b, n, tp),
                                                                             jnp.float32)),
      grid=(g.ctas,), grid_names=("cta",), num_threads=COMPUTE_WGS + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )(plan.kv_index, plan.kv_count, plan.kv_full, token_info(ops.q_info), key_info(ops),
    *terms.inputs(ops, cfg), q, k, v, *(() if acc is None else (acc.o.astype(jnp.float32),
                                                                acc.lse.astype(jnp.float32))))
  return o.astype(cfg.out_dtype), lse
