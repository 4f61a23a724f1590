"""How the TPU kernels see their operands: head blocks of ``[B, L, heads, H]`` arrays (in
place or as lane blocks), the interpreter's bitcast paths, and the row statistics' layout."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
from typing import NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

LANES = 128
HEAD_BLOCK = 8  # heads per program: one (8, 128) tile's rows of [B, L, heads, H]
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_TN = (((0,), (0,)), ((), ()))  # a.T @ b


def _plain(interpret) -> bool:
  """Whether ``interpret`` (``KernelConfig.interpret``) is plain interpret mode (True), which
  differs from Mosaic: it has no ref bitcast and computes float16 as given. JAX's TPU interpreter
  (``pltpu.InterpretParams``) and compiled kernels take the hardware's code paths."""
  return bool(interpret) and not dataclasses.is_dataclass(interpret)


def _value_bitcast(interpret) -> bool:
  """Whether 8/16-bit in-place blocks are bitcast as values rather than as refs: in plain
  interpret mode, and in JAX's TPU interpreter where it cannot read through a ref bitcast
  (``_interprets_ref_bitcast``)."""
  if not interpret:
    return False
  return _plain(interpret) or not _interprets_ref_bitcast(interpret)


@functools.cache
def _interprets_ref_bitcast(params) -> bool:
  """Whether JAX's TPU interpreter with ``params`` runs the in-place views' ref bitcast (those
  of JAX 0.10.2 and 0.11.2 do not: "'BitcastTransform' object has no attribute 'indices'"; the
  compile matrix lowers it through Mosaic for every generation): a probe kernel
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

  In place (``heads % 8 == 0`` and an 8-, 16- or 32-bit dtype): ``(rows, 8, H)`` blocks of the
  array as it is; head ``c`` is a sublane-strided row set. Mosaic cannot index the packed rows
  of a 16-bit block by a traced head, so 16-bit blocks are read as ``uint32`` words holding heads
  ``(2c, 2c + 1)`` (low, high half; Pallas TPU's bitcast of the second-minor axis) and the half is
  picked by a shift; 8-bit blocks (an FP8 cache, read only) hold 4 heads a word. Otherwise the
  operand is viewed as ``[B, L, heads * H]`` with ``(rows, block_heads * H)`` lane blocks: XLA
  relayouts the array once (its TPU tiling is ``(heads, H)``), and head ``c`` is a 128-aligned
  lane slice.
  """

  in_place: bool
  block_heads: int
  head_dim: int
  value_bitcast: bool  # plain interpret mode has no ref bitcast: the block is bitcast as a value

  @staticmethod
  def of(heads: int, head_dim: int, dtype, interpret) -> "_View":
    in_place = heads % HEAD_BLOCK == 0 and jnp.dtype(dtype).itemsize in (1, 2, 4)
    return _View(in_place, HEAD_BLOCK if in_place else heads, head_dim,
                 in_place and jnp.dtype(dtype).itemsize < 4 and _value_bitcast(interpret))

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
    """An 8/16-bit in-place ``(1, rows, heads, H)`` block as ``uint32 (1, rows, heads / per,
    H)`` words, ``per`` heads a word (a value in plain interpret mode, a ref otherwise)."""
    if self.value_bitcast:
      return pltpu.bitcast(ref[...], jnp.uint32)
    return ref.bitcast(jnp.uint32)

  def get(self, ref, c, rows=slice(None)):
    """Head ``c`` (traced) of a block: ``(rows, H)`` (its ``rows``, a slice, when given)."""
    if not self.in_place:
      return ref[rows, self._lanes(c)]
    size = ref.dtype.itemsize
    if size == 4:
      return ref[0, rows, c, :]
    per = jnp.asarray(4 // size, c.dtype)  # heads a 32-bit word: 2 (16-bit), 4 (8-bit: FP8)
    words = self._words(ref)[0, rows, lax.div(c, per), :]
    part = lax.shift_right_logical(words, lax.rem(c, per).astype(jnp.uint32) * (8 * size))
    return lax.bitcast_convert_type(part.astype(jnp.dtype(f"uint{8 * size}")), ref.dtype)

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
      scratch[rows, :] = self.get(ref, c, rows).astype(scratch.dtype)  # (FP8: widened here)
      return carry

    lax.fori_loop(jnp.int32(0), jnp.int32(n // group), step, 0)
    return lambda rows=slice(None): scratch[rows, :]

  def put_all(self, ref, scratch, scale=None, add=None):
    """Writes float32 head-major ``scratch [heads, rows, H]`` (times ``scale``, plus the same
    block of ``add``, an accumulator ref, when given) into a block."""

    assert ref.dtype.itemsize in (2, 4) or not self.in_place, ref.dtype  # (no 8-bit output)

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
