"""The dK/dV kernel's consumers: main loops over the walked q/dO tiles and their epilogues.

Head dims up to 128 (``consumer``): each consumer owns 64 keys and computes their p, ds, dK and
dV, alternating its matmuls with the other's (``pipeline.pingpong``); fused, it also adds
``ds^T K`` to dQ (``dkv_fused``). Above ("wide"), a warpgroup's float32 dK and dV of 64 keys
alone would fill its registers (2 x 128 per thread at H=256), so the two consumers share the
CTA's 64 keys and split the work: warpgroup 0 computes ``p^T = exp(K q^T - lse)`` and
``dV += p^T dO`` (``p_and_dv``), warpgroup 1 ``dp^T = V dO^T`` and ``dK += ds^T q`` with
``ds^T = p^T (dp^T - delta)`` (``ds_and_dk``); p^T passes through two shared-memory buffers.
Each warpgroup runs two of the four matmuls, and the wait for p^T offsets warpgroup 1 by half a
step, so one's elementwise work overlaps the other's matmuls."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_ring.kernels.pallas_mosaic_gpu import fp8
from pallas_ring.kernels.pallas_mosaic_gpu.bwd_common import (
    accumulate, finish, grad_logits, probs, products, signed_grad_logits, zeros)
from pallas_ring.kernels.pallas_mosaic_gpu.dkv_fused import (
    add_dq, last_dq, split_dq, stage_ds, write_ds)
from pallas_ring.kernels.pallas_mosaic_gpu.pipeline import (
    COLS, load_ref, meet, pingpong, slot_of)
from pallas_ring.kernels.pallas_mosaic_gpu.terms import kept, kept_delta, open_stage

if TYPE_CHECKING:
  from pallas_ring.kernels.pallas_mosaic_gpu.dkv_kernel import DkvCta, OwnedKeys


def consumer(c: DkvCta) -> None:
  """A consumer of head dims up to 128: its own 64 keys' p, ds, dK and dV."""
  g, cfg, r = c.g, c.cfg, c.r
  plgpu.set_max_registers(g.regs[0], action="increase")
  open_stage(g.terms, r.stage, c.wg)
  own, keys = c.own_keys()
  dk, dv = zeros((g.rows, g.head_dim)), zeros((g.rows, g.value_dim))
  # split dQ: the previous step's (n, h, start); none yet: start -1, and n 1, whose ds^T tiles
  # no one writes in the first step (``dkv_fused.split_dq``)
  last = (jnp.int32(1), jnp.int32(0), jnp.int32(-1)) if g.dq_split else ()
  meet_other = functools.partial(meet, r.sched)
  dk, dv, *last = pingpong(lambda: c.walk(functools.partial(_step, c, keys), dk, dv, *last),
                           meet_other, meet_other)
  if g.dq_split:
    last_dq(c, last)
  finish(r.sched, (r.out_k.at[c.wg], c.out_at(r.dk, own), dk * (cfg.scale * cfg.keep_scale)))
  if g.narrow_v:  # (a narrower dV's staging aliases both consumers' dK staging)
    meet(r.sched)
  dv_scale = cfg.keep_scale
  if g.fp8:  # (dO's descale is its kv head's: the group's first query head's)
    dv_scale = dv_scale * fp8.dv_descale(r.descales, c.batch, c.q_head(0))
  finish(None, (r.out_v.at[c.wg], c.out_at(r.dv, own), dv * dv_scale))


def _step(c: DkvCta, keys: OwnedKeys, h, start, masked, carry):
  """``consumer``'s walked tile of query head rank ``h``, queries from ``start``."""
  g, cfg, r = c.g, c.cfg, c.r
  n, dk, dv, *last = carry
  c = c.at_step(start)
  slot, q_slot = slot_of(n, g.slots), slot_of(n, g.q_slots)
  q, do = r.q_smem.at[q_slot], r.do_smem.at[slot]
  plgpu.barrier_wait(r.q_bar.at[q_slot])
  wait_do = functools.partial(plgpu.barrier_wait, r.do_bar.at[slot])
  if not g.extra_q_slot:  # (else dO is waited for once q.k^T is issued)
    wait_do()
  descale, dp_scale = (fp8.bwd_descales(r.descales, c.batch, c.q_head(h)) if g.fp8 else
                       (None, None))

  def softmax(s):
    terms = c.tile_terms(h, start, q_slot, masked, keys, descale)
    return terms, *probs(s, load_ref(r.lse_smem.at[q_slot], COLS), terms, cfg, row_axis=1,
                         descale=descale)

  # s^T = K q^T, dp^T = V dO^T
  s, dp = products(c.tile, ((c.k_own, q), (c.v_own, do)), functools.partial(meet, r.sched),
                   softmax if g.overlap_softmax else None,
                   ready=(None, wait_do) if g.extra_q_slot else ())
  terms, p, dlogits = s if g.overlap_softmax else softmax(s)
  if g.fp8:
    dp = dp * dp_scale
  keep_mask = terms.keep_mask()
  ds = grad_logits(p, dp, kept_delta(load_ref(r.delta_smem.at[slot], COLS), cfg), dlogits,
                   row_axis=1, keep_mask=keep_mask)
  p = kept(p, keep_mask)
  if g.fp8:  # p^T dO in FP8: p^T scaled into FP8's normal range, relabelled (``fp8``)
    p = fp8.a_operand(fp8.p_tile(p * (2.0 ** fp8.P_LOG2), g.fp8), g.fp8)
    do, q = fp8.v_operand(r.do_t_smem.at[slot], True), r.q16_smem.at[q_slot]
  else:
    p = p.astype(g.dtype)
  p, ds = lax.optimization_barrier((p, ds.astype(g.dtype)))
  if g.dq_split:
    ds_tile = write_ds(c, ds, n)
    if g.ds_from_smem:  # (ds's registers free from here)
      ds = ds_tile
  meet(r.sched)  # the other warpgroup's matmuls are issued
  # dV += p^T dO, dK += ds^T q (and the fused dQ's ds^T K where it fits beside them)
  if g.fused_dq:
    dq_term, add = (split_dq(c, n, h, start, last) if g.dq_split else
                    (lambda: stage_ds(c, ds), lambda dq: add_dq(c, dq, h, start)))
  if g.overlap_dq:  # (ds^T K first: added while dV's and dK's matmuls run)
    _, dv, dk = accumulate((dq_term(), (dv, p, do), (dk, ds, q)), first=add)
  else:
    with_dkv = (dq_term(),) if g.dq_with_dkv else ()
    dv, dk, *dq = accumulate(((dv, p, do), (dk, ds, q), *with_dkv))
  plgpu.barrier_arrive(r.free.at[slot])
  if g.extra_q_slot:
    plgpu.barrier_arrive(r.q_free.at[q_slot])
  if g.fused_dq and not g.overlap_dq:
    add((dq or accumulate((dq_term(),)))[0])
  # (h: a Python 0 where one head is walked; int32 in the carry, also under x64)
  return n + 1, dk, dv, *((n, jnp.asarray(h, jnp.int32), start) if g.dq_split else ())


def p_and_dv(c: DkvCta) -> None:
  """Wide, warpgroup 0: ``p^T = exp(K q^T - lse)`` to warpgroup 1, ``dV += p^T dO``."""
  g, cfg, r = c.g, c.cfg, c.r
  plgpu.set_max_registers(g.regs[0], action="increase")
  open_stage(g.terms, r.stage, c.wg)
  own, keys = c.own_keys(v=False)

  def body(h, start, masked, carry):
    n, dv = carry
    slot, buf = slot_of(n, g.slots), slot_of(n, 2)
    plgpu.barrier_wait(r.q_bar.at[slot])
    (s,) = products(c.tile, ((c.k_own, r.q_smem.at[slot]),))
    terms = c.tile_terms(h, start, slot, masked, keys)
    p, dlogits = probs(s, load_ref(r.lse_smem.at[slot], COLS), terms, cfg, row_axis=1)

    @pl.when(n >= 2)
    def _():
      plgpu.barrier_wait(r.p_free.at[buf])

    # (soft-cap folded; with dropout, dropped terms negated: ``signed_grad_logits``)
    ps = p if dlogits is None else p * dlogits
    keep_mask = terms.keep_mask()
    r.p_smem.at[buf][...] = (ps if keep_mask is None else jnp.where(keep_mask, ps, -ps)
                             ).astype(g.dtype)
    plgpu.barrier_arrive(r.p_full.at[buf])
    plgpu.barrier_wait(r.do_bar.at[slot])
    (dv,) = accumulate(((dv, kept(p, keep_mask).astype(g.dtype), r.do_smem.at[slot]),))
    plgpu.barrier_arrive(r.free.at[slot])
    return n + 1, dv

  (dv,) = c.walk(body, zeros((g.rows, g.value_dim)))
  if g.narrow_v:  # (a narrower dV's staging aliases dK's: once that is written)
    meet(r.sched)
  finish(r.sched, (r.out_v.at[c.wg], c.out_at(r.dv, own), dv * cfg.keep_scale))


def ds_and_dk(c: DkvCta) -> None:
  """Wide, warpgroup 1: ``dp^T = V dO^T``; ``ds^T`` from warpgroup 0's ``p^T``;
  ``dK += ds^T q``."""
  g, cfg, r = c.g, c.cfg, c.r
  plgpu.set_max_registers(g.regs[0], action="increase")
  own, _ = c.own_keys(k=False)

  def body(h, start, masked, carry):
    n, dk = carry
    slot, buf = slot_of(n, g.slots), slot_of(n, 2)
    plgpu.barrier_wait(r.do_bar.at[slot])
    (dp,) = products(c.tile, ((c.v_own, r.do_smem.at[slot]),))
    plgpu.barrier_wait(r.p_full.at[buf])
    p = load_ref(r.p_smem.at[buf], plgpu.Layout.WGMMA).astype(jnp.float32)  # (soft-cap folded)
    plgpu.barrier_arrive(r.p_free.at[buf])
    delta = kept_delta(load_ref(r.delta_smem.at[slot], COLS), cfg)
    ds = (signed_grad_logits(p, dp, delta) if g.terms.dropout else
          grad_logits(p, dp, delta, None, row_axis=1))
    plgpu.barrier_wait(r.q_bar.at[slot])
    (dk,) = accumulate(((dk, ds.astype(g.dtype), r.q_smem.at[slot]),))
    plgpu.barrier_arrive(r.free.at[slot])
    return n + 1, dk

  (dk,) = c.walk(body, zeros((g.rows, g.head_dim)))
  finish(r.sched, (r.out_k.at[c.wg], c.out_at(r.dk, own), dk * (cfg.scale * cfg.keep_scale)))
  if g.narrow_v:  # dK is written: warpgroup 0 may stage dV (``p_and_dv``)
    meet(r.sched)
