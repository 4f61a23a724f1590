"""Pallas kernels lowered through Mosaic GPU (Hopper, sm_90+), implementing ``kernels.common``.

The forward is FlashAttention-3 shaped. One CTA owns ``cfg.block_q`` query rows of one head at a
time (a work item; persistent CTAs, one per SM, walk several for narrow sliding windows), split
between two consumer warpgroups (``block_q / 2`` rows each); a third, producer warpgroup streams
the K/V tiles of the item's plan row by TMA into a ring of ``num_stages`` shared-memory slots
guarded by barriers. Each consumer runs ``wgmma`` for ``q.k^T`` and ``p.v`` and keeps the online
softmax (base 2, scale folded) in registers; two hardware barriers order the consumers' matmuls
so that one's softmax overlaps the other's matmuls. Where the registers allow (``overlaps``),
each consumer also issues tile j's ``q.k^T`` together with tile j-1's ``p.v`` and runs tile j's
softmax while that ``p.v`` runs (FlashAttention-3's intra-warpgroup overlap).

Both consumers walk the same plan row (the plan's query block is the item's rows), so the producer
loads each live kv block once for both: ``[0, kv_full)`` mask-free, then ``[kv_full, kv_count)``
through ``tile_visible`` (positions, segment ids, key padding); EMPTY tiles are never loaded.
K/V are read per kv head (GQA is never repeated). q, k and v of one FP8 dtype run both
matmuls in FP8 (``fp8``; ``Backend.forward_reads_fp8``).

The backward at head dims up to 128 is one fused kernel by default: dK/dV over the plan's
transposed lists, adding ds^T K to dQ by TMA reduce-adds in no fixed order (``dkv_fused``).
Where gradients must be bitwise reproducible, with segment ids and above head dim 128
(``tiles.fused_backward``), and for FP8 q, k, v in the FP8 backward (``tiles.fp8_backward``), it
is two kernels of the same shape: dK/dV, and dQ over the plan's rows (no cross-CTA
accumulation); dQ computes the row term ``delta`` when given a ``common.RowTerm``. FP8 q, k, v
run their products on q, k, v and dO in FP8 in those two kernels at head dims up to 128
(``fp8``; ``Backend.backward_reads_fp8``). For backward tiles other than 128 x 128 it is
``pallas_triton``'s on the same plan (``backward_unsupported`` says why; the contract allows
different lowerings per pass).

Every score term is applied in every kernel (``terms``, the only module that names the
features behind them). Not served here (``unsupported`` says why; ``backend="auto"`` then uses
``pallas_triton``): float32 inputs, GPUs before sm_90.

One module per concern, as FlashAttention-3's ``hopper/``:

* ``tiles``: sizes, the shared-memory budget, what is served, the kernel ``Variants`` and rules;
* ``pipeline``: shared-memory tiles and slots, token info, named barriers, the consumers' schedule;
* ``terms``: the score terms beyond ``q.k`` and the kernels' vocabulary for them;
* ``fp8``: the forward's FP8 mode (FP8 wgmmas: v's layout, p relabelled in registers);
* ``fwd_scheduler``: the forward's geometry and work items (its tile scheduler);
* ``fwd_mainloop``: the forward consumers' walk (serial and overlapped) and q loads;
* ``fwd_epilogue``: normalise and write, or merge into the ring's running result;
* ``fwd_kernel``: the forward kernel (warpgroup roles, producer) and its launch (``forward``);
* ``bwd_common``: the backward kernels' geometry, walk, tile arithmetic and epilogue;
* ``dq_kernel``: the dQ kernel (owned rows, delta, main loop, producer);
* ``dkv_kernel``: the dK/dV kernel's CTA context and producer; ``dkv_mainloop``: its consumers
  (also the wide ones); ``dkv_fused``: its fused-dQ steps and launch;
* ``bwd_kernels``: the backward's host side (``backward``): geometry, launches;
* this module: the backend object (``BACKEND``) registered in ``pallas_ring.kernels``.
"""

from __future__ import annotations

import jax

from pallas_ring.block_sizes import BlockSizes
from pallas_ring.kernels import backend
from pallas_ring.kernels.pallas_mosaic_gpu.bwd_kernels import backward
from pallas_ring.kernels.pallas_mosaic_gpu.fp8 import is_fp8
from pallas_ring.kernels.pallas_mosaic_gpu.fwd_kernel import forward
from pallas_ring.kernels.pallas_mosaic_gpu.tiles import (
    BWD_BLOCK, COMPUTE_WGS, WG_ROWS, Variants, backward_unsupported, check_tiles, fp8_backward,
    fused_backward, key_tile, padded_head_dim, slots, unsupported)


def hopper() -> bool:
  """Whether this process's GPUs are Hopper-class or newer (compute capability >= 9.0), the ones
  these kernels are written for. False without a local GPU: ``"auto"`` then lowers GPU
  computations (e.g. AOT from a CPU host) through Triton; ask for
  ``backend="pallas_mosaic_gpu"`` explicitly to target Hopper from such a host."""
  try:
    devices = jax.devices("gpu")
  except RuntimeError:
    return False
  return float(getattr(devices[0], "compute_capability", "0")) >= 9.0


MIN_TILE = {"block_q": COMPUTE_WGS * WG_ROWS, "block_kv": 64, "block_q_bwd": 16,
            "block_kv_bwd": 16}


class MosaicGpuBackend(backend.Backend):
  """Pallas through Mosaic GPU on Hopper (sm_90+), bfloat16 and float16 (``unsupported``)."""

  name = "pallas_mosaic_gpu"
  platform = "gpu"
  variants_cls = Variants
  fallback = "pallas_triton"
  forward_reads_fp8 = True
  backward_reads_fp8 = True  # (its FP8 mode where it serves, else dequantized: ``backward``)

  def supports(self, call):
    why = unsupported(call)
    dev = jax.devices()[0]
    if why is None and dev.platform == "gpu" and not hopper():
      why = (f"GPU {dev.device_kind} (compute capability "
             f"{getattr(dev, 'compute_capability', '?')}; it needs sm_90 or newer)")
    return why

  def auto_eligible(self):
    return hopper()

  def auto_prefers(self, call):
    # Decode: a CTA's query tile is 128 rows (two warpgroups) for the few rows of a GQA group,
    # where Triton's 16-row tiles stream the cache faster (BENCHMARKS.md, "Decode").
    return not call.decode

  def default_block_sizes(self, head_dim, device_kind, dtype=None, value_dim=None):
    # 2 x 64 rows per CTA, key tiles as wide as fit (``key_tile``); the backward kernels take
    # 128 x 128.
    hp = padded_head_dim(head_dim)
    hv = self.padded_value_dim(head_dim if value_dim is None else value_dim, hp)
    itemsize = 1 if dtype is not None and is_fp8(dtype) else 2  # (the output: 16-bit)
    return BlockSizes(128, key_tile(hp, hv, itemsize, 2), BWD_BLOCK, BWD_BLOCK, None, None)

  def block_size_error(self, field, value):
    low = MIN_TILE[field]
    if value < low or value & (value - 1):
      return (f"its tiles are powers of two, block_q >= 128 (two warpgroups of >= 64 rows), "
              f"block_kv >= 64, and the backward's >= 16 (its own kernels take 128 x 128 "
              f"backward tiles; other tiles run the Triton backward). Use "
              f"{max(low, backend.next_pow2(value))}, or None for the tuned default.")
    return None

  def tile_caps(self, q_len, kv_len):
    cap_k = max(64, backend.next_pow2(kv_len))
    # (the backward kernels own 128 keys per CTA)
    return max(128, backend.next_pow2(q_len)), cap_k, max(BWD_BLOCK, cap_k)

  def padded_head_dim(self, head_dim):
    return padded_head_dim(head_dim)

  def padded_value_dim(self, value_dim, head_dim):
    return min(padded_head_dim(value_dim), head_dim)  # (MLA: v at 128 beside q/k at 192)

  def tuning_candidates(self, head_dim, interpret):
    # Forward tiles and K/V slots; the backward's are fixed.
    fwd = [dict(block_q=128, block_kv=k, num_stages=s)
           for k in ((64, 128) if interpret else (64, 128, 256)) for s in (2, 3)]
    return {"fwd": fwd, "bwd": [dict(block_q_bwd=BWD_BLOCK, block_kv_bwd=BWD_BLOCK)]}

  def decode_programs(self, interpret, fp8=False):
    del fp8
    return backend.gpu_programs(interpret)

  def fuses_backward(self, cfg, head_dim, segments, fp8):
    variants = cfg.variants or Variants()  # (FP8 operands in the FP8 mode run the pair)
    return (not cfg.interpret and backward_unsupported(cfg, head_dim) is None
            and not (fp8 and fp8_backward(cfg, head_dim, variants))
            and fused_backward(variants, head_dim, cfg.kv_len, segments))

  forward = staticmethod(forward)
  backward = staticmethod(backward)


BACKEND = MosaicGpuBackend()

__all__ = ["BACKEND", "Variants", "forward", "backward", "hopper", "unsupported",
           "backward_unsupported", "check_tiles", "slots"]
