"""Block plans: which (query block, key block) tiles a kernel must visit, and how.

Everything here runs on device under ``jit`` with static shapes, in O(nq * nk) work from per-block
summaries (min / max position and segment id of every block). Only a dense mask costs O(T * S),
because it is that large by nature. Numpy positions give the position part in numpy, built while
tracing; without segment ids or a dense mask that is the whole plan. ``plans.Planner`` decides
when positions are known ahead (``flash_attention``'s default token indices, a ring's layout),
builds those plans once (``plan_table``: every (rank, source) pair of a ring) and holds them.

Block classes (``block_class``):

====  =========  ==========================================================
code  name       meaning
====  =========  ==========================================================
0     EMPTY      no (q, k) pair in the tile is visible: no DMA, no compute
1     PARTIAL    some pairs visible: compute and apply the elementwise mask
2     FULL       every pair visible: compute with no mask arithmetic
====  =========  ==========================================================

Shapes (``Bp`` is 1 or B, ``Np`` is 1 or N: the plan only carries a batch or head axis when
positions, segment ids or the dense mask vary along it):

* ``block_class``      ``[Bp, Np, nq, nk]`` int32
* ``kv_index``         ``[Bp, Np, nq, nk]`` int32  live kv blocks of each q block: FULL ones
  first, then PARTIAL ones (each group ascending), then padding that repeats the last live block
  (so a TPU pipeline issues no copy for it)
* ``kv_class``         ``[Bp, Np, nq, nk]`` int32  class of each listed kv block (0 on padding)
* ``kv_count``         ``[Bp, Np, nq]``     int32  number of live kv blocks of each q block
* ``kv_full``          ``[Bp, Np, nq]``     int32  length of the leading run of FULL blocks with
  consecutive indices ``kv_index[0] + j`` (a GPU kernel runs two branch-free loops:
  ``[0, kv_full)`` directly addressed and unmasked, ``[kv_full, kv_count)`` through the list
  with the mask; FULL blocks outside the run are masked too, which is correct, just slower)
* ``q_index``, ``q_class`` ``[Bp, Np, nk, nq]``, ``q_count``, ``q_full`` ``[Bp, Np, nk]``: the
  transposed lists, per kv block, for the dK/dV pass
* ``any_live``         ``[]``               bool   whether any tile is live (a ring step with
  nothing live is skipped)
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from pallas_ring import masks as masks_lib

Array = Any

EMPTY, PARTIAL, FULL = 0, 1, 2


class TokenInfo(NamedTuple):
  """Per-token metadata that travels with its tensor (through the ring with K/V).

  Attributes:
    positions: ``[Bp, L]`` int32 global positions (Bp is 1 or B); masks compare these.
    segment_ids: ``[B, L]`` int32 document ids or None; tokens attend only within a segment.
  """

  positions: Array
  segment_ids: Optional[Array] = None


def make_token_info(length: int, batch: int, positions=None, segment_ids=None) -> TokenInfo:
  """Builds a TokenInfo, defaulting positions to ``arange(length)`` (a numpy array: a constant of
  the program that takes it, not an op)."""
  if positions is None:
    positions = np.arange(length, dtype=np.int32)[None]
  else:
    positions = jnp.asarray(positions, jnp.int32)
  if positions.ndim == 1:
    positions = positions[None]
  if segment_ids is not None:
    segment_ids = jnp.asarray(segment_ids, jnp.int32)
  return TokenInfo(positions, segment_ids)


def pad_token_info(info: TokenInfo, padded_len: int) -> TokenInfo:
  """Pads positions / segment ids along the sequence to ``padded_len`` (values are ignored)."""
  n = padded_len - info.positions.shape[-1]
  if n == 0:
    return info
  pad = lambda x: None if x is None else (np if isinstance(x, np.ndarray) else jnp).pad(
      x, ((0, 0), (0, n)), mode="edge")
  return TokenInfo(pad(info.positions), pad(info.segment_ids))


def indexed_positions(length: int, padded_len: int) -> np.ndarray:
  """``[1, padded_len]`` int32 numpy positions of ``length`` tokens at their indices, padded (the
  positions ``flash_attention`` uses by default)."""
  return pad_token_info(make_token_info(length, 1), padded_len).positions


class BlockBoundsWithSegments(NamedTuple):
  pos: masks_lib.BlockBounds  # [Bp, nblocks] min / max global position over valid tokens
  seg: Optional[masks_lib.BlockBounds]  # [B, nblocks] min / max segment id, or None
  has_pad: Array  # [nblocks] bool: the block contains padding tokens
  all_pad: Array  # [nblocks] bool: the block holds padding only (its bounds are meaningless)


def _xp(*xs):
  """``numpy`` when every one of ``xs`` is a numpy array (a plan part known while tracing, see
  ``plans.Planner``), else ``jax.numpy``."""
  return np if all(isinstance(x, np.ndarray) for x in xs) else jnp


def summarize(info: TokenInfo, block: int, valid_len: int) -> BlockBoundsWithSegments:
  """Per-block min / max of positions and segment ids over the first ``valid_len`` tokens: numpy
  bounds for numpy inputs, jax.numpy otherwise; the padding flags are always numpy (they depend
  on the static lengths only)."""
  length = info.positions.shape[-1]
  assert length % block == 0, (length, block)
  nb = length // block
  valid = (np.arange(length) < valid_len).reshape(nb, block)

  def bounds(x):
    xp = _xp(x)
    x = x.reshape(x.shape[0], nb, block)
    lo = xp.min(xp.where(valid, x, masks_lib.INT32_MAX), axis=-1)
    hi = xp.max(xp.where(valid, x, masks_lib.INT32_MIN), axis=-1)
    return masks_lib.BlockBounds(lo, hi)

  seg = None if info.segment_ids is None else bounds(info.segment_ids)
  return BlockBoundsWithSegments(bounds(info.positions), seg, ~np.all(valid, axis=-1),
                                 ~np.any(valid, axis=-1))


class BlockPlan(NamedTuple):
  """Block-sparse schedule of one (q shard, kv shard) pair; see the module docstring."""

  block_class: Array
  kv_index: Array
  kv_class: Array
  kv_count: Array
  kv_full: Array
  q_index: Array
  q_class: Array
  q_count: Array
  q_full: Array
  any_live: Array


def plan_table(mask: masks_lib.MaskSpec, q_infos, kv_infos, *, block_q: int, block_kv: int,
               q_len: int, kv_len: int):
  """The plans of every (q part ``i``, kv part ``j``) pair, in numpy, each distinct plan once.

  For callers whose positions are known while tracing but chosen at run time (a ring's shards:
  which pair a device runs depends on its rank), so that a call selects a plan instead of
  building it.

  Args:
    mask: the mask spec, in global positions.
    q_infos, kv_infos: sequences of numpy ``TokenInfo`` without segment ids, padded to multiples
      of ``block_q`` / ``block_kv``.
    block_q, block_kv, q_len, kv_len: as ``make_plan``.

  Returns:
    ``(plans, table)``: a BlockPlan of numpy arrays with a leading ``[U]`` axis over the distinct
    plans, and ``table [len(q_infos), len(kv_infos)]`` int32, the index of pair ``(i, j)``'s plan
    (``select_plan``).
  """
  plans, index = [], {}
  table = np.zeros((len(q_infos), len(kv_infos)), np.int32)
  for i, q_info in enumerate(q_infos):
    for j, kv_info in enumerate(kv_infos):
      plan = make_plan(mask, q_info, kv_info, block_q=block_q, block_kv=block_kv, q_len=q_len,
                       kv_len=kv_len)
      key = np.asarray(plan.block_class).tobytes()  # (a plan is a function of its classes)
      if key not in index:
        index[key] = len(plans)
        plans.append(plan)
      table[i, j] = index[key]
  stacked = BlockPlan(*(np.stack([np.asarray(x) for x in xs]) for xs in zip(*plans)))
  return stacked, table


def select_plan(plans: BlockPlan, table: np.ndarray, i, j) -> BlockPlan:
  """Pair ``(i, j)``'s plan (traced or static indices) from ``plan_table``'s result: constants
  when every pair has the same plan, else one small gather per array."""
  if plans.block_class.shape[0] == 1:
    return BlockPlan(*(jnp.asarray(x[0]) for x in plans))
  u = jnp.asarray(table)[i, j]
  return BlockPlan(*(jnp.asarray(x)[u] for x in plans))


def _compact(cls: Array, xp=jnp) -> tuple[Array, Array, Array, Array]:
  """Per row of ``cls [..., n]``: live column indices (FULL, then PARTIAL), classes, counts."""
  n = cls.shape[-1]
  live = cls > EMPTY
  rank = xp.where(cls == FULL, 0, xp.where(live, 1, 2))
  stable = {"kind": "stable"} if xp is np else {"stable": True}
  order = xp.argsort(rank, axis=-1, **stable).astype(xp.int32)
  count = xp.sum(live, axis=-1, dtype=xp.int32)
  n_full = xp.sum(cls == FULL, axis=-1, dtype=xp.int32)
  slot = xp.arange(n, dtype=xp.int32)
  in_run = (order == order[..., :1] + slot) & (slot < n_full[..., None])
  full = xp.sum(xp.cumprod(in_run.astype(xp.int32), axis=-1), axis=-1, dtype=xp.int32)
  last = xp.take_along_axis(order, xp.maximum(count - 1, 0)[..., None], axis=-1)
  index = xp.where(slot < count[..., None], order, last)
  klass = xp.where(slot < count[..., None], xp.take_along_axis(cls, order, axis=-1), EMPTY)
  return index, klass.astype(xp.int32), count, full


def _dense_block_bounds(dense_mask: Array, bq: int, bk: int, tp: int, sp: int):
  """Block any/all of a bool mask ``[Bm, Nm, T, S]`` padded with True to ``[.., tp, sp]``."""
  bm, nm, t, s = dense_mask.shape
  d = jnp.pad(dense_mask.astype(bool), ((0, 0), (0, 0), (0, tp - t), (0, sp - s)),
              constant_values=True)
  d = d.reshape(bm, nm, tp // bq, bq, sp // bk, bk)
  return jnp.any(d, axis=(3, 5)), jnp.all(d, axis=(3, 5))


def make_plan(mask: masks_lib.MaskSpec, q_info: TokenInfo, kv_info: TokenInfo, *,
              block_q: int, block_kv: int, q_len: int, kv_len: int,
              dense_mask: Optional[Array] = None) -> BlockPlan:
  """Classifies every (q block, kv block) tile and builds the compact per-row lists.

  Args:
    mask: the mask spec, in global positions.
    q_info: query positions / segment ids, padded to a multiple of ``block_q``.
    kv_info: key positions / segment ids, padded to a multiple of ``block_kv``.
    block_q, block_kv: tile sizes.
    q_len, kv_len: number of real (unpadded) tokens; key padding makes a tile at most PARTIAL.
    dense_mask: optional bool ``[Bm, Nm, q_len, kv_len]`` (Bm in {1, B}, Nm in {1, N}).

  Returns:
    A BlockPlan (see the module docstring for shapes).
  """
  cls, xp = _classes(mask, q_info, kv_info, block_q, block_kv, q_len, kv_len, dense_mask)
  return _plan_of_classes(cls, xp)


def range_plan(mask: masks_lib.MaskSpec, q_info: TokenInfo, kv_info: TokenInfo, *,
               block_q: int, block_kv: int, q_len: int, kv_len: int) -> BlockPlan:
  """A forward-only plan without sorting: each q block lists the kv tiles from its first live one
  to its last, every one PARTIAL (the kernel applies the elementwise mask in each).

  It skips what lies outside that range (a window's far past, slots past a cache's length)
  with a few fused ops where ``make_plan``'s compaction sorts; tiles inside the range that are
  EMPTY are visited, and FULL ones masked, which is correct, just slower, and cheap where the
  kernel is bound by reading K/V (``decode_attention``). The transposed lists (``q_*``), which
  only a backward pass reads, are zeros.
  """
  cls, xp = _classes(mask, q_info, kv_info, block_q, block_kv, q_len, kv_len, None)
  live = cls > EMPTY  # [Bp, Np, nq, nk]
  nk = cls.shape[-1]
  any_live = xp.any(live, axis=-1)
  lo = xp.where(any_live, xp.argmax(live, axis=-1), 0).astype(xp.int32)
  hi = xp.where(any_live, nk - xp.argmax(live[..., ::-1], axis=-1), 0).astype(xp.int32)
  count = hi - lo
  slot = xp.arange(nk, dtype=xp.int32)
  inside = slot < count[..., None]
  # Past the count the list repeats its last tile (no copy issued for it).
  kv_index = xp.minimum(lo[..., None] + slot, xp.maximum(hi - 1, 0)[..., None])
  kv_class = xp.where(inside, PARTIAL, EMPTY).astype(xp.int32)
  in_range = (slot >= lo[..., None]) & (slot < hi[..., None])
  block_class = xp.where(in_range, PARTIAL, EMPTY).astype(xp.int32)
  q_lists = xp.zeros(cls.shape[:-2] + (nk, cls.shape[-2]), xp.int32)
  q_rows = xp.zeros(cls.shape[:-2] + (nk,), xp.int32)
  return BlockPlan(block_class, kv_index, kv_class, count, xp.zeros_like(count), q_lists,
                   q_lists, q_rows, q_rows, any_live=xp.any(any_live))


@contextlib.contextmanager
def _host_eval():
  """Evaluates jnp ops on known values at once (a mask's ``block_fn`` on numpy bounds), outside
  any mesh: inside a ``shard_map`` under an active mesh, jnp would ask for the sharding of a
  value that has none there (an AssertionError in JAX)."""
  use_mesh = getattr(jax.sharding, "use_abstract_mesh", None)
  active = jax.sharding.get_abstract_mesh()
  reset = use_mesh is not None and active is not None and not active.empty  # (only under one)
  with jax.ensure_compile_time_eval(), (
      use_mesh(jax.sharding.AbstractMesh((), ())) if reset else contextlib.nullcontext()):
    yield


def _classes(mask, q_info, kv_info, block_q, block_kv, q_len, kv_len, dense_mask):
  """``(block_class [Bp, Np, nq, nk] int32, xp)``: every tile's class, in numpy when every
  input is known while tracing (``xp``), else on device."""
  qs = summarize(q_info, block_q, q_len)
  ks = summarize(kv_info, block_kv, kv_len)
  # Mask spec on position bounds: [Bp, nq, 1] against [Bp, 1, nk]. Numpy positions give numpy
  # classes, built while tracing (``plans.Planner``).
  qb = masks_lib.BlockBounds(qs.pos.lo[:, :, None], qs.pos.hi[:, :, None])
  kb = masks_lib.BlockBounds(ks.pos.lo[:, None, :], ks.pos.hi[:, None, :])
  xp = _xp(qb.lo, kb.lo)
  with _host_eval() if xp is np else contextlib.nullcontext():
    any_, all_ = (xp.asarray(x) for x in mask.block_test(qb, kb))  # (jnp inside some masks)
  any_ = any_ & ~qs.all_pad[None, :, None] & ~ks.all_pad[None, None, :]
  all_ = all_ & ~ks.has_pad[None, None, :]
  if qs.seg is not None and ks.seg is not None:
    qsl, qsh = qs.seg.lo[:, :, None], qs.seg.hi[:, :, None]
    ksl, ksh = ks.seg.lo[:, None, :], ks.seg.hi[:, None, :]
    xp = _xp(any_, qsl, ksl)
    any_ = xp.asarray(any_) & (qsl <= ksh) & (ksl <= qsh)
    all_ = xp.asarray(all_) & (qsl == qsh) & (ksl == ksh) & (qsl == ksl)
  any_, all_ = any_[:, None], all_[:, None]  # [Bp, 1, nq, nk]
  if dense_mask is not None:
    d_any, d_all = _dense_block_bounds(dense_mask, block_q, block_kv,
                                       q_info.positions.shape[-1], kv_info.positions.shape[-1])
    any_, all_ = jnp.asarray(any_) & d_any, jnp.asarray(all_) & d_all
    xp = jnp
  return xp.where(any_, xp.where(all_, FULL, PARTIAL), EMPTY).astype(xp.int32), xp


def merge_heads(plan: BlockPlan, heads_per_block: int) -> BlockPlan:
  """The plan of blocks of ``heads_per_block`` consecutive heads (a kernel whose program serves
  several heads at once shares one schedule between them).

  A tile of a head block is EMPTY when it is empty for every head of the block, FULL when it is
  full for every one, PARTIAL otherwise (the kernel then applies each head's elementwise mask).
  Plans without a head axis (``Np == 1``) are returned unchanged; otherwise ``Np`` becomes
  ``Np // heads_per_block``.
  """
  bp, np_, nq, nk = plan.block_class.shape
  if np_ == 1 or heads_per_block == 1:
    return plan
  assert np_ % heads_per_block == 0, (np_, heads_per_block)
  cls = plan.block_class.reshape(bp, np_ // heads_per_block, heads_per_block, nq, nk)
  lo, hi = jnp.min(cls, axis=2), jnp.max(cls, axis=2)
  return _plan_of_classes(jnp.where(hi == EMPTY, EMPTY, jnp.where(lo == FULL, FULL, PARTIAL)))


def _plan_of_classes(cls: Array, xp=jnp) -> BlockPlan:
  """The plan (compact lists both ways, step flags) of a class array ``[Bp, Np, nq, nk]``."""
  cls = cls.astype(xp.int32)
  kv_index, kv_class, kv_count, kv_full = _compact(cls, xp)
  q_index, q_class, q_count, q_full = _compact(xp.swapaxes(cls, -1, -2), xp)
  return BlockPlan(cls, kv_index, kv_class, kv_count, kv_full, q_index, q_class, q_count, q_full,
                   any_live=xp.any(cls > EMPTY))


def live_fraction(plan: BlockPlan) -> Array:
  """Fraction of tiles that are not EMPTY (per batch / head slice)."""
  return jnp.mean((plan.block_class > EMPTY).astype(jnp.float32), axis=(-2, -1))


__all__ = ["TokenInfo", "BlockPlan", "make_plan", "range_plan", "plan_table", "select_plan",
           "merge_heads", "make_token_info", "pad_token_info", "indexed_positions", "summarize",
           "live_fraction", "EMPTY", "PARTIAL", "FULL"]
