"""The Mosaic GPU forward: the kernel (its warpgroups' roles: two consumers running the main
loop and epilogue, a producer streaming K/V) and its launch.

The pieces, one concern each as in FlashAttention-3's ``hopper/``: ``fwd_scheduler`` (work
items), ``fwd_mainloop`` (the consumers' walk), ``fwd_epilogue`` (normalise, or merge into the
ring's running result); the producer is here."""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_ring import kernels
from pallas_ring.kernels import common
from pallas_ring.kernels.pallas_mosaic_gpu import fp8
from pallas_ring.kernels.pallas_mosaic_gpu.fwd_epilogue import epilogue
from pallas_ring.kernels.pallas_mosaic_gpu.fwd_mainloop import (
    Consumer, FwdRefs, load_q, open_item, walk)
from pallas_ring.kernels.pallas_mosaic_gpu.fwd_scheduler import (
    FwdGeometry, each_item, plan_row, work_item)
from pallas_ring.kernels.pallas_mosaic_gpu.pipeline import (
    mark_issued, pingpong, row_vector, slot_of, swizzled_smem, token_info, wait_to_issue)
from pallas_ring.kernels.pallas_mosaic_gpu.terms import (
    TermStage, copy_tile_term, key_info, ops_call, open_stage, stage_scratch, staged_bytes,
    terms_of, tile_term_dtype)
from pallas_ring.kernels.pallas_mosaic_gpu.tiles import (
    COMPUTE_WGS, SMEM_BYTES, Variants, check_tiles, check_value_dim, fwd_smem,
    item_order, o_view_rows, overlaps, persistent_ctas, slots, step_refs, unsupported)


def _refs(refs, g: FwdGeometry) -> FwdRefs:
  """``FwdRefs`` of the kernel's refs: the plan's lists, both sides' token info, ``g.terms``'
  inputs (``TermRefs``), the FP8 descales in FP8 mode, q, k, v, the earlier passes' (o, lse)
  when merging, o, lse, then the scoped scratch ``(tiles, barriers, a staged tile term's
  TermStage, the output's staging)`` (the last ``()`` unless ``g.o_staging`` is "own")."""
  idx_ref, cnt_ref, full_ref, qinfo_ref, kinfo_ref, *refs = refs
  extra, refs = g.terms.refs(refs)
  descales, refs = (refs[0], refs[1:]) if g.fp8 else (None, refs)
  q_ref, k_ref, v_ref, *io = refs
  *acc_refs, o_ref, lse_ref, scoped = io
  smem, bars, stage, o_stage = scoped
  (k_bar, v_bar, q_bar), (k_free, v_free) = bars
  if g.o_staging == "q_view":  # (the q tiles' union with their view at Hv columns)
    q_tiles, o_view = smem[0]
    smem, o_stage = (q_tiles, *smem[1:]), o_view.at[:, pl.ds(0, g.bq)]
  elif g.o_staging != "own":  # the q tiles (merging stages nothing)
    o_stage = smem[0]
  return FwdRefs((idx_ref, cnt_ref, full_ref), qinfo_ref, kinfo_ref, extra, q_ref, k_ref, v_ref,
                 descales, tuple(acc_refs), o_ref, lse_ref, *smem, k_bar, v_bar, q_bar, k_free,
                 v_free, TermStage(*stage) if g.terms.staged else None, o_stage)


def _fwd_kernel(*refs, cfg, g: FwdGeometry):
  """The forward kernel of one CTA (``refs``: see ``_refs``): two consumer warpgroups and the
  producer."""
  r = _refs(refs, g)
  wg = lax.axis_index("wg")
  pl.when(wg < COMPUTE_WGS)(lambda: _consumer(cfg, g, r, wg))
  pl.when(wg == COMPUTE_WGS)(lambda: _producer(g, r))


def _consumer(cfg, g: FwdGeometry, r: FwdRefs, wg):
  """A consumer warpgroup: its rows of each of the CTA's work items (main loop, epilogue)."""
  plgpu.set_max_registers(g.regs[0], action="increase")
  q_smem, lse_smem, qinfo_smem = r.q_smem.at[wg], r.lse_smem.at[wg], r.qinfo_smem.at[wg]
  o_smem, rkey_smem = r.o_smem.at[wg], r.rkey_smem.at[wg]
  open_stage(g.terms, r.stage, wg)
  m0, l0 = row_vector(common.NEG_INF, g.bq), row_vector(0.0, g.bq)
  c = Consumer(cfg, g, r, wg, q_smem, o_smem, lse_smem, qinfo_smem, rkey_smem, m0, l0)

  def item(i, base):
    """This consumer's rows of item ``i``; ``base`` counts the CTA's earlier tiles (the slot
    ring runs on across items). Returns it with this item's tiles added."""
    rows = open_item(c, i, base)
    acc, m, l = walk(c, rows)
    epilogue(c, rows, i, acc, m, l)
    return base + rows.count

  load_q(c, lax.axis_index("cta"))
  # The consumers' schedule runs on across items, as one walk. Overlapped: one issue phase
  # per step, warpgroup 1 lets warpgroup 0 issue first and warpgroup 0 takes that extra
  # arrival last; serial: warpgroup 1 waits for warpgroup 0's first issue.
  pingpong(lambda: each_item(g, item, jnp.int32(0)),
           *((mark_issued, wait_to_issue) if g.overlap else (wait_to_issue, mark_issued)))
  plgpu.wait_smem_to_gmem(0)


def _producer(g: FwdGeometry, r: FwdRefs):
  """The producer warpgroup: streams each work item's K/V tiles (and their token info, and the
  staged tile term's windows) into the slot ring."""
  plgpu.set_max_registers(g.regs[1], action="decrease")

  def item(i, base):
    """Streams item ``i``'s K/V tiles into the slot ring, which runs on from ``base``."""
    batch, head, qi = work_item(g, i)
    idx_row, count, n_full = plan_row(r.plan, batch, head, qi)
    kv_head = lax.div(head, jnp.asarray(g.group, head.dtype))
    k_info_b = common.sel(r.k_info.shape[0], batch)

    @pl.loop(0, count)
    def _(j):
      n = base + j  # the CTA's tile count
      slot = slot_of(n, g.slots)
      keys = pl.ds(idx_row[j] * g.bk, g.bk)

      @pl.when(n >= g.slots)
      def _():
        plgpu.barrier_wait(r.k_free.at[slot])

      plgpu.copy_gmem_to_smem(r.k.at[batch, keys, kv_head], r.k_smem.at[slot], r.k_bar.at[slot])

      # Only masked tiles read the keys' token info (and the overlapped walk's first tile,
      # which it always masks), unless a term needs it on every tile (``Terms.tile_info``).
      masked = (j >= n_full) | (j == 0) if g.overlap else j >= n_full
      with_info = g.terms.tile_info(masked)

      def copy_info():
        plgpu.copy_gmem_to_smem(r.k_info.at[k_info_b, :, keys], r.kinfo_smem.at[slot],
                                r.k_bar.at[slot])

      def no_info():
        plgpu.barrier_arrive(r.k_bar.at[slot])  # the phase's second arrival, without data

      pl.when(with_info)(copy_info)
      pl.when(not with_info if isinstance(with_info, bool) else ~with_info)(no_info)

      # Both consumers' tile-term windows (staged), each once its reader has loaded the last:
      # that is before it releases the V slot that the next copy waits for.
      copy_tile_term(g.terms, r.terms.tile_term, r.stage, COMPUTE_WGS, masked, batch, head,
                     qi * (COMPUTE_WGS * g.bq), idx_row[j] * g.bk, (g.bq, g.bk))

      @pl.when(n >= g.slots)
      def _():
        plgpu.barrier_wait(r.v_free.at[slot])

      plgpu.copy_gmem_to_smem(fp8.v_source(r.v, batch, keys, kv_head, g.fp8), r.v_smem.at[slot],
                              r.v_bar.at[slot])

    return base + count

  each_item(g, item, jnp.int32(0))


@functools.partial(jax.jit, static_argnames=("cfg",))
def forward(q, k, v, ops: common.Operands, plan, cfg: common.KernelConfig, acc=None):
  """See ``kernels.common``: returns ``(o [B, Tp, N, Hv], lse [B, N, Tp] float32)``; v's head
  dim ``Hv`` may be narrower than q's (a multiple of 64: MLA's 128 beside 192). q, k and v of
  one FP8 dtype with their descales (``ops.fp8``) run the FP8 mode (``fp8``).

  ``o`` leaves the kernel in the inputs' 16-bit dtype, bfloat16 for FP8 (staged through the q
  tiles, or its own tile: ``FwdGeometry.o_staging``) and is cast to ``cfg.out_dtype``.
  Given ``acc`` (the ring's running result) the kernel merges into it instead: each consumer
  reads its rows of ``acc`` once it has finished its walk and writes the merged float32 rows
  (measured faster than merging after the kernel, though the read after the walk stalls each
  CTA).
  """
  if cfg.interpret:  # no Mosaic GPU interpreter for this kernel: Triton's emulates the plan walk
    return _triton_forward(q, k, v, ops, plan, cfg, acc)
  why = unsupported(ops_call(q, ops))
  if why is not None:
    raise NotImplementedError(f"backend 'pallas_mosaic_gpu' cannot serve {why}.")
  terms = terms_of(ops, cfg)
  b, tp, n, hp = q.shape
  hv = v.shape[-1]
  check_value_dim(hv, hp)
  fp8_mode = fp8.is_fp8(q.dtype)
  if fp8_mode != (ops.fp8 is not None) or (fp8_mode and not q.dtype == k.dtype == v.dtype):
    raise ValueError(f"the FP8 forward takes q, k and v of one FP8 dtype with their descales "
                     f"(ops.fp8), got {q.dtype}, {k.dtype}, {v.dtype} and descales "
                     f"{None if ops.fp8 is None else ops.fp8.shape}.")
  itemsize = jnp.dtype(q.dtype).itemsize
  o_dtype = jnp.bfloat16 if fp8_mode else q.dtype  # (staged: 16-bit)
  out_itemsize = jnp.dtype(o_dtype).itemsize
  variants = cfg.variants or Variants()
  bq, term_dt = cfg.block_q // COMPUTE_WGS, tile_term_dtype(ops)
  staged = staged_bytes(terms, term_dt, variants, COMPUTE_WGS, bq, cfg.block_kv)
  if fwd_smem(cfg, hp, itemsize, staged, hv, out_itemsize) > SMEM_BYTES:
    staged = 0  # (no room beside two K/V slots: read from global memory)
  terms = dataclasses.replace(terms, staged=staged > 0)
  check_tiles(cfg, hp, itemsize, staged, hv, out_itemsize)
  overlap = overlaps(cfg.block_kv, hv, ops.q_info.segment_ids is not None, variants, fp8_mode)
  g = FwdGeometry(bq=bq, bk=cfg.block_kv,
                  slots=slots(cfg, hp, itemsize, staged, hv, out_itemsize),
                  group=n // k.shape[2], head_dim=hp, value_dim=hv, dtype=q.dtype,
                  out_dtype=o_dtype,
                  info_rows=1 if ops.q_info.segment_ids is None else 2,
                  q_blocks=tp // cfg.block_q, heads=n, batch=b,
                  ctas=persistent_ctas(n * (tp // cfg.block_q) * b, cfg.mask, overlap, variants),
                  merge=acc is not None, overlap=overlap,
                  order=item_order(k.shape[1], variants), terms=terms,
                  regs=variants.regs, step_refs=step_refs(variants, hp))
  smem = functools.partial(swizzled_smem, q.dtype)
  v_tile = (hv, g.bk) if fp8_mode else (g.bk, hv)  # (``fp8.v_source``)
  q_tiles = smem(COMPUTE_WGS, g.bq, hp)
  if g.o_staging == "q_view":  # o staged in the q tiles: their view at Hv columns
    # A RefUnion lays its members out from one address, so consumer w's view [rows, Hv] starts
    # w * rows * Hv elements in; its first bq rows must lie inside its own q tile [bq, H].
    rows = o_view_rows(g.bq, hp, hv)
    assert rows * hv >= g.bq * hp and (rows + g.bq) * hv <= COMPUTE_WGS * g.bq * hp, (hp, hv)
    q_tiles = plgpu.RefUnion(q_tiles, swizzled_smem(o_dtype, COMPUTE_WGS, rows, hv))
  scratch = (q_tiles, smem(g.slots, g.bk, hp), smem(g.slots, *v_tile),
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

  stage = stage_scratch(term_dt, COMPUTE_WGS, (bq, g.bk)) if staged else ()
  o_stage = swizzled_smem(o_dtype, COMPUTE_WGS, g.bq, hv) if g.o_staging == "own" else ()

  def entry(*refs):
    pl.run_scoped(
        lambda *scoped: _fwd_kernel(*refs, (scoped[:7], scoped[7:9], *scoped[9:]), cfg=cfg, g=g),
        *scratch, *barriers, stage, o_stage, collective_axes="wg")

  o, lse = plgpu.kernel(
      entry,
      out_type=(jax.ShapeDtypeStruct((b, tp, n, hv), jnp.float32 if g.merge else o_dtype),
                jax.ShapeDtypeStruct((b, n, tp), jnp.float32)),
      grid=(g.ctas,), grid_names=("cta",), num_threads=COMPUTE_WGS + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )(plan.kv_index, plan.kv_count, plan.kv_full, token_info(ops.q_info), key_info(ops),
    *terms.inputs(ops, cfg), *((ops.fp8,) if fp8_mode else ()), q, k,
    fp8.v_layout(v) if fp8_mode else v,
    *(() if acc is None else (acc.o.astype(jnp.float32), acc.lse.astype(jnp.float32))))
  return o.astype(cfg.out_dtype), lse


def _triton_forward(q, k, v, ops, plan, cfg, acc):
  """Interpret mode: the ``pallas_triton`` forward (imported here: Hopper needs no Triton) on
  the same plan, FP8 inputs dequantized, v (and a merged ``acc``) zero-padded to q's head dim
  and o sliced back; ``cfg.num_stages`` means this kernel's K/V slots, so Triton gets its own
  default."""
  hp, hv = q.shape[-1], v.shape[-1]
  if ops.fp8 is not None:
    q, k, v = common.dequantize(q, k, v, ops.fp8, jnp.bfloat16)
    ops = ops._replace(fp8=None)
  if acc is not None:
    acc = acc._replace(o=common.widen(acc.o, hp))
  o, lse = kernels.get("pallas_triton").forward(
      q, k, common.widen(v, hp), ops, plan, dataclasses.replace(cfg, num_stages=None), acc)
  return o[..., :hv], lse
