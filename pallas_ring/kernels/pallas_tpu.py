"""Pallas kernels lowered through Mosaic (TPU), implementing ``kernels.common``'s contract.

The plan's lists arrive through scalar prefetch (SMEM, flattened to 1-D). Grids are
``(B, head blocks, rows, slots)`` with the reduction (slot) axis last and "arbitrary". Slot ``j``
of row ``i`` visits the ``j``-th live block of that row; slots past the row's count have class
EMPTY and their index maps repeat the last live block, so the pipeline issues no copy and the body
does nothing. FULL tiles run with no mask arithmetic; PARTIAL tiles apply the elementwise mask.

Layout: q, k, v, o and the gradients arrive as the caller's ``[B, L, heads, H]``. XLA tiles that
array by ``(heads, H)`` and a Mosaic block cannot select one head inside an ``(8, 128)`` tile, so
a program serves a *block of heads*: ``hb`` query heads (8, or all N when ``N % 8``) against the
``hk`` kv heads they use (8, or all K). Operands whose head count is a multiple of 8 are read and
written in place in ``(rows, 8, H)`` blocks; others as ``[B, L, heads * H]`` lane blocks, which
costs one relayout copy each (``_View``). The body is one loop over the block's heads (rolled:
compile time does not grow with them) with per-head row statistics; the heads of a block share
one schedule (``block_sparse.merge_heads``), and a PARTIAL tile's mask is a ``lax.cond`` inside
that body, which first copies the head's q, dO, K and V rows out of in-place blocks into dense
scratch by a rolled loop over packed tiles (``_View.staged``): the per-row gathers of those
reads, unrolled, were a third of the forward's compile time.
dK/dV accumulate over the query heads of their group inside one program per kv block, so no
per-query-head float32 temporary exists. Inside a tile the body runs over chunks of
``Variants.kv_compute`` keys in a rolled loop (``_key_chunks``), as splash attention's
``block_kv_compute``: the body's vector code, most of a kernel's compile time, scales with the
query tile times the chunk, while the DMA'd tiles stay large.

Mosaic tiling: row statistics live in ``(hb, bq, 128)`` lane-broadcast scratch; query-side vectors
are ``(bq, 1)`` and key-side vectors ``(1, bk)`` blocks of ``[., T, 1]`` / ``[., 1, S]`` arrays
(their unit axis equals the array's, which Mosaic allows). Block sizes must be multiples of 8
(queries) and 128 (keys).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
from typing import Any, NamedTuple, Optional

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_ring import block_sparse
from pallas_ring.config import BlockSizes
from pallas_ring.kernels import backend, common

LANES = 128
HEAD_BLOCK = 8  # heads per program: one (8, 128) tile's rows of [B, L, heads, H]
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_TN = (((0,), (0,)), ((), ()))  # a.T @ b


@dataclasses.dataclass(frozen=True)
class Variants:
  """Kernel variants of the TPU kernels, passed as ``BlockSizes(variants=Variants(...))``."""

  # Keys per step of the body inside a key tile (forward, dQ and dK/dV; a multiple of 128 that
  # divides the tile, else the whole tile): the body's vector code, and so its compile time,
  # scales with block_q x kv_compute (BENCHMARKS.md, "Compile time against splash attention").
  # None: the whole tile.
  kv_compute: Optional[int] = 256

  def __post_init__(self):
    if self.kv_compute is not None and (self.kv_compute <= 0 or self.kv_compute % LANES):
      raise ValueError(f"Variants.kv_compute={self.kv_compute} is invalid: use a positive "
                       f"multiple of {LANES} (keys per step of the body), or None for the whole "
                       "tile.")


def _chunk(cfg, bk: int) -> int:
  """Keys per step of the body in a ``bk``-key tile (``Variants.kv_compute``, or the whole tile
  when it is None, not smaller than the tile or does not divide it)."""
  kc = (cfg.variants or Variants()).kv_compute
  return bk if kc is None or kc >= bk or bk % kc else kc


def _key_chunks(cfg, bk: int, body):
  """Runs ``body(keys, offset)`` over the chunks of a ``bk``-key tile (``Variants.kv_compute``
  keys each; ``keys`` a ``pl.ds`` of the tile's keys, ``offset`` its traced start) in a rolled
  loop; one call over the whole tile when the chunk does not divide it."""
  kc = _chunk(cfg, bk)
  if kc == bk:
    body(pl.ds(0, bk), 0)
    return

  def step(ci, carry):
    offset = pl.multiple_of(ci * kc, kc)
    body(pl.ds(offset, kc), offset)
    return carry

  lax.fori_loop(jnp.int32(0), jnp.int32(bk // kc), step, 0)


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


class _Pass(NamedTuple):
  """One kernel pass, ready to run: what ``_chained_call`` runs and ``_pass_vmem`` measures."""

  kernel: Any  # functools.partial of the kernel body (its ``cfg`` keyword carries the tiles)
  ranges: list  # consecutive row ranges, one call each (``_row_ranges``)
  grid_spec: Any  # (r0, r1) -> (PrefetchScalarGridSpec, _Lists) of one call
  out_shape: list  # jax.ShapeDtypeStruct of each output
  args: list  # the kernel's array operands after the plan lists (None entries: absent)
  name: str  # the pallas_call's name
  body_bytes: int  # the body's float32 temporaries (``_body_bytes``)
  acc: Optional[list] = None  # accumulators added into the outputs in place (aliased)


def _call_spec(p: _Pass, r0: int, r1: int, extra: list):
  """The grid spec and lists of the call over rows ``[r0, r1)``; ``extra`` are the arrays
  aliased to the outputs (the accumulators, or the previous call's outputs, unread)."""
  grid_spec, lists = p.grid_spec(r0, r1)
  if extra:
    carried = (list(grid_spec.out_specs) if p.acc is not None else
               [pl.BlockSpec(memory_space=pl.ANY)] * len(extra))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=grid_spec.num_scalar_prefetch, grid=grid_spec.grid,
        in_specs=list(grid_spec.in_specs) + carried,
        out_specs=grid_spec.out_specs, scratch_shapes=grid_spec.scratch_shapes)
  return grid_spec, lists


def _chained_call(p: _Pass, vmem: "_Vmem"):
  """Runs ``p.kernel`` once per row range, each call writing its rows of the same outputs.

  The outputs of one call are aliased into the next (as unread ``ANY`` inputs), so they are
  written in place; each call writes only the blocks of its rows. With ``p.acc`` (one array per
  output, in the outputs' kernel-side shape and dtype) the kernel adds each output block to the
  same block of its accumulator (``accumulate=True``: the accumulators are read block by block
  like the outputs) and the accumulators' buffers become the outputs (aliased), so a ring's
  running sums take no second buffer. ``vmem`` is the program's VMEM (``_pass_vmem``), which
  sets the compiler's limit.
  """
  outs = None if p.acc is None else list(p.acc)
  kw = {} if p.acc is None else dict(accumulate=True)
  for r0, r1 in p.ranges:
    extra = [] if outs is None else list(outs)
    grid_spec, lists = _call_spec(p, r0, r1, extra)
    first_alias = len(lists.arrays) + len(jax.tree.leaves(p.args))  # (None args are no inputs)
    outs = pl.pallas_call(
        functools.partial(p.kernel, lists=lists, n_aliased=len(extra), **kw),
        grid_spec=grid_spec, out_shape=p.out_shape, compiler_params=_params(vmem),
        interpret=p.kernel.keywords["cfg"].interpret,
        input_output_aliases={first_alias + a: a for a in range(len(extra))}, name=p.name,
    )(*lists.arrays, *p.args, *extra)
  return outs


def _plain(interpret) -> bool:
  """Whether ``interpret`` (``KernelConfig.interpret``) is plain interpret mode (True), which
  differs from Mosaic: it has no ref bitcast and computes float16 as given. JAX's TPU interpreter
  (``pltpu.InterpretParams``) and compiled kernels take the hardware's code paths."""
  return bool(interpret) and not dataclasses.is_dataclass(interpret)


def _value_bitcast(interpret) -> bool:
  """Whether 16-bit in-place blocks are bitcast as values rather than as refs: in plain
  interpret mode, and in JAX's TPU interpreter where it cannot read through a ref bitcast
  (``_interprets_ref_bitcast``)."""
  if not interpret:
    return False
  return _plain(interpret) or not _interprets_ref_bitcast(interpret)


@functools.cache
def _interprets_ref_bitcast(params) -> bool:
  """Whether JAX's TPU interpreter with ``params`` runs the in-place views' ref bitcast (JAX
  0.10.2's does not: "'BitcastTransform' object has no attribute 'indices'"): a probe kernel
  that reads and writes a bfloat16 block through ``ref.bitcast(jnp.uint32)`` runs once per
  ``params``, in a thread of its own (outside any trace being built), and must give the bits."""

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]
    o_ref.bitcast(jnp.uint32)[0, :, 0, :] = x_ref.bitcast(jnp.uint32)[0, :, 1, :]

  def probe():
    x = jnp.arange(16 * 8 * 128, dtype=jnp.float32).astype(jnp.bfloat16).reshape(1, 16, 8, 128)
    o = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                       interpret=params)(x)
    want = x.at[0, :, 0:2].set(x[0, :, 2:4])
    return bool(jnp.array_equal(o, want))

  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    try:
      return pool.submit(probe).result()
    except Exception:  # noqa: BLE001 - any failure of the probe means: not supported
      pltpu.reset_tpu_interpret_mode_state()  # (a failed kernel leaves the interpreter's state)
      return False


class _View(NamedTuple):
  """How a kernel sees one ``[B, L, heads, H]`` operand: blocks of ``block_heads`` heads, read
  and written one head at a time by a traced head index (the body loops over a block's heads
  instead of unrolling them: unrolled, compile time grew with the heads; BENCHMARKS.md, "Compile
  time against splash attention").

  In place (``heads % 8 == 0`` and a 16- or 32-bit dtype): ``(rows, 8, H)`` blocks of the array
  as it is; head ``c`` is a sublane-strided row set. Mosaic cannot index the packed rows of a
  16-bit block by a traced head, so 16-bit blocks are read as ``uint32`` words holding heads
  ``(2c, 2c + 1)`` (low, high half; Pallas TPU's bitcast of the second-minor axis) and the half is
  picked by a shift. Otherwise the operand is viewed as ``[B, L, heads * H]`` with
  ``(rows, block_heads * H)`` lane blocks: XLA relayouts the array once (its TPU tiling is
  ``(heads, H)``), and head ``c`` is a 128-aligned lane slice.
  """

  in_place: bool
  block_heads: int
  head_dim: int
  value_bitcast: bool  # plain interpret mode has no ref bitcast: the block is bitcast as a value

  @staticmethod
  def of(heads: int, head_dim: int, dtype, interpret) -> "_View":
    in_place = heads % HEAD_BLOCK == 0 and jnp.dtype(dtype).itemsize in (2, 4)
    return _View(in_place, HEAD_BLOCK if in_place else heads, head_dim,
                 in_place and jnp.dtype(dtype).itemsize == 2 and _value_bitcast(interpret))

  def array(self, x):
    """The operand as the kernels take it."""
    return x if self.in_place else x.reshape(*x.shape[:2], x.shape[2] * x.shape[3])

  def unview(self, x):
    """Inverse of ``array`` for an output."""
    return x if self.in_place else x.reshape(*x.shape[:2], -1, self.head_dim)

  def shape(self, b, length, heads):
    """The kernel-side shape of a ``[b, length, heads, H]`` output."""
    h = self.head_dim
    return (b, length, heads, h) if self.in_place else (b, length, heads * h)

  def spec(self, rows, where):
    """BlockSpec of the block ``where(*grid ids) = (b, row block, head block)``."""
    if self.in_place:
      # (The batch axis stays a unit axis: Mosaic cannot bitcast a squeezed block.)
      return pl.BlockSpec((1, rows, self.block_heads, self.head_dim),
                          lambda *a: (*where(*a), 0))
    return pl.BlockSpec((None, rows, self.block_heads * self.head_dim), where)

  def _lanes(self, c):
    return pl.ds(pl.multiple_of(c * self.head_dim, LANES), self.head_dim)

  def _words(self, ref):
    """A 16-bit in-place ``(1, rows, heads, H)`` block as ``uint32 (1, rows, heads / 2, H)``
    words (a value in plain interpret mode, a ref otherwise)."""
    if self.value_bitcast:
      return pltpu.bitcast(ref[...], jnp.uint32)
    return ref.bitcast(jnp.uint32)

  def get(self, ref, c, rows=slice(None)):
    """Head ``c`` (traced) of a block: ``(rows, H)`` (its ``rows``, a slice, when given)."""
    if not self.in_place:
      return ref[rows, self._lanes(c)]
    if ref.dtype.itemsize == 4:
      return ref[0, rows, c, :]
    words = self._words(ref)[0, rows, lax.shift_right_logical(c, 1), :]
    half = lax.shift_right_logical(words, (c & 1).astype(jnp.uint32) * 16)
    return lax.bitcast_convert_type(half.astype(jnp.uint16), ref.dtype)

  def staged(self, ref, c, scratch):
    """A reader ``rows -> (rows, H)`` of head ``c`` (traced) of a block. In place, the head is
    first copied to the dense ``scratch [rows, H]`` by a rolled loop over groups of a packed
    tile's rows, so the kernel holds one group's gather code instead of one per row of every
    read (a third of the forward's compile time); the reads are then plain slices. Lane views,
    and blocks whose rows are no whole number of groups, are read directly."""
    n, group = scratch.shape[0], 32 // ref.dtype.itemsize  # (rows of one packed (8, 128) tile)
    if not self.in_place or n % group:
      return lambda rows=slice(None): self.get(ref, c, rows)

    def step(r, carry):
      rows = pl.ds(pl.multiple_of(r * group, group), group)
      scratch[rows, :] = self.get(ref, c, rows)
      return carry

    lax.fori_loop(jnp.int32(0), jnp.int32(n // group), step, 0)
    return lambda rows=slice(None): scratch[rows, :]

  def put_all(self, ref, scratch, scale=None, add=None):
    """Writes float32 head-major ``scratch [heads, rows, H]`` (times ``scale``, plus the same
    block of ``add``, an accumulator ref, when given) into a block."""

    def value(c):
      x = scratch[c] if scale is None else scratch[c] * scale
      return (x if add is None else x + self.get(add, c).astype(x.dtype)).astype(ref.dtype)

    if not self.in_place or ref.dtype.itemsize == 4:
      def put(c):
        if self.in_place:
          ref[0, :, c, :] = value(c)
        else:
          ref[:, self._lanes(c)] = value(c)
      _head_loop(self.block_heads, put)
      return
    bits = lambda x: lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)

    def put_pair(p):
      word = bits(value(2 * p)) | lax.shift_left(bits(value(2 * p + 1)), jnp.uint32(16))
      if self.value_bitcast:
        words = pltpu.bitcast(ref[...], jnp.uint32)
        words = lax.dynamic_update_index_in_dim(words, word[None, :, None, :], p, 2)
        ref[...] = pltpu.bitcast(words, ref.dtype)
      else:
        ref.bitcast(jnp.uint32)[0, :, p, :] = word
    _head_loop(self.block_heads // 2, put_pair)


def _head_loop(n: int, body):
  """Runs ``body(h)`` for ``h`` in ``range(n)`` (traced) in a loop the compiler keeps rolled."""
  def step(h, carry):
    body(h)
    return carry
  lax.fori_loop(jnp.int32(0), jnp.int32(n), step, 0)  # (int32 indices under x64 too)


class _Heads(NamedTuple):
  """How programs tile the head axes (static).

  Query head block ``j`` holds heads ``[j * hb, (j + 1) * hb)``; their kv heads lie in kv block
  ``j // per_kv`` (of ``hk`` heads), whose ``per_kv = group * hk / hb`` query head blocks are
  told apart by their rank ``j % per_kv``.
  """

  q: _View  # query-side operands (q, o, do, dq)
  kv: _View  # kv-side operands (k, v, dk, dv)
  group: int  # query heads per kv head (N // K)

  @staticmethod
  def of(q, k, interpret) -> "_Heads":
    """The tiling of q ``[B, T, N, H]`` against k ``[B, S, K, H]``."""
    n, kv_heads, h = q.shape[2], k.shape[2], q.shape[3]
    return _Heads(_View.of(n, h, q.dtype, interpret), _View.of(kv_heads, h, k.dtype, interpret),
                  n // kv_heads)

  @property
  def hb(self) -> int:  # query heads per program: 8, or N when N % 8
    return self.q.block_heads

  @property
  def hk(self) -> int:  # kv heads per kv block: 8, or K when K % 8
    return self.kv.block_heads

  @property
  def per_kv(self) -> int:
    return self.group * self.hk // self.hb

  def kv_block(self, j):
    return lax.div(j, jnp.asarray(self.per_kv, j.dtype))

  def rank(self, j):
    return lax.rem(j, jnp.asarray(self.per_kv, j.dtype))

  def head_block(self, kv_block, rank):
    """Inverse of ``(kv_block, rank)``: the query head block."""
    return kv_block * jnp.asarray(self.per_kv, kv_block.dtype) + rank

  def kv_head(self, rank, h):
    """Index inside its kv block of the kv head of query head ``h`` (traced) of a query head
    block of this rank."""
    return lax.div(rank * self.hb + h, jnp.asarray(self.group, h.dtype))


class _Info(NamedTuple):
  """Token info, dense mask, bias, ALiBi and dropout keys: arrays, BlockSpecs or kernel refs.

  Query-side vectors are ``[., Tp, 1]`` (blocks ``(bq, 1)``), key-side ones ``[., 1, Sp]``
  (blocks ``(1, bk)``); per-head arrays carry their head axis (1 or N) second, in blocks of the
  program's ``hb`` heads (``head(ref, h)`` reads head ``h``). None where absent.
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


def _head(ref, h: int, keys=slice(None)):
  """Head ``h`` of a per-head block (a broadcast head axis has one), its ``keys`` columns."""
  return None if ref is None else ref[h if ref.shape[0] > 1 else 0, :, keys]


def _info_arrays(ops) -> _Info:
  col = lambda x: None if x is None else x[:, :, None]
  row = lambda x: None if x is None else x[:, None, :]
  drop = ops.dropout
  return _Info(col(ops.q_info.positions), row(ops.kv_info.positions),
               col(ops.q_info.segment_ids), row(ops.kv_info.segment_ids),
               None if ops.dense is None else ops.dense.astype(jnp.int8), ops.bias,
               None if ops.alibi is None else ops.alibi[..., None],
               None if drop is None else drop.rows[..., None], None if drop is None else row(drop.cols))


def _info_specs(arrays: _Info, bq, bk, hb, q_block, k_block, head_block):
  """BlockSpecs for ``_info_arrays``; ``q_block`` / ``k_block`` / ``head_block`` map grid ids
  (and the prefetched lists) to the q block, kv block and query head block."""

  def qspec(x):
    if x is None:
      return None
    return pl.BlockSpec((None, bq, 1), lambda *a: (common.sel(x.shape[0], a[0]), q_block(*a), 0))

  def kspec(x):
    if x is None:
      return None
    return pl.BlockSpec((None, 1, bk), lambda *a: (common.sel(x.shape[0], a[0]), 0, k_block(*a)))

  def head_spec(x, rows, cols, row_block, col_block):
    if x is None:
      return None
    bm, nm = x.shape[:2]
    return pl.BlockSpec((None, hb if nm > 1 else 1, rows, cols), lambda *a: (
        common.sel(bm, a[0]), common.sel(nm, head_block(*a)), row_block(*a), col_block(*a)))

  zero = lambda *_: 0
  a = arrays
  return list(_Info(qspec(a.qpos), kspec(a.kpos), qspec(a.qseg), kspec(a.kseg),
                    head_spec(a.dense, bq, bk, q_block, k_block),
                    head_spec(a.bias, bq, bk, q_block, k_block),
                    head_spec(a.alibi, 1, 1, zero, zero),
                    head_spec(a.rows, bq, 1, q_block, zero), kspec(a.cols)))


def _tile(cfg, info: _Info, h, s, k0, keys, masked):
  """Adds head ``h``'s bias / ALiBi to logits ``s [bq, bk]`` of the tile's ``keys`` (a slice of
  its key block, whose first key is key ``k0`` of the shard), sets its invisible entries to
  ``NEG_INF`` when ``masked`` (traced: the tile is PARTIAL), and draws its dropout keep.

  The mask is one ``lax.cond`` inside the shared body rather than a second copy of the body
  for PARTIAL tiles: each copy of the body is most of a kernel's compile time.

  Returns:
    ``(s, keep)``; ``keep`` None without dropout.
  """
  cols = lambda r: None if r is None else r[:, keys]  # (1, bk) key-side vectors
  q_pos, k_pos = info.qpos[...], cols(info.kpos)
  s = common.score_terms(s, _head(info.bias, h, keys), _head(info.alibi, h), q_pos, k_pos)

  def mask(s):
    k_index = jax.lax.broadcasted_iota(jnp.int32, (1, s.shape[1]), 1) + k0
    vis = common.tile_visible(cfg, q_pos, k_pos, k_index,
                              None if info.qseg is None else info.qseg[...], cols(info.kseg),
                              _head(info.dense, h, keys))
    return jnp.where(vis, s, common.NEG_INF)

  s = lax.cond(masked, mask, lambda s: s, s)
  keep = None
  if cfg.dropout_rate:
    keep = common.dropout_keep(cfg.dropout_rate, _head(info.rows, h), cols(info.cols))
  return s, keep


class _RowStats:
  """How ``[B, N, Tp]`` float32 row statistics (lse, delta) travel through the kernels.

  Lane-dense ``[B, N, 1, Tp]`` with ``(hb, 1, bq)`` blocks when the query tile is a multiple of
  128 (converted to and from the kernels' ``(bq, 1)`` columns by a transpose), else
  ``[B, N, Tp, 1]`` with ``(hb, bq, 1)`` blocks, whose unit minor axis XLA pads to 128 lanes in
  HBM (128x the bytes).
  """

  def __init__(self, bq: int, hb: int):
    self.bq, self.hb, self.dense = bq, hb, bq % LANES == 0

  def to_kernel(self, x):
    return x[:, :, None, :] if self.dense else x[..., None]

  def from_kernel(self, x):
    return x[:, :, 0, :] if self.dense else x[..., 0]

  def shape(self, b, n, tp):
    return (b, n, 1, tp) if self.dense else (b, n, tp, 1)

  def spec(self, where):
    """BlockSpec of the rows ``where(*grid ids) = (batch, head block, q block)`` selects."""
    if self.dense:
      return pl.BlockSpec((None, self.hb, 1, self.bq),
                          lambda *a: (*where(*a)[:2], 0, where(*a)[2]))
    return pl.BlockSpec((None, self.hb, self.bq, 1), lambda *a: (*where(*a), 0))

  def load(self, ref, h: int):
    """Head ``h``'s rows as a ``(bq, 1)`` column."""
    x = ref[h]
    return jnp.broadcast_to(x, (LANES, self.bq)).T[:, :1] if self.dense else x

  def store(self, ref, h: int, column):
    """Writes head ``h``'s ``(bq, 1)`` column."""
    ref[h] = jnp.broadcast_to(column, (self.bq, LANES)).T[:1, :] if self.dense else column


# ------------------------------------------------------------------------------ VMEM budget --
#
# A program's VMEM is measured from the grid spec it is called with (``_pass_vmem``): every
# pipelined block (double-buffered), every scratch buffer and the body's temporaries, so a buffer
# added to a kernel is counted without anyone updating an estimate. It is checked against the
# VMEM of the chip being compiled for (``_chip``); tiles that do not fit are split
# (``_fit``) before Mosaic would fail with "Ran out of memory in memory space vmem".

# VMEM of a chip that cannot be named while tracing (lowering for "tpu" with neither a mesh nor a
# sharding): the least of the TPU generations (v2-v4: 16 MiB per TensorCore), so the program
# fits every chip.
LEAST_VMEM_BYTES = 16 * 2**20
# VMEM that Mosaic takes besides the measured buffers (its internal scratch, sublane replication
# temporaries; 44 KiB measured on v4) plus a margin for the body's temporaries, whose
# register-allocator spills ``_body_bytes`` estimates.
VMEM_RESERVE_BYTES = 1 * 2**20
# Float32 ``[bq, key chunk]`` temporaries of a body that live at once (logits, probabilities,
# dP, dS; the compiler spills them to VMEM): measured 1.3 MiB for the forward at 512 x 256 on v4
# (2.5 of them).
BODY_TEMPORARIES = {"fwd": 4, "dq": 6, "dkv": 6}


class _Vmem(NamedTuple):
  """VMEM bytes of one program and the chip's capacity."""

  blocks: int  # pipelined blocks of the inputs and outputs, double-buffered
  scratch: int  # scratch buffers (row statistics, output rows, staged heads)
  body: int  # the body's temporaries (``_body_bytes``)
  capacity: int  # VMEM of the chip being compiled for (``_chip``)
  chip: str  # its device kind, or how the capacity was chosen

  @property
  def total(self) -> int:
    return self.blocks + self.scratch + self.body + VMEM_RESERVE_BYTES

  def fits(self) -> bool:
    return self.total <= self.capacity

  def describe(self) -> str:
    mib = lambda x: f"{x / 2**20:.2f} MiB"
    return (f"{mib(self.total)} (blocks {mib(self.blocks)}, scratch {mib(self.scratch)}, body "
            f"{mib(self.body)}, reserve {mib(VMEM_RESERVE_BYTES)}) of {self.chip}'s "
            f"{mib(self.capacity)}")


def _tile_bytes(shape, dtype) -> int:
  """Bytes of a VMEM buffer: the minor axis padded to 128 lanes, the second-minor to 8
  sublanes (a unit second-minor axis stays one row)."""
  dims = [1 if d is None or not isinstance(d, int) else d for d in shape] or [1]
  dims[-1] = backend.round_up(dims[-1], LANES)
  if len(dims) > 1 and dims[-2] > 1:
    dims[-2] = backend.round_up(dims[-2], 8)
  n = 1
  for d in dims:
    n *= d
  return n * jnp.dtype(dtype).itemsize


def _chip(like) -> tuple[Optional[int], str]:
  """``(VMEM bytes, device kind)`` of the chip a computation is traced for: the abstract mesh's
  or the default device's (``pltpu.get_tpu_info()``), else that of the mesh of ``like``'s
  sharding (an operand of a program compiled for a TPU topology from another host); None when
  neither names a TPU."""
  try:
    return pltpu.get_tpu_info().vmem_capacity_bytes, _asked_kind()
  except (ValueError, NotImplementedError, AttributeError):
    pass
  mesh = getattr(getattr(jax.typeof(like), "sharding", None), "mesh", None)
  device = getattr(mesh, "abstract_device", None)
  if device is not None and device.platform == "tpu":
    try:
      with jax.sharding.use_abstract_mesh(mesh):
        return pltpu.get_tpu_info().vmem_capacity_bytes, device.device_kind
    except (ValueError, NotImplementedError):  # pragma: no cover - a TPU JAX does not know
      pass
  return None, "an unnamed TPU"


def _asked_kind() -> str:
  """The device kind ``pltpu.get_tpu_info()`` answers for (the abstract mesh's, else the
  default device's)."""
  abstract = jax.sharding.get_abstract_mesh().abstract_device
  return abstract.device_kind if abstract is not None else jax.devices()[0].device_kind


def _pass_vmem(p: _Pass, capacity: tuple[int, str]) -> _Vmem:
  """The VMEM of ``p``'s programs, from the grid spec of its first call."""
  grid_spec, _ = _call_spec(p, *p.ranges[0], [] if p.acc is None else list(p.acc))
  arrays = [a for a in p.args if a is not None] + list(p.acc or [])
  specs = [s for s in grid_spec.in_specs if s is not None]
  assert len(specs) == len(arrays), (len(specs), len(arrays))
  outs = list(zip(jax.tree.leaves(grid_spec.out_specs), p.out_shape))

  def window(spec, array):
    if spec.memory_space == pl.ANY or spec.block_shape is None:
      return 0
    return 2 * _tile_bytes(spec.block_shape, array.dtype)

  blocks = sum(window(s, a) for s, a in list(zip(specs, arrays)) + outs)
  scratch = sum(_tile_bytes(x.shape, x.dtype) for x in grid_spec.scratch_shapes)
  return _Vmem(blocks, scratch, p.body_bytes, *capacity)


def _body_bytes(cfg, which: str, bq: int, bk: int) -> int:
  """The body's float32 temporaries: ``BODY_TEMPORARIES[which]`` arrays of ``bq`` rows by one
  key chunk (``_key_chunks``)."""
  return BODY_TEMPORARIES[which] * bq * _chunk(cfg, bk) * 4


def _refine(plan, fq: int, fk: int):
  """The plan of tiles ``fq`` times fewer queries and ``fk`` times fewer keys: each tile's
  class repeated over its parts (sound: a part of a FULL tile is full, of an EMPTY one empty,
  and a PARTIAL tile's parts apply the elementwise mask)."""
  if fq == fk == 1:
    return plan
  cls = jnp.repeat(jnp.repeat(jnp.asarray(plan.block_class), fq, axis=2), fk, axis=3)
  return block_sparse._plan_of_classes(cls)  # pylint: disable=protected-access


def _fit(make, plan, bq: int, bk: int, cfg, like, which: str):
  """The pass ``make(plan, bq, bk)`` with tiles that fit the chip's VMEM: halving the query or
  the key tile (whichever frees more) with the plan refined to match, down to 128 x 128. The
  chip is ``_chip``'s, else one of ``LEAST_VMEM_BYTES``; interpret mode on a host that names no
  TPU runs the tiles as given.

  Raises:
    ValueError: when 128 x 128 tiles do not fit either (naming the pass, its VMEM and the fix).
  """
  p = make(plan, bq, bk)
  capacity = _chip(like)
  if capacity[0] is None:
    if cfg.interpret:  # (on CPU: no chip to fit)
      return p, None
    capacity = (LEAST_VMEM_BYTES, f"{capacity[1]} (assumed {LEAST_VMEM_BYTES // 2**20} MiB)")
  q0, k0 = bq, bk
  vmem = _pass_vmem(p, capacity)
  while not vmem.fits():
    options = [(q, k) for q, k in ((bq // 2, bk), (bq, bk // 2))
               if q >= 128 and k >= LANES and q % 8 == 0 and k % LANES == 0]
    if not options:
      raise ValueError(
          f"pallas_tpu {which} pass ({p.name}) needs {vmem.describe()} with block_q={bq}, "
          f"block_kv={bk} (from {q0} x {k0}): it cannot fit. Use fewer heads per kv head "
          "group, a smaller head dim, or backend='xla'.")
    trials = [(make(_refine(plan, q0 // q, k0 // k), q, k), q, k) for q, k in options]
    sized = [(_pass_vmem(t, capacity), t, q, k) for t, q, k in trials]
    vmem, p, bq, bk = min(sized, key=lambda x: (x[0].total, -x[3]))
  return p, vmem


def _params(vmem: Optional[_Vmem]):
  """Compiler params; the scoped VMEM limit is raised (up to the chip's capacity) when a
  program needs more than the compiler's default (16 MiB on v4 and v5e)."""
  limit = None
  if vmem is not None and vmem.total > 12 * 2**20:
    limit = min(vmem.capacity, int(vmem.total * 1.25))
  return pltpu.CompilerParams(
      dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
      vmem_limit_bytes=limit)


def _staging(dtype, h, *rows):
  """Scratch for one head's tiles of ``rows`` rows each, read through ``_View.staged``."""
  return [pltpu.VMEM((r, h), dtype) for r in rows]


# ----------------------------------------------------------------------------------- forward --

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

    def chunk(keys, offset):
      s = _capped_logits(cfg, q, k_at(keys))
      s, keep = _tile(cfg, info, h, s, k_block * cfg.block_kv + offset, keys, masked)
      m_prev = m_sc[h]  # [bq, 128]
      m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
      # Rows with nothing visible yet keep m = NEG_INF: subtracting 0 there makes their masked
      # entries exp(NEG_INF) = 0 (not exp(0) = 1).
      p = jnp.exp(s - jnp.where(m_new == common.NEG_INF, 0.0, m_new)[:, :1])
      alpha = jnp.exp(m_prev - m_new)
      l_sc[h] = alpha * l_sc[h] + jnp.sum(p, axis=1, keepdims=True)
      pv = p if keep is None else jnp.where(keep, p, 0.0)
      v = v_at(keys)
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

  p, vmem = _fit(make, block_sparse.merge_heads(plan, heads.hb), cfg.block_q, cfg.block_kv, cfg,
                 q, "forward")
  o, lse = _chained_call(p, vmem)
  stats = p.kernel.keywords["stats"]
  return common.merged(acc, heads.q.unview(o), stats.from_kernel(lse))


# ---------------------------------------------------------------------------------- backward --

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
  fit = lambda make, which: _fit(make, plan, cfg.block_q_bwd, cfg.block_kv_bwd, cfg, q, which)
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
  info: "_Info"  # token info, dense mask, bias, ALiBi, dropout keys (``_info_arrays``)
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


class TpuBackend(backend.Backend):
  """Pallas through Mosaic on TPU: every feature; Mosaic's (8, 128) tile rule."""

  name = "pallas_tpu"
  platform = "tpu"
  variants_cls = Variants

  def default_block_sizes(self, head_dim, device_kind, dtype=None):
    kind = device_kind.lower()
    if any(f"v{g}" in kind for g in (2, 3, 4)):  # 16 MiB of VMEM: 8-head programs need less
      # (4-byte kernels, which float16 inputs run too, need half the keys per tile there.)
      wide = dtype is not None and _compute_dtype(dtype).itemsize > 2
      return BlockSizes(256, 256 if wide else 512, 128, 256, None, None)
    big = "v6" in kind or "v5p" in kind
    # Above head dim 128 a 256-row query tile: the body's vector code grows with the query tile
    # times the head dim (the float32 output rows), and with 512 rows the forward compiled in
    # 2.5-2.9x splash's time (BENCHMARKS.md, "Compile time against splash attention").
    return BlockSizes(512 if head_dim <= 128 else 256, 1024 if big else 512, 256, 512, None,
                      None)

  def block_size_error(self, field, value):
    unit = LANES if "kv" in field else 8
    if value % unit:
      return (f"TPU tiles must be multiples of {unit} ({'lanes' if unit == LANES else 'sublanes'}"
              f"; Mosaic's (8, 128) rule). Use {backend.round_up(value, unit)}, or None for the "
              "default.")
    return None

  def tile_caps(self, q_len, kv_len):
    cap_k = backend.round_up(kv_len, LANES)
    return backend.round_up(q_len, 8), cap_k, cap_k

  def padded_head_dim(self, head_dim):
    # Heads are sliced out of lane blocks where they are not a multiple of 8: H is a multiple of
    # 128 lanes (no padding for H = 128, 256).
    return backend.round_up(head_dim, LANES)

  def tuning_candidates(self, head_dim, interpret):
    sizes = [128, 256] if interpret else [256, 512, 1024]
    return {"fwd": [dict(block_q=q, block_kv=k) for q in sizes for k in sizes],
            "bwd": [dict(block_q_bwd=q, block_kv_bwd=k) for q in sizes for k in sizes]}

  forward = staticmethod(forward)
  backward = staticmethod(backward)


BACKEND = TpuBackend()
