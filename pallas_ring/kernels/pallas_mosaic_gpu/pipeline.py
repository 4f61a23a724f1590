"""The warp-specialized pipeline's pieces shared by the Mosaic GPU kernels: shared-memory tiles
and slots, token-info rows, register liveness, and the consumers' schedule (named barriers,
meetings, ping-pong)."""

from __future__ import annotations

import enum
import inspect

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
import jax.experimental.pallas.mosaic_gpu as plgpu
try:  # an accumulator read that waits for all but the last ``wait_n`` wgmmas (plgpu's indexing
  # waits for all); not exported by plgpu in JAX 0.10 and 0.11
  from jax._src.pallas.mosaic_gpu.primitives import wgmma_accumulator_load
except ImportError:  # a JAX without it: the forward keeps the serial walk (``tiles.overlaps``)
  wgmma_accumulator_load = None
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm

from pallas_ring.kernels import common

# Layouts of a wgmma accumulator's row and column vectors.
ROWS, COLS = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)


# JAX 0.11 deprecated load's separate index argument that 0.10 requires.
_LOAD_NEEDS_INDEX = (inspect.signature(plgpu.load).parameters["idx"].default
                     is inspect.Parameter.empty)


def load_ref(ref, layout, optimized=True):
  """The whole of a ref as an array in ``layout`` (``optimized=False`` for an untiled one)."""
  if _LOAD_NEEDS_INDEX:
    return plgpu.load(ref, (), layout=layout, optimized=optimized)
  return plgpu.load(ref, layout=layout, optimized=optimized)


def slot_of(step, slots: int):
  """The ring slot of a kv step (in the step's own integer dtype, also under x64)."""
  return lax.rem(step, jnp.asarray(slots, step.dtype))


def step_index(index, start, on: bool):
  """A consumer's loop-invariant index of its own shared-memory tiles (its warpgroup index) made
  to depend on a walked tile's ``start`` (>= 0 at run time, which LLVM cannot know), so that refs
  indexed by it are re-derived in each step: otherwise LLVM hoists the wgmma descriptors of every
  k-step of those tiles out of the main loop, 64 bits each, and ptxas spills them
  (``Variants.step_refs``; ``on=False``: ``index`` itself)."""
  return index + jnp.minimum(start, 0) if on else index


def row_vector(x, rows: int):
  """``[rows]`` float32 vector in the layout of a wgmma accumulator's rows."""
  return plgpu.layout_cast(jnp.full((rows,), x, jnp.float32), ROWS)


def swizzled_smem(dtype, *shape):
  """A shared-memory tile in wgmma's swizzled layout: 128-byte swizzles, or 64-byte ones where
  rows are not a multiple of 128 bytes (FP8 rows of 64 or 192 columns)."""
  itemsize = jnp.dtype(dtype).itemsize
  row = shape[-1] * itemsize
  assert row % 64 == 0, f"rows of {row} bytes: wgmma tiles need a multiple of 64"
  swizzle = 128 if row % 128 == 0 else 64
  return plgpu.SMEM(shape, dtype, transforms=(
      plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)))


def broadcast_info(ref, layout, shape, dim, info_rows):
  """Token-info rows (positions, then segment ids) of a tile, broadcast to ``shape``."""
  return [lax.broadcast_in_dim(load_ref(ref.at[f], layout), shape, [dim]) for f in range(info_rows)]


def head_view(ref, batch, head):
  """The (batch, head) slice of a ``[Bx, Nx, ...]`` input whose leading axes may be broadcast
  (size 1: index 0): plan lists, dropout row keys, the tile term."""
  return ref.at[common.sel(ref.shape[0], batch), common.sel(ref.shape[1], head)]


def token_info(info) -> jax.Array:
  """int32 ``[Bi, F, L]``: positions, then segment ids when present (one TMA copy per tile)."""
  if info.segment_ids is None:
    return info.positions[:, None]
  b = info.segment_ids.shape[0]
  pos = jnp.broadcast_to(info.positions, (b, info.positions.shape[-1]))
  return jnp.stack([pos, info.segment_ids], axis=1)


KEEP_ALIVE = "// p.v's A operand stays live until here"  # (a PTX comment)


def keep_alive(x, layout=plgpu.Layout.WGMMA):
  """Keeps the registers of ``x`` (a wgmma A operand in ``layout``, 32-bit registers) live until
  this point, so that the compiler does not reuse them while an asynchronous wgmma still reads
  them (ptxas would then serialize every wgmma of the kernel, C7513)."""

  @plgpu.inline_mgpu(arg_types=(layout,))
  def emit(_, arr):
    i32 = ir.IntegerType.get_signless(32)
    regs = [llvm.bitcast(i32, r) if layout == plgpu.Layout.WGMMA else mgpu_utils.bitcast(r, i32)
            for r in arr.registers.flat]
    llvm.inline_asm(ir.Type.parse("!llvm.void"), regs, KEEP_ALIVE, ",".join(["r"] * len(regs)),
                    has_side_effects=True)

  emit(x)


# The forward's consumers schedule their matmuls on two hardware ("named") barriers, id
# ``NamedBarrier.SCHEDULE + w`` for consumer warpgroup w: faster than meeting at a
# shared-memory barrier. The backward's meetings measured slower on hardware barriers, so they
# stay on shared-memory ones (``meet``; BENCHMARKS.md, "Kernel rules").


class NamedBarrier(enum.IntEnum):
  """Hardware ("named") barrier ids of the kernels; Mosaic GPU itself uses 0 to 3 (0, and 1 +
  warpgroup index)."""

  SCHEDULE = 4  # the forward consumers' matmul order: SCHEDULE + w for consumer warpgroup w


def schedule_bar(op: str, whose: str):
  """``bar.<op>`` (``"sync"`` or ``"arrive"``) of both consumers' 256 threads on this
  warpgroup's (``whose="own"``) or the other consumer's (``"other"``) schedule barrier."""

  @plgpu.inline_mgpu()
  def emit(_):
    i32 = ir.IntegerType.get_signless(32)
    wg = mgpu_utils.warpgroup_idx(sync=True)
    bar = (arith.addi(mgpu_utils.c(int(NamedBarrier.SCHEDULE), i32), wg) if whose == "own" else
           arith.subi(mgpu_utils.c(int(NamedBarrier.SCHEDULE) + 1, i32), wg))
    llvm.inline_asm(ir.Type.parse("!llvm.void"), [bar], f"bar.{op} $0, 256;", "r",
                    has_side_effects=True)

  emit()


def mark_issued():
  """A forward consumer has issued its step's first matmul (in the overlapped walk: both): the
  other may issue its next."""
  schedule_bar("arrive", "other")


def wait_to_issue():
  """Waits until the other forward consumer has issued its matmuls (``mark_issued``), so that this
  one's follow them on the tensor cores."""
  schedule_bar("sync", "own")


def meet(sched):
  """Both consumer warpgroups wait until both arrive at the 2-arrival barrier ``sched``."""
  plgpu.barrier_arrive(sched)
  plgpu.barrier_wait(sched)


def pingpong(loop, before, after):
  """Runs a consumer's ``loop()`` offset by half a step from the other warpgroup's, so one's
  elementwise work overlaps the other's matmuls: warpgroup 1 calls ``before()`` first,
  warpgroup 0 ``after()`` last (both walk the same tiles)."""
  wg = lax.axis_index("wg")
  pl.when(wg == 1)(before)
  out = loop()
  pl.when(wg == 0)(after)
  return out
