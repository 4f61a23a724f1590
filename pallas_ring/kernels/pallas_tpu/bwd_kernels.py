"""The backward kernels: dQ, and dK/dV per kv head block, of one (q shard, kv shard) pair."""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_ring import block_sparse
from pallas_ring.kernels import common
from pallas_ring.kernels.pallas_tpu import tiles
from pallas_ring.kernels.pallas_tpu.fwd_kernel import _capped_logits, _f32, _live_tile_loop, \
    _q_row_specs, _widened
from pallas_ring.kernels.pallas_tpu.info import _Info, _info_arrays, _info_specs, _tile
from pallas_ring.kernels.pallas_tpu.tiles import _Lists, _Pass, _body_bytes, _chained_call, \
    _key_chunks, _row_ranges, _staging
from pallas_ring.kernels.pallas_tpu.views import _NT, _TN, _Heads, _RowStats

def _probs(cfg, info, h, q, k, lse, k0, keys, masked):
  """Recomputed probabilities ``p [bq, bk]``, capped logits ``s`` and dropout keep of head
  ``h``'s tile (``keys`` of its key block, from key ``k0`` of the shard: ``_tile``)."""
  s_cap = _capped_logits(cfg, q, k)
  s, keep = _tile(cfg, info, h, s_cap, k0, keys, masked)
  return jnp.exp(s - common.safe_lse(lse)), s_cap, keep  # (masked: exp(NEG_INF - lse) = 0)


def _dq_kernel(idx_ref, cls_ref, cnt_ref, *refs, cfg, lists, heads, n_aliased, stats,
               accumulate=False):
  info = _Info(*refs[:9])
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[9:15]
  acc_ref = refs[15] if accumulate else None  # the running dq (aliased to dq)
  dq_ref, dq_sc, q_sc, do_sc, k_sc, v_sc = refs[15 + n_aliased:]
  b, j, i, s_ = (pl.program_id(a) for a in range(4))
  rank = heads.rank(j)

  @pl.when(s_ == 0)
  def _init():
    dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

  slot = lists.slot(b, j, i, s_)
  klass = _Lists.at(cls_ref, slot)
  k_block = _Lists.at(idx_ref, slot)

  def compute(masked, h):
    c = heads.kv_head(rank, h)
    q, do = (heads.q.staged(x, h, sc)() for x, sc in ((q_ref, q_sc), (do_ref, do_sc)))
    k_at, v_at = heads.kv.staged(k_ref, c, k_sc), heads.kv.staged(v_ref, c, v_sc)

    def chunk(keys, offset):
      k = k_at(keys)
      p, s, keep = _probs(cfg, info, h, q, k, stats.load(lse_ref, h),
                          k_block * cfg.block_kv_bwd + offset, keys, masked)
      dp = jax.lax.dot_general(do, v_at(keys), _NT, preferred_element_type=jnp.float32)
      ds = (p * (common.dropped(dp, keep, cfg) - stats.load(delta_ref, h))
            * common.softcap_grad(s, cfg))
      dq_sc[h] += jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)

    _key_chunks(cfg, cfg.block_kv_bwd, chunk)

  _live_tile_loop(klass, heads.hb, compute)

  @pl.when(s_ == lists.slots - 1)
  def _finish():
    heads.q.put_all(dq_ref, dq_sc, cfg.scale, add=acc_ref)


def _dkv_kernel(idx_ref, cls_ref, cnt_ref, *refs, cfg, lists, heads, n_aliased, stats,
                accumulate=False):
  info = _Info(*refs[:9])
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[9:15]
  dk_acc, dv_acc = refs[15:17] if accumulate else (None, None)  # aliased to dk, dv
  dk_ref, dv_ref, dk_sc, dv_sc, q_sc, do_sc, k_sc, v_sc = refs[15 + n_aliased:]
  b, kvb, jk, step = (pl.program_id(a) for a in range(4))

  @pl.when(step == 0)
  def _init():
    dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
    dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

  rank, i = _dkv_step(step, lists.slots)
  slot = lists.slot(b, heads.head_block(kvb, rank), jk, i)
  klass = _Lists.at(cls_ref, slot)

  def compute(masked, h):
    c = heads.kv_head(rank, h)
    q, do = (heads.q.staged(x, h, sc)() for x, sc in ((q_ref, q_sc), (do_ref, do_sc)))
    k_at, v_at = heads.kv.staged(k_ref, c, k_sc), heads.kv.staged(v_ref, c, v_sc)

    def chunk(keys, offset):
      p, s, keep = _probs(cfg, info, h, q, k_at(keys), stats.load(lse_ref, h),
                          (lists.r0 + jk) * cfg.block_kv_bwd + offset, keys, masked)
      dv_sc[c, keys, :] += jax.lax.dot_general(common.dropped(p, keep, cfg).astype(do.dtype), do,
                                               _TN, preferred_element_type=jnp.float32)
      dp = jax.lax.dot_general(do, v_at(keys), _NT, preferred_element_type=jnp.float32)
      ds = (p * (common.dropped(dp, keep, cfg) - stats.load(delta_ref, h))
            * common.softcap_grad(s, cfg))
      dk_sc[c, keys, :] += jax.lax.dot_general(ds.astype(q.dtype), q, _TN,
                                               preferred_element_type=jnp.float32)

    _key_chunks(cfg, cfg.block_kv_bwd, chunk)

  _live_tile_loop(klass, heads.hb, compute)

  @pl.when(step == heads.per_kv * lists.slots - 1)
  def _finish():
    heads.kv.put_all(dk_ref, dk_sc, cfg.scale, add=dk_acc)
    heads.kv.put_all(dv_ref, dv_sc, add=dv_acc)


def _dkv_step(step, slots: int):
  """dK/dV reduction step -> (rank of the query head block in its kv block, slot): the kv
  block's query head blocks one after another."""
  c = jnp.asarray(slots, step.dtype)
  return lax.div(step, c), lax.rem(step, c)


@functools.partial(jax.jit, static_argnames=("cfg", "parts"))
def backward(q, k, v, do, lse, delta, ops: common.Operands, plan, cfg: common.KernelConfig,
             dq_acc=None, parts=common.BOTH, dkv_acc=None):
  """See ``kernels.common``: returns ``(dq, dk, dv)`` in ``cfg.out_dtype``. Accumulators of
  that dtype are added inside the kernels, whose outputs take their buffers (aliased)."""
  if _widened(q, cfg):
    wide = (x.astype(jnp.float32) for x in (q, k, v, do))
    grads = backward(*wide, lse, delta, ops, plan, _f32(cfg), dq_acc, parts, dkv_acc)
    narrow = lambda x, dt: None if x is None else x.astype(dt)
    return (narrow(grads[0], cfg.out_dtype if dq_acc is None else dq_acc.dtype),
            *(narrow(x, cfg.out_dtype) for x in grads[1:]))
  want_dq, want_dkv = common.wants(parts)
  delta = common.delta_array(delta, do)
  heads = _Heads.of(q, k, cfg.interpret)
  plan = block_sparse.merge_heads(plan, heads.hb)
  info = _info_arrays(ops)
  arrays = [heads.q.array(q), heads.kv.array(k), heads.kv.array(v), heads.q.array(do)]
  # Accumulators of the output dtype are added in the kernels (the rest after them).
  in_kernel = lambda a: (a is not None
                         and all(x.dtype == cfg.out_dtype for x in jax.tree.leaves(a)))
  dq_in, dkv_in = (a if in_kernel(a) else None for a in (dq_acc, dkv_acc))
  shapes = _BwdShapes(q.shape, k.shape, heads, info, arrays, (lse, delta), cfg)
  fit = lambda make, which: tiles._fit(make, plan, cfg.block_q_bwd, cfg.block_kv_bwd, cfg, q, which)
  dq = dk = dv = None
  if want_dq:
    dq, = _chained_call(*fit(functools.partial(
        _dq_pass, shapes, None if dq_in is None else [heads.q.array(dq_in)]), "dq"))
    dq = heads.q.unview(dq)
  if want_dkv:
    dk, dv = _chained_call(*fit(functools.partial(
        _dkv_pass, shapes, None if dkv_in is None else [heads.kv.array(x) for x in dkv_in]),
        "dk/dv"))
    dk, dv = heads.kv.unview(dk), heads.kv.unview(dv)
  return common.accumulated(None if dq_in is not None else dq_acc, (dq, dk, dv),
                            None if dkv_in is not None else dkv_acc)


class _BwdShapes(NamedTuple):
  """What the backward passes share (static shapes and the arrays every pass reads)."""

  q_shape: tuple  # [B, Tp, N, H]
  k_shape: tuple  # [B, Sp, K, H]
  heads: "_Heads"
  info: "_Info"  # token info and the optional operands (``info``)
  arrays: list  # q, k, v, do as the kernels take them (``_View.array``)
  rows: tuple  # lse, delta [B, N, Tp] float32
  cfg: common.KernelConfig

  def config(self, bq, bk):
    return dataclasses.replace(self.cfg, block_q_bwd=bq, block_kv_bwd=bk)

  def args(self, stats):
    return [*self.info, *self.arrays, *(stats.to_kernel(x) for x in self.rows)]

  def staging(self, bq, bk):
    return _staging(self.arrays[0].dtype, self.q_shape[3], bq, bq, bk, bk)


def _dq_pass(sh: _BwdShapes, acc, plan, bq: int, bk: int) -> _Pass:
  """dQ: rows are q blocks, slots walk the live kv blocks."""
  b, tp, n, h = sh.q_shape
  heads, stats = sh.heads, _RowStats(bq, sh.heads.hb)

  def grid_spec(r0, r1):
    lists, info_specs, q_spec, kv_spec, row_spec = _q_row_specs(plan, r0, r1, sh.info, stats,
                                                                heads, bq, bk)
    return pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3, grid=(b, n // heads.hb, lists.rows, lists.slots),
        in_specs=info_specs + [q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec],
        out_specs=[q_spec], scratch_shapes=[pltpu.VMEM((heads.hb, bq, h), jnp.float32),
                                            *sh.staging(bq, bk)]), lists

  return _Pass(functools.partial(_dq_kernel, cfg=sh.config(bq, bk), heads=heads, stats=stats),
               _row_ranges(plan.kv_index), grid_spec,
               [jax.ShapeDtypeStruct(heads.q.shape(b, tp, n), sh.cfg.out_dtype)],
               sh.args(stats), "pallas_ring_dq", _body_bytes(sh.cfg, "dq", bq, bk), acc)


def _dkv_pass(sh: _BwdShapes, acc, plan, bq: int, bk: int) -> _Pass:
  """dK/dV: one program per (kv head block, kv block); its reduction axis walks the live q
  blocks of each query head block of the group in turn, so dK/dV accumulate per kv head in
  VMEM."""
  b, sp, kh, h = sh.k_shape
  heads, stats = sh.heads, _RowStats(bq, sh.heads.hb)

  def grid_spec(r0, r1):
    lists = _Lists(plan.q_index, plan.q_class, plan.q_count, r0, r1)
    head_block = lambda b_, kvb, jk, st, *r: heads.head_block(kvb, _dkv_step(st, lists.slots)[0])

    def q_at(b_, kvb, jk, st, idx, *r):
      i = _dkv_step(st, lists.slots)[1]
      return _Lists.at(idx, lists.slot(b_, head_block(b_, kvb, jk, st), jk, i))

    q_spec = heads.q.spec(bq, lambda b_, kvb, jk, st, idx, *r: (
        b_, q_at(b_, kvb, jk, st, idx), head_block(b_, kvb, jk, st)))
    row_spec = stats.spec(lambda b_, kvb, jk, st, idx, *r: (
        b_, head_block(b_, kvb, jk, st), q_at(b_, kvb, jk, st, idx)))
    kv_spec = heads.kv.spec(bk, lambda b_, kvb, jk, st, *r: (b_, r0 + jk, kvb))
    k_at = lambda b_, kvb, jk, st, *r: r0 + jk
    return pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3, grid=(b, kh // heads.hk, lists.rows, heads.per_kv * lists.slots),
        in_specs=_info_specs(sh.info, bq, bk, heads.hb, q_at, k_at, head_block)
        + [q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec],
        out_specs=[kv_spec, kv_spec],
        scratch_shapes=[pltpu.VMEM((heads.hk, bk, h), jnp.float32)] * 2
        + sh.staging(bq, bk)), lists

  dkv_shape = jax.ShapeDtypeStruct(heads.kv.shape(b, sp, kh), sh.cfg.out_dtype)
  return _Pass(functools.partial(_dkv_kernel, cfg=sh.config(bq, bk), heads=heads, stats=stats),
               _row_ranges(plan.q_index), grid_spec, [dkv_shape, dkv_shape], sh.args(stats),
               "pallas_ring_dkv", _body_bytes(sh.cfg, "dkv", bq, bk), acc)
