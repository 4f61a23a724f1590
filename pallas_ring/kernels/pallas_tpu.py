"""Pallas kernels lowered through Mosaic (TPU), implementing ``kernels.common``'s contract.

The plan's lists arrive through scalar prefetch (SMEM, flattened to 1-D). Grids are
``(B, N, rows, slots)`` with the reduction (slot) axis last and "arbitrary". Slot ``j`` of row ``i``
visits the ``j``-th live block of that row; slots past the row's count have class EMPTY and their
index maps repeat the last live block, so the pipeline issues no copy and the body does nothing.
FULL tiles run with no mask arithmetic; PARTIAL tiles apply the elementwise mask.

q, k, v, o and the gradients are seen as ``[B, L, heads * H]``; a ``(bq, H)`` block whose last-axis
index is the head reads one head's lanes. The head dim is therefore padded to a multiple of 128
lanes (a no-op for H = 128, 256). That reshape is not free on TPU: XLA tiles ``[B, L, heads, H]``
by ``(heads, H)`` and ``[B, L, heads * H]`` by ``(L, heads * H)``, so it relayouts each operand
once (measured in BENCHMARKS.md; a Mosaic block cannot select one head inside a ``(8, 128)``
tile, so reading the caller's layout in place needs blocks of 8 heads). dK/dV accumulate over the
query heads of a GQA group inside one program per kv head (the group is part of the reduction
axis), so no per-query-head float32 temporary exists.

Mosaic tiling: blocks are ``(bq, H)`` / ``(bk, H)``; row statistics live in ``(bq, 128)``
lane-broadcast scratch; query-side vectors are ``(bq, 1)`` and key-side vectors ``(1, bk)`` blocks
of ``[., T, 1]`` / ``[., 1, S]`` arrays (their unit axis equals the array's, which Mosaic allows).
Block sizes must be multiples of 8 (queries) and 128 (keys).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_ring.kernels import common

FULL, PARTIAL = 2, 1
LANES = 128
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_TN = (((0,), (0,)), ((), ()))  # a.T @ b


# Scalar memory for one kernel call's plan lists. SMEM is 1 MiB on v5e and the lists grow as
# rows * slots (quadratically in the length): a pass whose lists exceed this budget runs as
# several calls over consecutive row ranges, writing one set of outputs in place (aliased).
SMEM_LIST_BYTES = 256 * 1024


class _Lists:
  """Rows ``[r0, r1)`` of ``[Bp, Np, rows, slots]`` plan lists, flattened for scalar prefetch, and
  how to index them from grid ids (the grid's row id is local to the range).

  Block indices are stored as int16 when they fit and classes as int8 (a quarter of int32's
  bytes per slot).
  """

  def __init__(self, index, klass, count, r0=0, r1=None):
    self.bp, self.np, rows, self.slots = index.shape
    self.r0, r1 = r0, rows if r1 is None else r1
    self.rows = r1 - r0
    index_dtype = _index_dtype(rows, self.slots)
    sl = lambda x: x[:, :, r0:r1]
    self.arrays = (sl(index).reshape(-1).astype(index_dtype),
                   sl(klass).reshape(-1).astype(jnp.int8), sl(count).reshape(-1))

  @staticmethod
  def at(ref, slot):
    """The int32 value of a compact list entry (an index map or kernel reads it)."""
    return ref[slot].astype(jnp.int32)

  def row(self, b, n, i):
    return (common.sel(self.bp, b) * self.np + common.sel(self.np, n)) * self.rows + i

  def slot(self, b, n, i, j):
    return self.row(b, n, i) * self.slots + j


def _index_dtype(rows, slots):
  return jnp.int16 if max(rows, slots) < 2**15 else jnp.int32


def _row_ranges(index, budget=None):
  """Consecutive row ranges ``[(r0, r1), ...]`` whose lists each fit ``SMEM_LIST_BYTES``."""
  bp, np_, rows, slots = index.shape
  per_row = bp * np_ * (slots * (jnp.dtype(_index_dtype(rows, slots)).itemsize + 1) + 4)
  step = max(1, min(rows, (budget or SMEM_LIST_BYTES) // per_row))
  return [(r0, min(rows, r0 + step)) for r0 in range(0, rows, step)]


def _chained_call(kernel, ranges, make_grid_spec, out_shape, args, name):
  """Runs ``kernel`` once per row range, each call writing its rows of the same outputs.

  ``make_grid_spec(r0, r1) -> (grid_spec, lists)`` builds one call's grid; ``out_shape`` is a
  list. The outputs of one call are aliased into the next (as unread ``ANY`` inputs), so they are
  written in place; each call writes only the blocks of its rows.
  """
  outs = None
  for r0, r1 in ranges:
    grid_spec, lists = make_grid_spec(r0, r1)
    extra = [] if outs is None else list(outs)
    if extra:
      grid_spec = pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=grid_spec.num_scalar_prefetch, grid=grid_spec.grid,
          in_specs=list(grid_spec.in_specs) + [pl.BlockSpec(memory_space=pl.ANY)] * len(extra),
          out_specs=grid_spec.out_specs, scratch_shapes=grid_spec.scratch_shapes)
    first_alias = len(lists.arrays) + len(jax.tree.leaves(args))  # (None args are no inputs)
    outs = pl.pallas_call(
        functools.partial(kernel, lists=lists, n_aliased=len(extra)), grid_spec=grid_spec,
        out_shape=out_shape, compiler_params=_params(), interpret=kernel.keywords["cfg"].interpret,
        input_output_aliases={first_alias + a: a for a in range(len(extra))}, name=name,
    )(*lists.arrays, *args, *extra)
  return outs


def _lanes(x):
  """``[B, L, heads, H]`` -> ``[B, L, heads * H]`` (free on GPU; on TPU XLA relayouts it, see the
  module docstring)."""
  return x.reshape(x.shape[0], x.shape[1], x.shape[2] * x.shape[3])


def _heads(x, heads):
  """Inverse of ``_lanes``."""
  return x.reshape(x.shape[0], x.shape[1], heads, x.shape[2] // heads)


class _Info(NamedTuple):
  """Token info, dense mask, bias, ALiBi and dropout keys: arrays, BlockSpecs or kernel refs.

  Query-side vectors are ``[., Tp, 1]`` (blocks ``(bq, 1)``), key-side ones ``[., 1, Sp]``
  (blocks ``(1, bk)``); None where absent.
  """

  qpos: Any
  kpos: Any
  qseg: Any
  kseg: Any
  dense: Any  # int8 [Bm, Nm, Tp, Sp]
  bias: Any  # [Bb, Nb, Tp, Sp]
  alibi: Any  # float32 [Ba, N, 1, 1]
  rows: Any  # int32 [Bd, Nd, Tp, 1] dropout row keys
  cols: Any  # int32 [Bp, 1, Sp] dropout column keys


def _info_arrays(ops) -> _Info:
  col = lambda x: None if x is None else x[:, :, None]
  row = lambda x: None if x is None else x[:, None, :]
  drop = ops.dropout
  return _Info(col(ops.q_info.positions), row(ops.kv_info.positions),
               col(ops.q_info.segment_ids), row(ops.kv_info.segment_ids),
               None if ops.dense is None else ops.dense.astype(jnp.int8), ops.bias,
               None if ops.alibi is None else ops.alibi[..., None],
               None if drop is None else drop.rows[..., None], None if drop is None else row(drop.cols))


def _info_specs(arrays: _Info, bq, bk, q_block, k_block, head=lambda b, n, i, j, *r: n):
  """BlockSpecs for ``_info_arrays``; ``q_block`` / ``k_block`` map grid ids to block indices
  and ``head`` to the query head (for per-head arrays)."""

  def qspec(x):
    if x is None:
      return None
    return pl.BlockSpec((None, bq, 1), lambda b, n, i, j, *r: (
        common.sel(x.shape[0], b), q_block(b, n, i, j, *r), 0))

  def kspec(x):
    if x is None:
      return None
    return pl.BlockSpec((None, 1, bk), lambda b, n, i, j, *r: (
        common.sel(x.shape[0], b), 0, k_block(b, n, i, j, *r)))

  def head_spec(x, rows, cols, row_block, col_block):
    if x is None:
      return None
    bm, nm = x.shape[:2]
    return pl.BlockSpec((None, None, rows, cols), lambda b, n, i, j, *r: (
        common.sel(bm, b), common.sel(nm, head(b, n, i, j, *r)), row_block(b, n, i, j, *r),
        col_block(b, n, i, j, *r)))

  zero = lambda *_: 0
  a = arrays
  return list(_Info(qspec(a.qpos), kspec(a.kpos), qspec(a.qseg), kspec(a.kseg),
                    head_spec(a.dense, bq, bk, q_block, k_block),
                    head_spec(a.bias, bq, bk, q_block, k_block),
                    head_spec(a.alibi, 1, 1, zero, zero),
                    head_spec(a.rows, bq, 1, q_block, zero), kspec(a.cols)))


def _tile(cfg, info: _Info, s, k_block_index, bk, masked):
  """Adds bias / ALiBi to logits ``s [bq, bk]``; the tile's mask (masked tiles) and dropout keep.

  Returns:
    ``(s, vis, keep)``; ``vis`` None on unmasked tiles, ``keep`` None without dropout.
  """
  get = lambda r: None if r is None else r[...]
  q_pos, k_pos = info.qpos[...], info.kpos[...]
  s = common.score_terms(s, get(info.bias), get(info.alibi), q_pos, k_pos)
  vis = None
  if masked:
    k_index = jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1) + k_block_index * bk
    vis = common.tile_visible(cfg, q_pos, k_pos, k_index, get(info.qseg), get(info.kseg),
                              get(info.dense))
  keep = None
  if cfg.dropout_rate:
    keep = common.dropout_keep(cfg.dropout_rate, info.rows[...], info.cols[...])
  return s, vis, keep


class _RowStats:
  """How ``[B, N, Tp]`` float32 row statistics (lse, delta) travel through the kernels.

  Lane-dense ``[B, N, 1, Tp]`` with ``(1, bq)`` blocks when the query tile is a multiple of 128
  (converted to and from the kernels' ``(bq, 1)`` columns by a transpose), else ``[B, N, Tp, 1]``
  with ``(bq, 1)`` blocks, whose unit minor axis XLA pads to 128 lanes in HBM (128x the bytes).
  """

  def __init__(self, bq: int):
    self.bq, self.dense = bq, bq % LANES == 0

  def to_kernel(self, x):
    return x[:, :, None, :] if self.dense else x[..., None]

  def from_kernel(self, x):
    return x[:, :, 0, :] if self.dense else x[..., 0]

  def shape(self, b, n, tp):
    return (b, n, 1, tp) if self.dense else (b, n, tp, 1)

  def spec(self, where):
    """BlockSpec of the rows ``where(*grid ids) = (batch, head, q block)`` selects."""
    if self.dense:
      return pl.BlockSpec((None, None, 1, self.bq), lambda *a: (*where(*a)[:2], 0, where(*a)[2]))
    return pl.BlockSpec((None, None, self.bq, 1), lambda *a: (*where(*a), 0))

  def load(self, ref):
    """The block as a ``(bq, 1)`` column."""
    x = ref[...]
    return jnp.broadcast_to(x, (LANES, self.bq)).T[:, :1] if self.dense else x

  def store(self, ref, column):
    """Writes a ``(bq, 1)`` column."""
    ref[...] = jnp.broadcast_to(column, (self.bq, LANES)).T[:1, :] if self.dense else column


def _group(head, group_size: int):
  """The kv head of query head ``head`` (int32 also under x64: no mixed-dtype division)."""
  return lax.div(head, jnp.asarray(group_size, head.dtype))


def _group_step(kv_head, step, group_size: int, slots: int):
  """dK/dV reduction step -> (query head, slot): the group's heads one after another."""
  c = lambda x: jnp.asarray(x, step.dtype)
  return kv_head * c(group_size) + lax.div(step, c(slots)), lax.rem(step, c(slots))


def _params():
  return pltpu.CompilerParams(
      dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))


# ----------------------------------------------------------------------------------- forward --

def _fwd_kernel(idx_ref, cls_ref, cnt_ref, *refs, cfg, lists, n_aliased, stats):
  info = _Info(*refs[:9])
  q_ref, k_ref, v_ref = refs[9:12]
  o_ref, lse_ref, m_sc, l_sc, acc_sc = refs[12 + n_aliased:]  # (aliased outputs: unread)
  b, n, i, j = (pl.program_id(a) for a in range(4))

  @pl.when(j == 0)
  def _init():
    m_sc[...] = jnp.full(m_sc.shape, common.NEG_INF, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  slot = lists.slot(b, n, i, j)
  klass = _Lists.at(cls_ref, slot)

  def compute(masked):
    s = _capped_logits(cfg, q_ref[...], k_ref[...])
    s, vis, keep = _tile(cfg, info, s, _Lists.at(idx_ref, slot), cfg.block_kv, masked)
    if masked:
      s = jnp.where(vis, s, common.NEG_INF)
    m_prev = m_sc[...]  # [bq, 128]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    p = jnp.exp(s - m_new[:, :1])
    if masked:
      p = jnp.where(vis, p, 0.0)
    alpha = jnp.exp(m_prev - m_new)
    l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
    pv = p if keep is None else jnp.where(keep, p, 0.0)
    pv = jnp.dot(pv.astype(v_ref.dtype), v_ref[...], preferred_element_type=jnp.float32)
    acc_sc[...] = alpha[:, :1] * acc_sc[...] + pv
    m_sc[...] = m_new

  pl.when(klass == FULL)(lambda: compute(False))
  pl.when(klass == PARTIAL)(lambda: compute(True))

  @pl.when(j == lists.slots - 1)
  def _finish():
    o, lse = common.finalize(acc_sc[...], m_sc[:, :1], l_sc[:, :1], cfg.keep_scale)
    o_ref[...] = o.astype(o_ref.dtype)
    stats.store(lse_ref, lse)


def _capped_logits(cfg, q, k):
  """Scaled, soft-capped logits ``[bq, bk]`` float32 of a q tile against a k tile."""
  s = jax.lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32) * cfg.scale
  if cfg.softcap is not None:
    s = cfg.softcap * jnp.tanh(s / cfg.softcap)
  return s


def _q_row_specs(plan, r0, r1, info, stats, bq, bk, h, group):
  """Lists and BlockSpecs of a pass over rows ``[r0, r1)`` of q blocks whose slots walk each
  row's live kv blocks (forward and dQ; grid ``(B, N, rows, slots)``).

  Returns:
    ``(lists, info_specs, q_spec, kv_spec, row_spec)``.
  """
  lists = _Lists(plan.kv_index, plan.kv_class, plan.kv_count, r0, r1)
  q_at = lambda b_, n_, i, j, *r: r0 + i
  kv_at = lambda b_, n_, i, j, idx, *r: _Lists.at(idx, lists.slot(b_, n_, i, j))
  q_spec = pl.BlockSpec((None, bq, h), lambda b_, n_, i, j, *r: (b_, r0 + i, n_))
  kv_spec = pl.BlockSpec((None, bk, h), lambda b_, n_, i, j, idx, *r: (
      b_, kv_at(b_, n_, i, j, idx), _group(n_, group)))
  row_spec = stats.spec(lambda b_, n_, i, j, *r: (b_, n_, r0 + i))
  return lists, _info_specs(info, bq, bk, q_at, kv_at), q_spec, kv_spec, row_spec


@functools.partial(jax.jit, static_argnames=("cfg",))
def forward(q, k, v, ops: common.Operands, plan, cfg: common.KernelConfig):
  """See ``kernels.common``: returns ``(o [B, Tp, N, H], lse [B, N, Tp] float32)``."""
  b, tp, n, h = q.shape
  kh = k.shape[2]
  g = n // kh
  bq, bk = cfg.block_q, cfg.block_kv
  info = _info_arrays(ops)
  stats = _RowStats(bq)

  def grid_spec(r0, r1):
    lists, info_specs, q_spec, kv_spec, lse_spec = _q_row_specs(plan, r0, r1, info, stats, bq,
                                                                bk, h, g)
    return pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3, grid=(b, n, lists.rows, lists.slots),
        in_specs=info_specs + [q_spec, kv_spec, kv_spec], out_specs=[q_spec, lse_spec],
        scratch_shapes=[pltpu.VMEM((bq, LANES), jnp.float32),
                        pltpu.VMEM((bq, LANES), jnp.float32), pltpu.VMEM((bq, h), jnp.float32)],
    ), lists

  o, lse = _chained_call(
      functools.partial(_fwd_kernel, cfg=cfg, stats=stats), _row_ranges(plan.kv_index),
      grid_spec, [jax.ShapeDtypeStruct((b, tp, n * h), cfg.out_dtype),
                  jax.ShapeDtypeStruct(stats.shape(b, n, tp), jnp.float32)],
      [*info, _lanes(q), _lanes(k), _lanes(v)], "pallas_ring_fwd")
  return _heads(o, n), stats.from_kernel(lse)


# ---------------------------------------------------------------------------------- backward --

def _probs(cfg, info, q, k, lse, k_block_index, masked):
  """Recomputed probabilities ``p [bq, bk]``, capped logits ``s`` and dropout keep of a tile."""
  s_cap = _capped_logits(cfg, q, k)
  s, vis, keep = _tile(cfg, info, s_cap, k_block_index, cfg.block_kv_bwd, masked)
  p = jnp.exp(s - common.safe_lse(lse))
  if masked:
    p = jnp.where(vis, p, 0.0)
  return p, s_cap, keep


def _dq_kernel(idx_ref, cls_ref, cnt_ref, *refs, cfg, lists, n_aliased, stats):
  info = _Info(*refs[:9])
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[9:15]
  dq_ref, dq_sc = refs[15 + n_aliased:]
  b, n, i, j = (pl.program_id(a) for a in range(4))

  @pl.when(j == 0)
  def _init():
    dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

  slot = lists.slot(b, n, i, j)
  klass = _Lists.at(cls_ref, slot)

  def compute(masked):
    p, s, keep = _probs(cfg, info, q_ref[...], k_ref[...], stats.load(lse_ref),
                        _Lists.at(idx_ref, slot), masked)
    dp = jax.lax.dot_general(do_ref[...], v_ref[...], _NT, preferred_element_type=jnp.float32)
    ds = p * (common.dropped(dp, keep, cfg) - stats.load(delta_ref)) * common.softcap_grad(s, cfg)
    dq_sc[...] += jnp.dot(ds.astype(k_ref.dtype), k_ref[...], preferred_element_type=jnp.float32)

  pl.when(klass == FULL)(lambda: compute(False))
  pl.when(klass == PARTIAL)(lambda: compute(True))

  @pl.when(j == lists.slots - 1)
  def _finish():
    dq_ref[...] = (dq_sc[...] * cfg.scale).astype(dq_ref.dtype)


def _dkv_kernel(idx_ref, cls_ref, cnt_ref, *refs, cfg, lists, group, n_aliased, stats):
  info = _Info(*refs[:9])
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[9:15]
  dk_ref, dv_ref, dk_sc, dv_sc = refs[15 + n_aliased:]
  b, kv_head, jk, step = (pl.program_id(a) for a in range(4))

  @pl.when(step == 0)
  def _init():
    dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
    dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

  n, i = _group_step(kv_head, step, group, lists.slots)
  slot = lists.slot(b, n, jk, i)
  klass = _Lists.at(cls_ref, slot)

  def compute(masked):
    p, s, keep = _probs(cfg, info, q_ref[...], k_ref[...], stats.load(lse_ref), lists.r0 + jk,
                        masked)
    do = do_ref[...]
    dv_sc[...] += jax.lax.dot_general(common.dropped(p, keep, cfg).astype(do.dtype), do, _TN,
                                      preferred_element_type=jnp.float32)
    dp = jax.lax.dot_general(do, v_ref[...], _NT, preferred_element_type=jnp.float32)
    ds = p * (common.dropped(dp, keep, cfg) - stats.load(delta_ref)) * common.softcap_grad(s, cfg)
    dk_sc[...] += jax.lax.dot_general(ds.astype(q_ref.dtype), q_ref[...], _TN,
                                      preferred_element_type=jnp.float32)

  pl.when(klass == FULL)(lambda: compute(False))
  pl.when(klass == PARTIAL)(lambda: compute(True))

  @pl.when(step == group * lists.slots - 1)
  def _finish():
    dk_ref[...] = (dk_sc[...] * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


@functools.partial(jax.jit, static_argnames=("cfg",))
def backward(q, k, v, do, lse, delta, ops: common.Operands, plan, cfg: common.KernelConfig):
  """See ``kernels.common``: returns ``(dq, dk, dv)`` in ``cfg.out_dtype``."""
  b, tp, n, h = q.shape
  sp, kh = k.shape[1], k.shape[2]
  g = n // kh
  bq, bk = cfg.block_q_bwd, cfg.block_kv_bwd
  qf, kf, vf, dof = _lanes(q), _lanes(k), _lanes(v), _lanes(do)
  stats = _RowStats(bq)
  rows = stats.to_kernel(lse), stats.to_kernel(delta)
  info = _info_arrays(ops)
  scratch = lambda rows_: [pltpu.VMEM((rows_, h), jnp.float32)]

  # dQ: rows are q blocks, slots walk the live kv blocks.
  def dq_grid(r0, r1):
    lists, info_specs, q_spec, kv_spec, row_spec = _q_row_specs(plan, r0, r1, info, stats, bq,
                                                                bk, h, g)
    return pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3, grid=(b, n, lists.rows, lists.slots),
        in_specs=info_specs + [q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec],
        out_specs=[q_spec], scratch_shapes=scratch(bq)), lists

  args = [*info, qf, kf, vf, dof, *rows]
  dq, = _chained_call(functools.partial(_dq_kernel, cfg=cfg, stats=stats),
                      _row_ranges(plan.kv_index), dq_grid,
                      [jax.ShapeDtypeStruct((b, tp, n * h), cfg.out_dtype)], args, "pallas_ring_dq")

  # dK/dV: one program per (kv head, kv block); its reduction axis walks the live q blocks of
  # each query head of the group in turn, so dK/dV accumulate per kv head in VMEM.
  def dkv_grid(r0, r1):
    lists = _Lists(plan.q_index, plan.q_class, plan.q_count, r0, r1)
    head = lambda b_, kvh, jk, st, *r: _group_step(kvh, st, g, lists.slots)[0]

    def q_at(b_, kvh, jk, st, idx, *r):
      n_, i = _group_step(kvh, st, g, lists.slots)
      return _Lists.at(idx, lists.slot(b_, n_, jk, i))

    q_spec = pl.BlockSpec((None, bq, h), lambda b_, kvh, jk, st, idx, *r: (
        b_, q_at(b_, kvh, jk, st, idx), head(b_, kvh, jk, st)))
    row_spec = stats.spec(lambda b_, kvh, jk, st, idx, *r: (
        b_, head(b_, kvh, jk, st), q_at(b_, kvh, jk, st, idx)))
    kv_spec = pl.BlockSpec((None, bk, h), lambda b_, kvh, jk, st, *r: (b_, r0 + jk, kvh))
    return pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3, grid=(b, kh, lists.rows, g * lists.slots),
        in_specs=_info_specs(info, bq, bk, q_at, lambda b_, kvh, jk, st, *r: r0 + jk, head)
        + [q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec],
        out_specs=[kv_spec, kv_spec], scratch_shapes=scratch(bk) * 2), lists

  dkv_shape = jax.ShapeDtypeStruct((b, sp, kh * h), cfg.out_dtype)
  dk, dv = _chained_call(functools.partial(_dkv_kernel, cfg=cfg, group=g, stats=stats),
                         _row_ranges(plan.q_index), dkv_grid, [dkv_shape, dkv_shape], args,
                         "pallas_ring_dkv")
  return _heads(dq, n), _heads(dk, kh), _heads(dv, kh)
