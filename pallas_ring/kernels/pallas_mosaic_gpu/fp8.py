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

The backward (``backward_operands``) runs the products that read q, k, v and dO K-major in FP8:
``q.k^T`` and ``dO.v^T`` in both kernels, and the dK/dV kernel's ``p^T dO`` (p^T relabelled as
above, dO in ``v_layout``). dO is quantized once per batch row and kv head. ``ds`` is not: its
products (``ds K``, ``ds^T q``) read 16-bit k and q, dequantized in XLA.
"""

from __future__ import annotations

from typing import Any, NamedTuple

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
  # (the barrier keeps XLA from fusing the transpose with v's quantization into one fusion
  # writing both layouts, several times slower: BENCHMARKS.md, "FP8 backward")
  x = lax.optimization_barrier(v).reshape(b, s // 16, 2, 4, 2, k, hv)  # [B, S/16, h, j, l, K, Hv]
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


class BwdOperands(NamedTuple):
  """What the FP8 backward reads beside FP8 q, k, v (``backward_operands``)."""

  descales: Any  # float32 [B, N, 4]: q's, k's, v's and dO's descales per query head
  do: Any  # FP8 dO [B, Tp, N, Hv]: dO.v^T (its rows)
  do_t: Any  # the same in ``v_layout``, [B, N, Hv, Tp]: the dK/dV kernel's p^T dO
  q: Any  # q dequantized, 16-bit [B, Tp, N, H]: dK = ds^T q
  k: Any  # k dequantized, 16-bit [B, Sp, K, H]: dQ = ds K
  do_wide: Any  # dO as its FP8 values stand for, float32: delta = sum(o * dO)


def backward_operands(q, k, v, do, descales, dtype) -> BwdOperands:
  """The FP8 backward's operands: ``do [B, Tp, N, Hv]`` quantized to q's FP8 dtype with one
  descale per batch row and kv head (the amax of its query heads), so that dV's sum over a
  group's heads takes one factor; q and k dequantized to the 16-bit ``dtype``."""
  b, t, n, _ = do.shape
  kv_heads, f8 = k.shape[2], q.dtype
  per_kv = common.descale_of(do.reshape(b, t, kv_heads, -1), f8)  # [B, K]: its group's heads
  scale = jnp.repeat(per_kv, n // kv_heads, axis=1)  # [B, N]
  do8 = common.quantize_with(do, scale, f8)
  all4 = jnp.concatenate([jnp.broadcast_to(descales, (b, n, 3)), scale[..., None]], axis=-1)
  q16, k16, _ = common.dequantize(q, k, v, descales, dtype)
  return BwdOperands(all4, do8, v_layout(do8), q16, k16,
                     do8.astype(jnp.float32) * scale[:, None, :, None])


def bwd_descales(ref, batch, head):
  """``(logit, dp)`` float32 scalars of (batch, query head) in the FP8 backward: the factors of
  the raw ``q.k`` and ``dO.v`` (``backward_operands``' descales)."""
  return ref[batch, head, 0] * ref[batch, head, 1], ref[batch, head, 3] * ref[batch, head, 2]


def dv_descale(ref, batch, head):
  """The factor of the FP8 backward's ``p^T dO`` sum: dO's descale over p's ``2 ** P_LOG2``."""
  return ref[batch, head, 3] * (2.0 ** -P_LOG2)


__all__ = ["KEY_ORDER", "P_LOG2", "is_fp8", "v_layout", "v_source", "v_operand", "p_tile",
           "p_tile_dtype", "a_operand", "a_layout", "row_max_shift", "descales", "BwdOperands",
           "backward_operands", "bwd_descales", "dv_descale"]
