"""Tiles of the TPU kernels: the kernel variants, key chunks inside a tile, the plan lists in
scalar memory, the calls that run one pass over row ranges, and the VMEM budget."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Optional

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_ring import block_sparse
from pallas_ring.kernels import backend, common
from pallas_ring.kernels.pallas_tpu.views import LANES

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
    # An accumulator block is read once per output block, whose index stays over the inner
    # grid axis: one buffer, not two.
    carried = ([pl.BlockSpec(s.block_shape, s.index_map, pipeline_mode=pl.Buffered(1))
                for s in grid_spec.out_specs] if p.acc is not None else
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
# The smallest query tile ``_fit`` splits to (two packed 16-bit (8, 128) tiles' rows).
MIN_BLOCK_Q = 16


class _Vmem(NamedTuple):
  """VMEM bytes of one program and the chip's capacity."""

  blocks: int  # pipelined blocks of the inputs and outputs (double-buffered unless told)
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
    buffers = 2 if spec.pipeline_mode is None else spec.pipeline_mode.buffer_count
    return buffers * _tile_bytes(spec.block_shape, array.dtype)

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
  the key tile (whichever frees more) with the plan refined to match, down to
  ``MIN_BLOCK_Q`` x 128. The
  chip is ``_chip``'s, else one of ``LEAST_VMEM_BYTES``; interpret mode on a host that names no
  TPU runs the tiles as given.

  Raises:
    ValueError: when the smallest tiles do not fit either (naming the pass, its VMEM and the fix).
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
               if (q, k) != (bq, bk) and (q == bq or q >= MIN_BLOCK_Q and q % 8 == 0) and k >= LANES
               and k % LANES == 0]
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
