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

Modules: ``views`` (head blocks, interpreter paths, row statistics), ``info`` (token info and
score terms), ``tiles`` (variants, plan lists, calls, VMEM budget), ``fwd_kernel``,
``bwd_kernels``; the backend object is here.
"""

from __future__ import annotations

from pallas_ring.block_sizes import BlockSizes
from pallas_ring.kernels import backend
from pallas_ring.kernels.pallas_tpu import bwd_kernels, fwd_kernel, info, tiles, views
from pallas_ring.kernels.pallas_tpu.bwd_kernels import backward
from pallas_ring.kernels.pallas_tpu.fwd_kernel import _compute_dtype, forward
from pallas_ring.kernels.pallas_tpu.tiles import SMEM_LIST_BYTES, Variants
from pallas_ring.kernels.pallas_tpu.views import HEAD_BLOCK, LANES


class TpuBackend(backend.Backend):
  """Pallas through Mosaic on TPU: every feature; Mosaic's (8, 128) tile rule."""

  name = "pallas_tpu"
  platform = "tpu"
  variants_cls = Variants
  forward_reads_fp8_kv = True  # (an FP8 cache's blocks in place, widened as they are staged)

  def default_block_sizes(self, head_dim, device_kind, dtype=None, value_dim=None):
    del value_dim  # (v is padded to q's head dim)
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


__all__ = ["BACKEND", "TpuBackend", "Variants", "forward", "backward", "LANES", "HEAD_BLOCK",
           "SMEM_LIST_BYTES", "bwd_kernels", "fwd_kernel", "info", "tiles", "views"]
