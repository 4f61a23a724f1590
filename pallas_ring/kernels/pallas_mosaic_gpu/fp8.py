"""The forward's FP8 mode: ``q.k^T`` and ``p.v`` as FP8 wgmmas (float32 accumulation).

wgmma reads 8-bit operands K-major only. ``q`` and ``k`` are already (H is their minor axis).
``v`` is not: ``v_layout`` transposes it once in XLA to ``[B, K, Hv, S]``, so that a tile
``[Hv, bk]`` read as its transpose is the K-major ``[bk, Hv]`` operand.

``p`` stays in registers. A float32 accumulator holds, per 16 columns of a row, columns
``2j, 2j+1, 2j+8, 2j+9`` in thread ``j`` of the row's quad; wgmma's 8-bit A operand wants
``4j .. 4j+3`` there. ``a_operand`` relabels the registers instead of moving them, which permutes
the keys of every 16 by ``KEY_ORDER``; ``v_layout`` applies the same permutation to v's keys, and
``p.v`` sums over keys, so the product is unchanged (FlashAttention-3 moves bytes in registers
instead).

``p`` is at most 1 before quantization; the softmax scales it by ``2 ** P_LOG2`` (a shift of the
row max, which the lse undoes) so that small probabilities keep FP8's normal range.

Descales (``common.Operands.fp8``, float32 ``[Bs, N, 3]``: q's, k's and v's per batch row and
query head) multiply the logits' scale and the output's normalisation (``descales``).
"""

from __future__ import annotations

from jax import lax
import jax.numpy as jnp
from jaxlib.mlir import ir
import numpy as np
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax.experimental.mosaic.gpu import fragmented_array as fa
from jax.experimental.mosaic.gpu import utils as mgpu_utils

from pallas_ring.kernels import common

# The keys of each 16 in the order a relabelled p holds them (module docstring).
KEY_ORDER = np.array([0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15])
# p is scaled by 2 ** P_LOG2 before quantization: at most 256, below e4m3's 448 and e5m2's 57344.
P_LOG2 = 8.0


def is_fp8(dtype) -> bool:
  """Whether the kernel's inputs of ``dtype`` run its FP8 mode."""
  return jnp.dtype(dtype).itemsize == 1


def v_layout(v):
  """``v [B, S, K, Hv]`` as the FP8 forward reads it: ``[B, K, Hv, S]``, the keys of every 16
  in ``KEY_ORDER`` (S is a multiple of the key tile): key ``8h + 2j + l`` of a 16 (h, l < 2,
  j < 4) goes to ``4j + 2h + l``, one transpose."""
  b, s, k, hv = v.shape
  assert s % 16 == 0, f"v's {s} keys are not a multiple of 16: pad them to the key tile"
  x = v.reshape(b, s // 16, 2, 4, 2, k, hv)  # [B, S/16, h, j, l, K, Hv]
  return jnp.transpose(x, (0, 5, 6, 1, 3, 2, 4)).reshape(b, k, hv, s)


def v_source(v_ref, batch, keys, kv_head, fp8: bool):
  """The global-memory tile of ``keys`` of one kv head's v: ``[bk, Hv]``, or in FP8 mode
  ``[Hv, bk]`` (``v_layout``)."""
  return v_ref.at[batch, kv_head, :, keys] if fp8 else v_ref.at[batch, keys, kv_head]


def v_operand(v_tile, fp8: bool):
  """The B operand ``[bk, Hv]`` of ``p.v`` from a v tile in shared memory (``v_source``'s)."""
  return v_tile.transpose((1, 0)) if fp8 else v_tile


def p_tile(p, dtype):
  """Float32 probabilities ``p [bq, bk]`` (the accumulator's layout) as the walk holds them
  until their ``p.v``: in ``dtype`` (16-bit), or in FP8 as int8 bits (loops carry those; they
  cannot carry FP8 registers)."""
  p = p.astype(dtype)
  return lax.bitcast_convert_type(p, jnp.int8) if is_fp8(dtype) else p


def p_tile_dtype(dtype):
  """The dtype of ``p_tile``'s result."""
  return jnp.int8 if is_fp8(dtype) else dtype


def a_operand(p, dtype):
  """The A operand of ``p.v`` from ``p_tile``'s ``p``: as it is (16-bit), or FP8 relabelled
  for wgmma's 8-bit operand (module docstring)."""
  if not is_fp8(dtype):
    return p
  shape = p.shape

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,),
                     return_type=plgpu.ShapeDtypeStruct(shape, dtype,
                                                        layout=plgpu.Layout.WGMMA_8BIT))
  def relabel(_, x):
    # Register (.., c, .., r, ..) holds columns 8c + 2j + {0, 1}; the 8-bit layout's register
    # (.., c, .., r, ..) holds 16c + 4j + {0, 1, 2, 3}: two neighbours concatenated.
    regs, f8 = x.registers, mgpu_utils.dtype_to_ir_type(dtype)
    out = np.empty(fa.WGMMA_LAYOUT_8BIT.registers_shape(shape), dtype=object)
    for idx in np.ndindex(out.shape):
      pair = [regs[(idx[0], 2 * idx[1] + i, *idx[2:])] for i in range(2)]
      out[idx] = mgpu_utils.bitcast(mgpu_utils.vector_concat(pair), ir.VectorType.get((4,), f8))
    return fa.FragmentedArray(_registers=out, _layout=fa.WGMMA_LAYOUT_8BIT, _is_signed=None)

  return relabel(p)


def a_layout(dtype):
  """The register layout of ``a_operand``'s result."""
  return plgpu.Layout.WGMMA_8BIT if is_fp8(dtype) else plgpu.Layout.WGMMA


def row_max_shift(dtype) -> float:
  """What the softmax subtracts from a row's base-2 max: ``P_LOG2`` in FP8 mode, else 0."""
  return P_LOG2 if is_fp8(dtype) else 0.0


def descales(ref, batch, head):
  """``(logit, out)`` float32 scalars of (batch, head): the factor of the raw ``q.k`` (q's times
  k's descale) and of the output (v's); ``(None, None)`` without FP8 descales."""
  if ref is None:
    return None, None
  b = common.sel(ref.shape[0], batch)
  return ref[b, head, 0] * ref[b, head, 1], ref[b, head, 2]


__all__ = ["KEY_ORDER", "P_LOG2", "is_fp8", "v_layout", "v_source", "v_operand", "p_tile",
           "p_tile_dtype", "a_operand", "a_layout", "row_max_shift", "descales"]
