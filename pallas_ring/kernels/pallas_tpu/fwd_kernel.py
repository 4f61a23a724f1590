"""The forward kernel: ``(o, lse)`` of one (q shard, kv shard) pair."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_ring import block_sparse
from pallas_ring.kernels import common
from pallas_ring.kernels.pallas_tpu import tiles
from pallas_ring.kernels.pallas_tpu.info import _Info, _info_arrays, _info_specs, _tile
from pallas_ring.kernels.pallas_tpu.tiles import _Lists, _Pass, _body_bytes, _chained_call, \
    _key_chunks, _row_ranges, _staging
from pallas_ring.kernels.pallas_tpu.views import LANES, _NT, _Heads, _RowStats, _head_loop, \
    _plain

def _fwd_kernel(idx_ref, cls_ref, cnt_ref, *refs, cfg, lists, heads, n_aliased, stats):
  info = _Info(*refs[:9])
  q_ref, k_ref, v_ref = refs[9:12]
  # (aliased outputs: unread); scratch: row statistics, output rows, the staged q, K, V
  o_ref, lse_ref, m_sc, l_sc, acc_sc, q_sc, k_sc, v_sc = refs[12 + n_aliased:]
  b, j, i, s_ = (pl.program_id(a) for a in range(4))
  rank = heads.rank(j)

  @pl.when(s_ == 0)
  def _init():
    m_sc[...] = jnp.full(m_sc.shape, common.NEG_INF, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  slot = lists.slot(b, j, i, s_)
  klass = _Lists.at(cls_ref, slot)
  k_block = _Lists.at(idx_ref, slot)

  def compute(masked, h):
    c = heads.kv_head(rank, h)
    q = heads.q.staged(q_ref, h, q_sc)()  # (once per head, not per key chunk)
    k_at, v_at = heads.kv.staged(k_ref, c, k_sc), heads.kv.staged(v_ref, c, v_sc)

    def chunk(keys, offset):  # (FP8 K/V tiles are widened to q's dtype as they load)
      s = _capped_logits(cfg, q, k_at(keys).astype(q.dtype))
      s, keep = _tile(cfg, info, h, s, k_block * cfg.block_kv + offset, keys, masked)
      m_prev = m_sc[h]  # [bq, 128]
      m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
      # Rows with nothing visible yet keep m = NEG_INF: subtracting 0 there makes their masked
      # entries exp(NEG_INF) = 0 (not exp(0) = 1).
      p = jnp.exp(s - jnp.where(m_new == common.NEG_INF, 0.0, m_new)[:, :1])
      alpha = jnp.exp(m_prev - m_new)
      l_sc[h] = alpha * l_sc[h] + jnp.sum(p, axis=1, keepdims=True)
      pv = p if keep is None else jnp.where(keep, p, 0.0)
      v = v_at(keys).astype(q.dtype)
      pv = jnp.dot(pv.astype(v.dtype), v, preferred_element_type=jnp.float32)
      acc_sc[h] = alpha[:, :1] * acc_sc[h] + pv
      m_sc[h] = m_new

    _key_chunks(cfg, cfg.block_kv, chunk)

  _live_tile_loop(klass, heads.hb, compute)

  @pl.when(s_ == lists.slots - 1)
  def _finish():
    def finish(h):
      o, lse = common.finalize(acc_sc[h], m_sc[h][:, :1], l_sc[h][:, :1], cfg.keep_scale)
      acc_sc[h] = o
      stats.store(lse_ref, h, lse)
    _head_loop(heads.hb, finish)
    heads.q.put_all(o_ref, acc_sc)


def _live_tile_loop(klass, n_heads: int, compute):
  """Runs ``compute(masked, h)`` over the heads of a live tile; ``masked`` (traced) is whether
  it is PARTIAL."""
  body = functools.partial(compute, klass == block_sparse.PARTIAL)
  pl.when(klass != block_sparse.EMPTY)(functools.partial(_head_loop, n_heads, body))


def _capped_logits(cfg, q, k):
  """Scaled, soft-capped logits ``[bq, bk]`` float32 of a q tile against a k tile."""
  s = jax.lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32) * cfg.scale
  if cfg.softcap is not None:
    s = cfg.softcap * jnp.tanh(s / cfg.softcap)
  return s


def _q_row_specs(plan, r0, r1, info, stats, heads, bq, bk):
  """Lists and BlockSpecs of a pass over rows ``[r0, r1)`` of q blocks whose slots walk each
  row's live kv blocks (forward and dQ; grid ``(B, N // hb, rows, slots)``).

  Returns:
    ``(lists, info_specs, q_spec, kv_spec, row_spec)``.
  """
  lists = _Lists(plan.kv_index, plan.kv_class, plan.kv_count, r0, r1)
  q_at = lambda b_, j, i, s_, *r: r0 + i
  kv_at = lambda b_, j, i, s_, idx, *r: _Lists.at(idx, lists.slot(b_, j, i, s_))
  q_spec = heads.q.spec(bq, lambda b_, j, i, s_, *r: (b_, r0 + i, j))
  kv_spec = heads.kv.spec(bk, lambda b_, j, i, s_, idx, *r: (
      b_, kv_at(b_, j, i, s_, idx), heads.kv_block(j)))
  row_spec = stats.spec(lambda b_, j, i, s_, *r: (b_, j, r0 + i))
  specs = _info_specs(info, bq, bk, heads.hb, q_at, kv_at, lambda b_, j, *r: j)
  return lists, specs, q_spec, kv_spec, row_spec


def _compute_dtype(dtype):
  """The dtype the compiled kernels read for inputs of ``dtype``: Mosaic has no float16 vector
  casts on any TPU generation ("Invalid vector register cast" compiling for v4, v5e, v5p, v6e),
  so float16 operands are widened to float32 and the results narrowed after."""
  return jnp.dtype(jnp.float32 if jnp.dtype(dtype) == jnp.float16 else dtype)


def _widened(q, cfg: common.KernelConfig):
  """Whether the call runs on widened inputs (``_compute_dtype``; plain interpret mode computes
  in the inputs' dtype as given, JAX's TPU interpreter as the hardware does)."""
  return _compute_dtype(q.dtype) != q.dtype and not _plain(cfg.interpret)


def _f32(cfg: common.KernelConfig) -> common.KernelConfig:
  return dataclasses.replace(cfg, out_dtype=jnp.float32)


@functools.partial(jax.jit, static_argnames=("cfg",))
def forward(q, k, v, ops: common.Operands, plan, cfg: common.KernelConfig, acc=None):
  """See ``kernels.common``: returns ``(o [B, Tp, N, H], lse [B, N, Tp] float32)``."""
  if _widened(q, cfg):
    o, lse = forward(*(x.astype(jnp.float32) for x in (q, k, v)), ops, plan, _f32(cfg), acc)
    return o.astype(cfg.out_dtype if acc is None else acc.o.dtype), lse
  b, tp, n, h = q.shape
  heads = _Heads.of(q, k, cfg.interpret)
  info = _info_arrays(ops)
  args = [*info, heads.q.array(q), heads.kv.array(k), heads.kv.array(v)]

  def make(plan, bq, bk):
    c = dataclasses.replace(cfg, block_q=bq, block_kv=bk)
    stats = _RowStats(bq, heads.hb)

    def grid_spec(r0, r1):
      lists, info_specs, q_spec, kv_spec, lse_spec = _q_row_specs(plan, r0, r1, info, stats,
                                                                  heads, bq, bk)
      return pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=3, grid=(b, n // heads.hb, lists.rows, lists.slots),
          in_specs=info_specs + [q_spec, kv_spec, kv_spec], out_specs=[q_spec, lse_spec],
          scratch_shapes=[pltpu.VMEM((heads.hb, bq, LANES), jnp.float32),
                          pltpu.VMEM((heads.hb, bq, LANES), jnp.float32),
                          pltpu.VMEM((heads.hb, bq, h), jnp.float32),
                          *_staging(q.dtype, h, bq, bk, bk)],
      ), lists

    return _Pass(functools.partial(_fwd_kernel, cfg=c, heads=heads, stats=stats),
                 _row_ranges(plan.kv_index), grid_spec,
                 [jax.ShapeDtypeStruct(heads.q.shape(b, tp, n), cfg.out_dtype),
                  jax.ShapeDtypeStruct(stats.shape(b, n, tp), jnp.float32)],
                 args, "pallas_ring_fwd", _body_bytes(cfg, "fwd", bq, bk))

  p, vmem = tiles._fit(make, block_sparse.merge_heads(plan, heads.hb), cfg.block_q,
                       cfg.block_kv, cfg, q, "forward")
  o, lse = _chained_call(p, vmem)
  stats = p.kernel.keywords["stats"]
  return common.merged(acc, heads.q.unview(o), stats.from_kernel(lse))
