"""The Mosaic GPU backward, host side: which kernels run, their geometry and their launch.

The reproducible backward is two kernels, each warp-specialized like the forward (a producer
warpgroup streams tiles by TMA into ``slots`` shared-memory slots, consumer warpgroups own 64
rows each), and neither accumulates across CTAs, so results are bitwise reproducible:

* ``dq_kernel`` runs first: a CTA owns 128 query rows of one head and walks K/V; given delta as
  a ``common.RowTerm`` it computes delta and hands it to dK/dV;
* ``dkv_kernel``: a CTA owns 128 keys of one kv head and walks q, dO, lse and delta of each
  query head of its group. Its consumers alternate their matmuls like the forward's (the dQ
  kernel's do not: that measured slower; BENCHMARKS.md, "Kernel rules").

Above head dim 128 ("wide"), a warpgroup's float32 dK and dV of 64 keys alone would fill its
registers, so the dK/dV kernel owns 64 rows per CTA, which its two consumers share, splitting
the work (``dkv_mainloop``); above 192 the dQ kernel too, with one consumer (two sets of q, dO
and K/V slots do not fit in shared memory). At head dims <= 128 one fused kernel runs instead
by default (``tiles.fused_backward`` says where; ``dkv_fused``): the dK/dV kernel also adds to
dQ, in no fixed order. Measured in BENCHMARKS.md.

v, dO and dV may be narrower than q and k (``Hv``, MLA): those tiles and matmuls are ``Hv``
wide.

FP8 q, k, v (``tiles.fp8_backward``): both kernels run q.k^T and dO.v^T as FP8 wgmmas and the
dK/dV kernel p^T dO too, on dO quantized here (``fp8.backward_operands``); their owned and
walked FP8 tiles take half the bytes, beside 16-bit tiles of the walked q (dK/dV) or K (dQ)
for ds's products.

In every kernel the output staging tiles share memory with the walked slots (plgpu.RefUnion):
the consumers meet once both are done with the slots, then write (a narrower dV's staging also
aliases dK's: they meet again between the two). This leaves room for longer
walked tiles (dQ at H=128: 128 keys, wgmmas of N = 128) or more slots. Shared pieces (geometry,
the walk, tile arithmetic, the epilogue) are ``bwd_common``'s.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_ring import kernels
from pallas_ring.kernels import common
from pallas_ring.kernels.pallas_mosaic_gpu import fp8
from pallas_ring.kernels.pallas_mosaic_gpu.bwd_common import BwdGeometry, owned_tiles
from pallas_ring.kernels.pallas_mosaic_gpu.dkv_fused import fused_call
from pallas_ring.kernels.pallas_mosaic_gpu.dkv_kernel import dkv_kernel
from pallas_ring.kernels.pallas_mosaic_gpu.dq_kernel import dq_kernel
from pallas_ring.kernels.pallas_mosaic_gpu.pipeline import swizzled_smem, token_info
from pallas_ring.kernels.pallas_mosaic_gpu.terms import (
    Terms, key_info, ops_call, stage_scratch, staged_bytes, terms_of, tile_term_dtype)
from pallas_ring.kernels.pallas_mosaic_gpu.tiles import (
    BWD_ROWS, COMPUTE_WGS, SMEM_BYTES, Variants, backward_unsupported, check_value_dim,
    dkv_head_splits, dq_split, dq_with_dkv, extra_q_slot, fp8_backward, fused_backward,
    overlap_dq, overlap_softmax, step_refs, unsupported)


class _Call(NamedTuple):
  """Static context of one backward call."""

  heads: int  # N
  kv_heads: int  # K
  head_dim: int  # H: q's and k's, padded
  value_dim: int  # Hv: v's and dO's, padded (at most H)
  dtype: Any  # the inputs' 16-bit dtype
  out_dtype: Any  # ``cfg.out_dtype``
  info_rows: int  # token-info rows: 1 (positions) or 2 (and segment ids)
  terms: Terms
  term_dtype: Any  # the tile term's (``terms.tile_term_dtype``)
  variants: Variants
  fp8: Any = None  # FP8 mode: q's, k's, v's (and the quantized dO's) FP8 dtype; else None

  @property
  def drop(self) -> int:
    """1 with dropout (its row and column keys), else 0."""
    return int(self.terms.dropout)


def _geometry(c: _Call, dkv: bool, seq, heads, walk=None, staged=None, fused=False,
              stage=True) -> BwdGeometry:
  """The dK/dV (``dkv``) or dQ kernel's tiles walked ``walk`` rows at a time (default
  ``variants.dkv_walk_rows`` / ``dq_walk_rows``) in as many slots as fit beside its owned tiles
  (the output staging tiles, of dtype ``staged``, default ``c.out_dtype``, alias the slots)
  and, where ``stage`` and room allow, a staged tile term's windows (one per owner); ``fused``:
  the fused dK/dV kernel's."""
  hp, hv, dt, rows, variants = c.head_dim, c.value_dim, c.dtype, BWD_ROWS, c.variants
  staged = c.out_dtype if staged is None else staged
  it = 1 if c.fp8 else dt.itemsize  # owned tiles and walked q/k, v/dO tiles
  pair_bytes = rows * (hp + hv) * it  # an owned [64, H] tile and its [64, Hv] one
  wide = hp > (variants.wide_dkv_above if dkv else variants.wide_dq_above)
  owners = owned_tiles(wide)
  if walk is None:  # (dQ above 128: 64-key tiles, its float32 dQ takes 96+ registers)
    walk = (dict(variants.dkv_walk_rows).get(hp, rows) if dkv else
            rows if hp > 128 else variants.dq_walk_rows)
  # Owned: dK/dV: K and V of 64 keys (and their token info) per owner (wide: and two p^T
  # buffers); dQ: q, dO, lse, delta and token info of 64 rows per owner.
  # Dropout: the keys' column keys (an extra token-info row) and the queries' row keys.
  owned = owners * (pair_bytes + 4 * rows * (c.info_rows if dkv else 2 + c.info_rows) +
                    4 * rows * c.drop)
  # Fused: ds^T and the dQ staging tiles (float32) of each owner; split: two ds^T tiles each
  # (by step parity), staging of half the columns.
  split = fused and dq_split(variants, hp)
  owned += 2 * rows * walk * dt.itemsize if dkv and wide else 0
  if fused:
    owned += owners * walk * ((1 + split) * rows * dt.itemsize + 4 * hp // (1 + split))
  term_bytes = (staged_bytes(c.terms, c.term_dtype, variants, owners, rows, walk)
                if stage else 0)
  owned += term_bytes
  # one [64, H] tile per owner (dK/dV: per consumer; dV's [64, Hv] ones alias them)
  staging = (2 if dkv else owners) * rows * hp * jnp.dtype(staged).itemsize
  per_slot = walk * ((hp + hv) * it + 4 * (2 + c.info_rows + c.drop))
  if c.fp8:  # 16-bit q (dK/dV) or K (dQ) for ds's product; dK/dV: dO^T for p^T dO
    per_slot += walk * (hp * dt.itemsize + (hv if dkv else 0))
  room = SMEM_BYTES - owned
  n_slots = min(4, room // per_slot)
  if n_slots < 2 and walk > rows:  # shorter walked tiles
    return _geometry(c, dkv, seq, heads, rows, staged, fused, stage)
  if n_slots < 2 and term_bytes:  # the tile term from global memory
    return _geometry(c, dkv, seq, heads, walk, staged, fused, False)
  assert n_slots >= 2 and staging <= room, (hp, c.out_dtype)  # (holds for every served head dim)
  # the fused kernel's q-side tiles (q, lse, token info) in one slot more, where it fits
  q_side = walk * (hp * it + 4 * (1 + c.info_rows))
  extra_q = (fused and extra_q_slot(variants, hp) and not c.fp8 and not c.drop and n_slots < 4 and
             room - n_slots * per_slot >= q_side)
  return BwdGeometry(slots=n_slots, group=c.heads // c.kv_heads, head_dim=hp, value_dim=hv,
                     dtype=dt, info_rows=c.info_rows, blocks=seq // (owners * rows),
                     walked_heads=heads, walk=walk, wide=wide,
                     terms=dataclasses.replace(c.terms, staged=term_bytes > 0), fused_dq=fused,
                     dq_with_dkv=fused and dq_with_dkv(variants, hp), dq_split=split,
                     fp8=c.fp8, step_refs=step_refs(variants, hp, fused),
                     overlap_softmax=overlap_softmax(variants, wide or not dkv, c.terms.dropout),
                     overlap_dq=fused and overlap_dq(variants, hp),
                     ds_from_smem=split and variants.ds_from_smem, extra_q_slot=extra_q,
                     regs=(variants.lone_consumer_regs, variants.producer_regs)
                     if owners == 1 and not dkv else variants.regs)


def _infos(c: _Call, ops: common.Operands, cfg, dkv: bool) -> tuple:
  """Token info and the score terms' inputs (the dK/dV kernel's tile term transposed)."""
  return (token_info(ops.q_info), key_info(ops), *c.terms.inputs(ops, cfg, dkv))


def _barriers(count: int, num: int):
  """``num`` barriers (one per owned tile or per slot) of ``count`` arrivals each."""
  return plgpu.Barrier(num_arrivals=count, num_barriers=num)


def _stage_of(c: _Call, g: BwdGeometry):
  """A staged tile term's windows: one [64, walk] tile per owner (``terms.TermStage``)."""
  return stage_scratch(c.term_dtype, g.owners, (BWD_ROWS, g.walk)) if g.terms.staged else ()


def _bwd_call(kernel, consumers: int, scratch, out_shapes, grid, grid_names, args, *, cfg, g):
  """Runs a backward kernel: ``consumers`` warpgroups and the producer over ``grid``, with
  ``scratch = (owned, walked, out staging tiles, barriers)`` (each staging tile aliases the
  walked slots and the others)."""
  owned, walked, out, bars = scratch
  shared = plgpu.RefUnion(walked, *out)

  def entry(*refs):
    pl.run_scoped(lambda own, sh, b: kernel(*refs, own, *sh, b, cfg=cfg, g=g),
                  owned, shared, bars, collective_axes="wg")

  params = plgpu.CompilerParams(approx_math=True)
  if not g.fused_dq:
    return plgpu.kernel(entry, out_type=out_shapes, grid=grid, grid_names=grid_names,
                        num_threads=consumers + 1, thread_name="wg", compiler_params=params)(*args)
  mesh = plgpu.Mesh(grid=grid, grid_names=grid_names, num_threads=consumers + 1,
                    thread_name="wg")
  return fused_call(entry, out_shapes, mesh, params, args)


def _dq_pass(c: _Call, q, k, v, do, lse2, delta, ops, plan, cfg, dq_acc, f8=None):
  """The dQ kernel: ``(dq, delta)``. Its owned tiles are q, dO, lse, delta (and token info), the
  walked ones K/V (FP8 mode: and the 16-bit K of ``f8``, ``fp8.BwdOperands``). Given a RowTerm
  it computes delta from o and returns it for the dK/dV kernel (``Variants.delta_in_dq``)."""
  b, tp, n, hp = q.shape
  hv, rows, f32, i32, out_dt = c.value_dim, BWD_ROWS, jnp.float32, jnp.int32, c.out_dtype
  smem = functools.partial(swizzled_smem, c.fp8 or c.dtype)
  from_o = isinstance(delta, common.RowTerm)
  row_in = delta.dlse if from_o else delta  # the owned row input: delta, dlse or None
  row_in = () if row_in is None else (row_in.astype(f32),)
  g = dataclasses.replace(_geometry(c, False, tp, 1), delta_from_o=from_o,
                          add_dq=dq_acc is not None)
  sl, w, owners = g.slots, g.walk, g.owners
  out = _bwd_call(
      dq_kernel, owners,
      ((smem(owners, rows, hp), smem(owners, rows, hv), plgpu.SMEM((owners, rows), f32),
        plgpu.SMEM((owners, rows), f32), plgpu.SMEM((owners, c.info_rows, rows), i32),
        plgpu.SMEM((owners, rows if c.drop else 8), i32), _stage_of(c, g)),  # (row keys)
       (smem(sl, w, hp), smem(sl, w, hv), plgpu.SMEM((sl, g.key_rows, w), i32),
        *([swizzled_smem(c.dtype, sl, w, hp)] if c.fp8 else [])),
       (swizzled_smem(out_dt, owners, rows, hp),),
       (_barriers(4 + len(row_in) + c.drop, owners), _barriers(2, sl),
        _barriers(1 + bool(c.fp8), sl),
        _barriers(owners, sl), _barriers(owners, 1) if owners > 1 else None)),
      (jax.ShapeDtypeStruct(q.shape, out_dt), *([jax.ShapeDtypeStruct((b, n, tp), f32)]
                                                if from_o else [])),
      (n, g.blocks, b), ("heads", "q_seq", "batch"),
      (plan.kv_index, plan.kv_count, plan.kv_full, *_infos(c, ops, cfg, False),
       *((f8.descales, f8.k) if c.fp8 else ()), q, k, v, do,
       lse2, *([delta.o] if from_o else []), *row_in,
       *([] if dq_acc is None else [dq_acc.astype(out_dt)])), cfg=cfg, g=g)
  return out if from_o else (out[0], *row_in)


def _dkv_pass(c: _Call, q, k, v, do, lse2, delta, ops, plan, cfg, dq_acc, fused, f8=None):
  """The dK/dV kernel (``fused``: adding to dQ too): ``(dq or None, dk, dv)``. Its owned tiles
  are K/V, the walked ones q, dO, lse, delta (and q token info; FP8 mode: the 16-bit q and dO^T
  of ``f8``, ``fp8.BwdOperands``)."""
  b, _, _, hp = q.shape
  sp, kh, hv = k.shape[1], k.shape[2], c.value_dim
  rows, f32, i32, out_dt = BWD_ROWS, jnp.float32, jnp.int32, c.out_dtype
  smem = functools.partial(swizzled_smem, c.fp8 or c.dtype)
  group = c.heads // kh
  g = _geometry(c, True, sp, group, fused=fused)
  splits = dkv_head_splits(group, kh * g.blocks * b, c.variants)
  if splits > 1:  # float32 partials
    out_dt = jnp.dtype(f32)
    g = dataclasses.replace(_geometry(c, True, sp, group // splits, staged=f32, fused=fused),
                            splits=splits)
  sl, qs, w, two, wide = g.slots, g.q_slots, g.walk, COMPUTE_WGS, g.wide
  own = () if wide else (two,)  # owned K/V tiles: one pair (wide) or one per consumer
  dq_smem, dq_in = None, ()
  if fused:  # ds^T and dQ staging tiles per consumer (split: two ds^T, by step parity, and
    # half-width staging; ``dkv_fused``); dQ's start
    dq_smem = ((smem(2, two, rows, w), swizzled_smem(f32, two, w, hp // two)) if g.dq_split else
               (smem(two, rows, w), swizzled_smem(f32, two, w, hp)))
    dq_in = (jnp.zeros(q.shape, f32) if dq_acc is None else dq_acc.astype(f32),)
  dkv_shape = lambda h: jax.ShapeDtypeStruct((splits,) * (splits > 1) + (b, sp, kh, h), out_dt)
  # dK/dV staging: a tile per consumer, and for a narrower dV others aliasing them
  staging = tuple(swizzled_smem(out_dt, two, rows, h) for h in ((hp, hv) if hv != hp else (hp,)))
  *dq_out, dk, dv = _bwd_call(
      dkv_kernel, two,
      ((smem(*own, rows, hp), smem(*own, rows, hv), plgpu.SMEM((*own, g.key_rows, rows), i32),
        smem(2, rows, w) if wide else None, dq_smem, _stage_of(c, g)),
       (smem(qs, w, hp), smem(sl, w, hv), plgpu.SMEM((qs, w), f32), plgpu.SMEM((sl, w), f32),
        plgpu.SMEM((qs, c.info_rows, w), i32), plgpu.SMEM((qs, w if c.drop else 8), i32),
        *((swizzled_smem(c.dtype, qs, w, hp), smem(sl, hv, w)) if c.fp8 else ())),
       staging,
       (_barriers(3, two), _barriers(3 + c.drop + bool(c.fp8), qs), _barriers(2 + bool(c.fp8), sl),
        _barriers(two, sl),
        _barriers(two, 1), _barriers(1, 2) if wide else None,
        _barriers(1, 2) if wide else None,
        _barriers(two, qs) if g.extra_q_slot else None)),
      (dkv_shape(hp), dkv_shape(hv)), (kh * splits, g.blocks, b), ("heads", "kv_seq", "batch"),
      (plan.q_index, plan.q_count, plan.q_full, *_infos(c, ops, cfg, True),
       *((f8.descales, f8.q, f8.do_t) if c.fp8 else ()), q, k, v, do, lse2, delta, *dq_in),
      cfg=cfg, g=g)
  if splits > 1:  # the partials in a fixed order (bitwise reproducible)
    total = lambda x: functools.reduce(jnp.add, [x[i] for i in range(splits)])
    dk, dv = (total(x).astype(cfg.out_dtype) for x in (dk, dv))
  return (dq_out[0] if fused else None), dk, dv


def _triton_backward(q, k, v, do, lse, delta, ops, plan, cfg, dq_acc, parts, dkv_acc):
  """The ``pallas_triton`` backward (imported here: Hopper needs no Triton) at Triton's head
  dim (a power of two: H=192 runs at 256; a narrower v and dO are padded to it too), the zero
  columns sliced off the gradients; ``cfg.num_stages`` means the forward's K/V slots here, so
  Triton gets its own default."""
  triton = kernels.get("pallas_triton")
  hp, hv = q.shape[-1], v.shape[-1]
  wide = triton.padded_head_dim(hp)
  delta = common.delta_array(delta, do)  # (over the output's columns)
  pad = functools.partial(common.widen, width=wide)
  dq, dk, dv = triton.backward(*map(pad, (q, k, v, do)), lse, delta, ops, plan,
                               dataclasses.replace(cfg, num_stages=None), pad(dq_acc), parts)
  cut = lambda x, h: None if x is None else x[..., :h]
  return common.accumulated(None, (cut(dq, hp), cut(dk, hp), cut(dv, hv)), dkv_acc)


@functools.partial(jax.jit, static_argnames=("cfg", "parts"))
def backward(q, k, v, do, lse, delta, ops: common.Operands, plan, cfg: common.KernelConfig,
             dq_acc=None, parts=common.BOTH, dkv_acc=None):
  """See ``kernels.common``: returns ``(dq, dk, dv)`` in ``cfg.out_dtype``; v (dO, dv) may be
  narrower than q, as in ``forward``. The dQ kernel adds ``dq_acc``, the ring's running dq, to
  its rows before writing them, and the fused kernel starts dQ from it; ``dkv_acc`` is added
  after the dK/dV kernel.

  Backward tiles other than 128 x 128 (``backward_unsupported``) and interpret mode run the
  ``pallas_triton`` backward on the same plan instead (``_triton_backward``).

  FP8 q, k, v (with ``ops.fp8``) run the FP8 mode where it serves (``tiles.fp8_backward``), else
  are dequantized first; the gradients are those of the dequantized values.
  """
  b, tp, n, hp = q.shape
  variants = cfg.variants or Variants()
  f8 = None
  if ops.fp8 is not None and fp8_backward(cfg, hp, variants):
    f8 = fp8.backward_operands(q, k, v, do, ops.fp8, jnp.bfloat16)
    delta = common.delta_array(delta, f8.do_wide)  # (of the quantized dO, as dp is)
  elif ops.fp8 is not None:
    q, k, v = common.dequantize(q, k, v, ops.fp8, jnp.bfloat16)
    ops = ops._replace(fp8=None)
  if cfg.interpret or backward_unsupported(cfg, hp) is not None:
    return _triton_backward(q, k, v, do, lse, delta, ops, plan, cfg, dq_acc, parts, dkv_acc)
  want_dq, want_dkv = common.wants(parts)
  check_value_dim(v.shape[-1], hp)
  why = unsupported(ops_call(q, ops))
  if why is not None:
    raise NotImplementedError(f"backend 'pallas_mosaic_gpu' cannot serve {why}.")
  c = _Call(heads=n, kv_heads=k.shape[2], head_dim=hp, value_dim=v.shape[-1],
            dtype=q.dtype if f8 is None else jnp.dtype(jnp.bfloat16),
            out_dtype=jnp.dtype(cfg.out_dtype),
            info_rows=1 if ops.q_info.segment_ids is None else 2, terms=terms_of(ops, cfg),
            term_dtype=tile_term_dtype(ops), variants=variants,
            fp8=None if f8 is None else q.dtype)
  lse2 = common.safe_lse(lse) * common.LOG2E  # base 2; empty rows: +inf, so p = 0
  # dQ first (``_dq_pass``). Fused (``tiles.fused_backward``): no dQ kernel; the dK/dV kernel
  # adds to dQ.
  segments = ops.q_info.segment_ids is not None
  fused = (want_dq and want_dkv and f8 is None and
           fused_backward(variants, hp, cfg.kv_len, segments=segments))
  if not variants.delta_in_dq or not want_dq or fused:
    delta = common.delta_array(delta, do)
  dq, do = None, do if f8 is None else f8.do
  if want_dq and not fused:
    dq, delta = _dq_pass(c, q, k, v, do, lse2, delta, ops, plan, cfg, dq_acc, f8)
  if not want_dkv:
    return dq, None, None
  dq_fused, dk, dv = _dkv_pass(c, q, k, v, do, lse2, delta, ops, plan, cfg, dq_acc, fused, f8)
  if fused:
    dq = dq_fused.astype(cfg.out_dtype)
  return common.accumulated(None, (dq, dk, dv), dkv_acc)
