"""Tile rules of the Mosaic GPU kernels: sizes, shared-memory budget, what they serve, and the
kernel variants (``Variants``) with the measured rules that pick them by default."""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Optional

import jax
import jax.numpy as jnp

from pallas_ring import masks as masks_lib
from pallas_ring.kernels import backend, common
from pallas_ring.kernels.pallas_mosaic_gpu.pipeline import wgmma_accumulator_load

# Rows of one consumer warpgroup's q tile must tile wgmma's M = 64.
WG_ROWS = 64
# Shared memory a CTA may use on sm_90 (227 KiB), less room for row statistics and barriers.
SMEM_BYTES = 227 * 1024 - 4096
DTYPES = (jnp.bfloat16, jnp.float16)
COMPUTE_WGS = 2
REGISTER_FILE = 65536  # 32-bit registers per SM, which every warpgroup's threads share


@dataclasses.dataclass(frozen=True)
class Variants:
  """Kernel variants of the Mosaic GPU kernels, passed as ``BlockSizes(variants=Variants(...))``.

  None fields follow the measured rules described at each switch below; the defaults are what
  ``backend="auto"`` runs. Tools and tests select variants here (a changed field retraces).
  """

  overlap_pv: Optional[bool] = None  # forward: softmax of tile j overlaps p.v of j-1 (``overlaps``)
  persistent: Optional[bool | int] = None  # forward: persistent CTAs; an int sets their count
  persistent_window: int = 1024  # the rule's widest sliding window run persistent (keys)
  item_order: Optional[str] = None  # forward launch order "heads" | "blocks" (``item_order``)
  blocks_first_keys: int = 32768  # the rule's fewest padded keys launched q blocks first
  dkv_walk_rows: tuple[tuple[int, int], ...] = ((64, 128),)  # dK/dV q tile rows per head dim (64)
  dq_walk_rows: int = 128  # dQ kernel's K/V tile rows up to head dim 128 (64 above)
  wide_dkv_above: int = 128  # head dims above which dK/dV owns 64 rows per CTA ("wide")
  wide_dq_above: int = 192  # head dims above which dQ owns 64 rows per CTA
  delta_in_dq: bool = True  # the dQ kernel computes delta from o (False: XLA's separate pass)
  # dK/dV: CTAs per kv block, each walking a share of its GQA group's query heads into float32
  # partial dK/dV summed after the kernel in a fixed order (``dkv_head_splits``); None: the rule.
  dkv_head_splits: Optional[int] = None
  dkv_min_waves: int = 4  # the rule splits below this many waves of dK/dV CTAs (one per SM)
  dkv_max_splits: int = 4  # ... into at most this many CTAs per kv block
  # False: one fused backward kernel at head dims <= 128 (``dkv_fused``): the dK/dV kernel
  # also adds each tile's ds^T K to a float32 dQ by atomic (TMA reduce) adds, in no fixed order,
  # so dQ is not bitwise reproducible. True: dQ by its own kernel, reproducible. None: the rule
  # (``fused_backward``: fused unless XLA_FLAGS asks XLA for deterministic ops or segment ids
  # are given; FP8 q, k, v in the backward's FP8 mode run the pair).
  deterministic: Optional[bool] = None
  # The rule runs the pair at head dims up to 64 where at most this many keys are attended
  # (short rows: there the pair measured 1-5% faster; BENCHMARKS.md, "The backward"). 0: never.
  pair_up_to_keys: int = 2048
  # The fused kernel issues ds^T K with the tile's dV and dK matmuls (one wgmma wait) at head
  # dims up to this; None: the rule (``dq_with_dkv``).
  dq_with_dkv_up_to: Optional[int] = None
  # The fused kernel's dQ split by columns (FlashAttention-3's): each consumer adds half of dQ's
  # columns over the CTA's 128 keys (both consumers' ds^T tiles from shared memory), one
  # reduce-add of the tile per CTA instead of one per consumer (half the L2 traffic). Where
  # halves are whole swizzle tiles (``dq_split``); False: each consumer adds all columns over
  # its own 64 keys.
  dq_split: bool = True
  # The dK/dV consumers (head dims <= 128, without dropout) compute a tile's probabilities from
  # q.k^T while its dO.v^T still runs (FlashAttention-3's intra-warpgroup overlap); off by
  # default: slower on the dense H=128 row, within 1% on the causal ones, and ptxas spills more
  # (BENCHMARKS.md, "Kernel rules").
  overlap_softmax: bool = False
  # The fused kernel (where ``dq_with_dkv``) issues ds^T K first and adds it to dQ while the
  # tile's dV and dK matmuls run; False: after all three; None: the rule (``overlap_dq``).
  overlap_dq: Optional[bool] = None
  # The split fused kernel's dK += ds^T q reads ds^T from the shared-memory tile it writes for
  # dQ's columns, not from registers: 16 registers per thread fewer while dV's, dK's and dQ's
  # accumulators are live (no spills at H=128, and faster: BENCHMARKS.md, "The backward").
  # False: from registers.
  ds_from_smem: bool = True
  # The fused kernel (without FP8 or dropout) gives the walked q-side tiles (q, lse, token info)
  # one slot more than the dO-side ones (dO, delta) where it fits: q arrives a step earlier, and
  # a consumer issues q.k^T before waiting for dO. None: the rule (``extra_q_slot``).
  extra_q_slot: Optional[bool] = None
  # Consumers re-derive the refs of their own tiles (the forward's q, the dQ and dK/dV kernels'
  # owned tiles; not the wide dK/dV kernel's, which does not spill) in each step of their main
  # loop (``pipeline.step_index``): else LLVM hoists their wgmma descriptors out of it and
  # ptxas may spill them. False: once before it; None: the rule (``step_refs``).
  step_refs: Optional[bool] = None
  # A 16-bit tile term (an additive tile or a dense mask) reaches each consumer through a
  # shared-memory tile that the producer fills by TMA a step ahead (``terms.TermStage``), where
  # it fits beside the slots.
  # False: each consumer loads it from global memory after its tile's q.k^T (as a float32 term
  # always is).
  stage_bias: bool = True
  # A dense mask's term also hides what the mask spec, the segment ids and the padding hide,
  # where the token info's batch axes fit the mask's (``terms.Terms.dense_vis``): partial tiles
  # then add the term and compute no visibility. False: they compute it from the token info.
  dense_visibility: bool = True
  # Registers per thread after setmaxnreg (``plgpu.set_max_registers``) of each consumer
  # warpgroup and of the producer: (COMPUTE_WGS x consumer + producer) x 128 threads must fit
  # the register file; asking for more never returns (240 per consumer hung). 240 and 24 spill
  # less but starve the producer (BENCHMARKS.md, "Kernel rules").
  consumer_regs: int = 232
  producer_regs: int = 40
  # ... of the one consumer of a kernel that has one (the dQ kernel above ``wide_dq_above``):
  # its float32 dQ of 64 x 256 alone takes 128 registers per thread.
  lone_consumer_regs: int = 256
  # FP8 q, k, v (with their descales): the backward's FP8 mode (``fp8.backward_operands``) where
  # it serves (``fp8_backward``); False: q, k, v dequantized for the 16-bit kernels.
  fp8_backward: bool = True

  @property
  def regs(self) -> tuple[int, int]:
    """``(consumer_regs, producer_regs)``, as the kernels' geometries carry them."""
    return (self.consumer_regs, self.producer_regs)

  def __post_init__(self):
    regs = self.regs
    lone = self.lone_consumer_regs
    if lone % 8 or not 24 <= lone <= 256:
      raise ValueError(f"Variants(lone_consumer_regs={lone}) is invalid: it must be a multiple "
                       "of 8 in [24, 256], e.g. 256.")
    if (any(r % 8 or not 24 <= r <= 256 for r in regs)
        or (COMPUTE_WGS * regs[0] + regs[1]) * 128 > REGISTER_FILE):
      raise ValueError(f"Variants(consumer_regs={regs[0]}, producer_regs={regs[1]}) is invalid: "
                       "each must be a multiple of 8 in [24, 256], and (2 x consumer_regs + "
                       f"producer_regs) x 128 threads at most the {REGISTER_FILE} registers of "
                       "an SM, e.g. 232 and 40.")
    if self.pair_up_to_keys < 0:
      raise ValueError(f"Variants.pair_up_to_keys={self.pair_up_to_keys} is invalid: use a "
                       "number of keys >= 0 (0: the fused backward at every length).")
    if self.dkv_head_splits is not None and self.dkv_head_splits < 1:
      raise ValueError(f"Variants.dkv_head_splits={self.dkv_head_splits} is invalid: use a "
                       "divisor of the query heads per kv head, or None (the rule).")
    if self.item_order not in (None, "heads", "blocks"):
      raise ValueError(f"Variants.item_order={self.item_order!r} is invalid: use 'heads', "
                       "'blocks' or None (the rule).")


def padded_head_dim(head_dim: int) -> int:
  """The head dim the kernels see: a multiple of 64 (one 128-byte swizzle of 16-bit columns)."""
  return max(64, backend.round_up(head_dim, 64))


def unsupported(call: backend.Call) -> Optional[str]:
  """Why this lowering cannot serve a call (None when it can): dtype, head dim. (FP8 inputs are
  served by the forward's FP8 mode; their call's dtype is the one they compute in.)"""
  if jnp.dtype(call.dtype) not in [jnp.dtype(d) for d in DTYPES]:
    return f"inputs of dtype {jnp.dtype(call.dtype)} (wgmma takes bfloat16 or float16)"
  head_dim = padded_head_dim(call.head_dim)
  if head_dim > 256:
    return f"head dim {call.head_dim} (the kernels take up to 256)"
  return None


def stages_o(itemsize: int, out_itemsize: int) -> bool:
  """Whether the forward stages its output in a tile of its own: where the q tile's dtype is
  not the output's (FP8 inputs). Otherwise the q tiles stage it (at a narrower v, seen as
  ``o_view_rows`` rows of Hv columns)."""
  return out_itemsize != itemsize


def _tile_bytes(block_q: int, block_kv: int, head_dim: int, itemsize: int,
                value_dim: Optional[int], out_itemsize: Optional[int]) -> tuple[int, int]:
  """Bytes of the forward's fixed tiles (q [block_q, H], at least its view at a narrower v, and
  where ``stages_o`` the output's staging [block_q, Hv]) and of one K/V slot ([block_kv, H] +
  [block_kv, Hv])."""
  hv = head_dim if value_dim is None else value_dim
  out_itemsize = itemsize if out_itemsize is None else out_itemsize
  fixed = block_q * head_dim * itemsize
  if stages_o(itemsize, out_itemsize):
    fixed += block_q * hv * out_itemsize
  elif hv != head_dim:  # (the q tiles' union with their view at Hv columns: ``o_view_rows``)
    rows = o_view_rows(block_q // COMPUTE_WGS, head_dim, hv)
    fixed = max(fixed, COMPUTE_WGS * rows * hv * itemsize)
  return fixed, block_kv * (head_dim + hv) * itemsize


def o_view_rows(rows: int, head_dim: int, value_dim: int) -> int:
  """Rows of a consumer's q tile (``[rows, H]``) seen as a tile of ``Hv`` columns, the first
  ``rows`` of which stage its output where v is narrower: at least the q tile's bytes, so that
  each consumer's view starts inside its own q tile, and a multiple of 8 (swizzled tiles)."""
  return backend.round_up(-(-rows * head_dim // value_dim), 8)


def key_tile(head_dim: int, value_dim: int, itemsize: int, out_itemsize: int) -> int:
  """The forward's default keys per tile: the most of 256, 128 or 64 whose two K/V slots fit
  beside the q tiles of 128 rows. FP8 tiles are half the bytes, so twice the keys; a narrower
  v leaves room for 128 keys at q/k head dim 192 (BENCHMARKS.md, "FP8 forward", "MLA head
  dims")."""
  for block_kv in (256, 128):
    fixed, kv_bytes = _tile_bytes(COMPUTE_WGS * WG_ROWS, block_kv, head_dim, itemsize,
                                  value_dim, out_itemsize)
    if fixed + 2 * kv_bytes <= SMEM_BYTES:
      return block_kv
  return 64


def check_value_dim(value_dim: int, head_dim: int) -> None:
  """Raises ValueError unless v's head dim suits the kernels: a multiple of 64 (one 128-byte
  swizzle) and at most q's (``padded_value_dim`` makes it so)."""
  if value_dim % 64 or value_dim > head_dim:
    raise ValueError(f"pallas_mosaic_gpu kernels got v of head dim {value_dim} beside q/k of "
                     f"{head_dim}: it must be a multiple of 64 and at most {head_dim}; pad v "
                     "to BACKEND.padded_value_dim(Hv, H) columns.")


def slots(cfg: common.KernelConfig, head_dim: int, itemsize: int, staged: int = 0,
          value_dim: Optional[int] = None, out_itemsize: Optional[int] = None) -> int:
  """K/V shared-memory slots: ``cfg.num_stages`` or as many as fit beside the q tile (v's head
  dim ``value_dim``, default ``head_dim``; the output's item size ``out_itemsize``, default the
  inputs') and ``staged`` bytes of staged tile-term windows (at least 2)."""
  if cfg.num_stages:
    return cfg.num_stages
  fixed, kv_bytes = _tile_bytes(cfg.block_q, cfg.block_kv, head_dim, itemsize, value_dim,
                                out_itemsize)
  return max(2, min(4, (SMEM_BYTES - fixed - staged) // kv_bytes))


def fwd_smem(cfg: common.KernelConfig, head_dim: int, itemsize: int, staged: int = 0,
             value_dim: Optional[int] = None, out_itemsize: Optional[int] = None) -> int:
  """Shared memory of the forward's q tile (and output staging), K/V slots and ``staged``
  bytes."""
  fixed, kv_bytes = _tile_bytes(cfg.block_q, cfg.block_kv, head_dim, itemsize, value_dim,
                                out_itemsize)
  n = slots(cfg, head_dim, itemsize, staged, value_dim, out_itemsize)
  return fixed + n * kv_bytes + staged


def staged_bias_bytes(term_dtype, variants: Variants, readers: int, rows: int,
                      cols: int) -> int:
  """Bytes of the staged tile-term windows (``terms.TermStage``) of ``readers`` readers of
  ``[rows, cols]``, or 0 where the term is not staged (32-bit, or ``Variants.stage_bias``
  off); callers stage only where it fits."""
  itemsize = jnp.dtype(term_dtype).itemsize
  return readers * rows * cols * itemsize if variants.stage_bias and itemsize == 2 else 0


def check_tiles(cfg: common.KernelConfig, head_dim: int, itemsize: int, staged: int = 0,
                value_dim: Optional[int] = None, out_itemsize: Optional[int] = None) -> None:
  """Raises ValueError naming the rule when the forward tiles (beside ``staged`` bytes of tile-term
  windows) cannot run."""
  if cfg.block_q % (COMPUTE_WGS * WG_ROWS):
    raise ValueError(
        f"block_q={cfg.block_q} cannot be used by backend 'pallas_mosaic_gpu': a CTA's query rows "
        f"are split between {COMPUTE_WGS} warpgroups of multiples of {WG_ROWS} rows, so block_q "
        f"must be a multiple of {COMPUTE_WGS * WG_ROWS}.")
  if cfg.block_kv % 64:
    raise ValueError(f"block_kv={cfg.block_kv} cannot be used by backend 'pallas_mosaic_gpu': "
                     "it must be a multiple of 64.")
  n = slots(cfg, head_dim, itemsize, staged, value_dim, out_itemsize)
  need = fwd_smem(cfg, head_dim, itemsize, staged, value_dim, out_itemsize)
  if n < 2 or need > SMEM_BYTES:
    raise ValueError(
        f"pallas_mosaic_gpu tiles block_q={cfg.block_q}, block_kv={cfg.block_kv} with {n} K/V "
        f"slots need {need // 1024} KiB of shared memory at head dim {head_dim} (at least 2 slots; "
        f"{SMEM_BYTES // 1024} KiB available): use a smaller block_kv or num_stages.")


# FlashAttention-3's intra-warpgroup overlap: each step issues tile j's q.k^T and tile j-1's
# p.v together, waits for q.k^T only and runs tile j's softmax while p.v runs, then rescales the
# accumulator. It keeps a second 16-bit p tile and the q.k^T accumulator live beside the output
# accumulator, so it runs where those fit the registers (``overlaps``); it is 2-14% faster
# there (BENCHMARKS.md, "Kernel rules"). ``Variants.overlap_pv``: None: that rule; True/False force
# it.


def overlaps(block_kv: int, value_dim: int, segments: bool, variants: Variants,
             fp8: bool = False) -> bool:
  """Whether the forward overlaps each tile's softmax with the previous tile's p.v.

  A consumer thread then holds the float32 output (value_dim / 2 registers: v's head dim), the
  float32 logits (block_kv / 2) and two 16-bit p tiles (block_kv / 4 each) at once, which must
  fit beside the rest. Calls with segment ids (documents) keep the serial walk: their rows are
  short, and the overlapped walk's unpaired first and last tiles cost more than the overlap saves.
  Nor does the FP8 mode: its matmuls are short beside the softmax, and the serial walk measured
  faster at every key tile (BENCHMARKS.md, "FP8 forward").
  """
  if variants.overlap_pv is not None:
    return variants.overlap_pv
  return (wgmma_accumulator_load is not None and not segments and not fp8
          and value_dim // 2 + block_kv <= 192)


# Persistent forward: at most one CTA per SM, each walking work items (a q block of one head) in
# turn, so the producer streams the next item's first K/V tiles while the consumers finish the
# current one, and a CTA starts once per SM instead of once per item. It pays where rows are
# short and alike: sliding windows of at most ``Variants.persistent_window`` keys, in the
# overlapped walk; wider windows gain nothing. Where rows differ it loses: items go to CTAs
# round-robin, while one CTA per item lets the hardware hand the next item to whichever SM is
# free (BENCHMARKS.md, "Kernel rules"). ``Variants.persistent``: None: that rule; True/False force
# it; an int sets the CTA count (tests: several items per CTA at small sizes).


def persistent_ctas(items: int, mask, overlap: bool, variants: Variants) -> int:
  """CTAs of a forward of ``items`` work items under ``mask``: ``items`` (one each) unless
  persistent (above)."""
  on = variants.persistent
  if on is None:
    width = masks_lib.window_width(mask)
    on = overlap and width is not None and width <= variants.persistent_window
  if on is False:
    return items
  return min(items, sm_count() if on is True else on)


@functools.lru_cache(maxsize=None)
def sm_count() -> int:
  """Streaming multiprocessors of the first GPU; 132 (an H100 SXM's) where there is none (when
  cross-lowering on a CPU)."""
  try:
    return int(getattr(jax.devices("gpu")[0], "core_count", 132))
  except RuntimeError:
    return 132


# The forward's work items in launch order (``fwd_scheduler.work_item``): q blocks from the
# last, so the longest rows of causal-type masks start first and the short ones fill the tail,
# and
#   "heads": heads vary fastest, then q blocks: the longest rows of all heads start first;
#   "blocks": q blocks vary fastest, then heads: CTAs that run at the same time read the same
#     head's K/V, which L2 then serves to all of them.
# ``Variants.item_order``; None: "blocks" from ``Variants.blocks_first_keys`` keys on, else
# "heads": long rows read K/V from L2 with "blocks", and shorter rows lose with it, whose last
# heads start their longest rows late (BENCHMARKS.md, "Kernel rules").


def item_order(keys: int, variants: Variants) -> str:
  """The launch order of a forward over ``keys`` keys (padded K/V length)."""
  if variants.item_order is not None:
    return variants.item_order
  return "blocks" if keys >= variants.blocks_first_keys else "heads"


BWD_ROWS = WG_ROWS  # rows of an owned tile per warpgroup
BWD_BLOCK = COMPUTE_WGS * BWD_ROWS  # the backward plan's tiles (block_q_bwd = block_kv_bwd)
# Rows of a walked tile (``Variants``). dK/dV walks q tiles of ``dkv_walk_rows``, 128 at head
# dims <= 64 (faster there: BENCHMARKS.md, "Kernel rules"): above, its float32 dK, dV, s^T and dp^T
# fill the registers. dQ walks K/V tiles of ``dq_walk_rows`` up to head dim 128 and of 64 rows above
# (its float32 dQ takes 96-128 registers beside s and dp; and where two slots would not fit). dQ is
# wide above 192 only: at 192 two consumers' q and dO still fit beside two K/V slots (BENCHMARKS.md,
# "MLA head dims": 7-10% faster forward+backward than one consumer). ``Variants.delta_in_dq``:
# whether the dQ kernel computes delta from a RowTerm (False: XLA's separate pass computes it): it
# saves documents' short rows a pass and costs dense and causal rows nothing on the device clock.


# Few kv heads (MQA, K=1-2) leave the dK/dV kernel with few CTAs (one per 128 keys of a kv
# head), each walking every query head of its group: with causal-type masks the first blocks'
# walks are the longest, and the GPU idles while they finish. Splitting each block's group over
# ``d`` CTAs gives d times the CTAs, each walking ``group / d`` heads into float32 partials that
# are summed after the kernel in a fixed order (bitwise reproducible); the partials cost a
# float32 write and read of d x dK/dV. ``Variants.dkv_head_splits``; None: below
# ``dkv_min_waves`` waves of CTAs, the largest divisor of the group up to ``dkv_max_splits``
# (MQA 16/1: 1.4x faster forward+backward; from 2048 CTAs on, no gain: BENCHMARKS.md, "Kernel
# rules").


def step_refs(variants: Variants, head_dim: int, fused: bool = False) -> bool:
  """Whether a kernel's consumers re-derive their own tiles' refs in each step
  (``Variants.step_refs``). The rule: in the fused backward and above head dim 192, where it
  removed ptxas's spills and made them faster; below, the other kernels' spills are few or not
  removed by it, and forward+backward ran 1-3% slower with it (head dim 192 is not measured:
  off; BENCHMARKS.md, "Kernel rules")."""
  if variants.step_refs is not None:
    return variants.step_refs
  return fused or head_dim > 192


def dq_split(variants: Variants, head_dim: int) -> bool:
  """Whether the fused backward splits dQ's columns over its consumers (``Variants.dq_split``,
  on by default: 7-12% faster at head dim 128, BENCHMARKS.md): where each half is whole 128-byte
  swizzle tiles of K (head dims that are multiples of 128; the fused kernel serves up to 128)."""
  return head_dim % 128 == 0 and variants.dq_split


def dq_with_dkv(variants: Variants, head_dim: int) -> bool:
  """Whether the fused backward issues ds^T K with dV's and dK's matmuls
  (``Variants.dq_with_dkv_up_to``). The rule: up to head dim 128 with dQ's columns split (its
  float32 half-tile takes 32 registers per thread: up to 3.5% faster than after), else up to 64
  (at 128 unsplit, the whole tile's 64 registers made the kernel a third slower; BENCHMARKS.md)."""
  up_to = variants.dq_with_dkv_up_to
  if up_to is None:
    up_to = 128 if dq_split(variants, head_dim) else 64
  return head_dim <= up_to


def extra_q_slot(variants: Variants, head_dim: int) -> bool:
  """Whether the fused backward gives its q-side tiles a slot more than dO's, where it fits
  (``Variants.extra_q_slot``). The rule: above head dim 64 (at 128, 1-10% faster, most on the
  dense row; at 64, 4-10% slower; BENCHMARKS.md, "The backward")."""
  if variants.extra_q_slot is not None:
    return variants.extra_q_slot
  return head_dim > 64


def overlap_dq(variants: Variants, head_dim: int) -> bool:
  """Whether the fused backward adds each tile's dQ while its dV and dK matmuls run
  (``Variants.overlap_dq``, where ``dq_with_dkv``). The rule: where dQ's columns are split (head
  dim 128: 2-4% faster; at 64 it measured 0.5-1.5% slower; BENCHMARKS.md, "Kernel rules")."""
  _check_partial_wait(variants, "overlap_dq")
  if not dq_with_dkv(variants, head_dim) or wgmma_accumulator_load is None:
    return False
  return dq_split(variants, head_dim) if variants.overlap_dq is None else variants.overlap_dq


def overlap_softmax(variants: Variants, elsewhere: bool, dropout: bool) -> bool:
  """Whether the dK/dV consumers compute p while dO.v^T runs (``Variants.overlap_softmax``):
  not in the wide kernel or the dQ kernel (``elsewhere``), nor under dropout, whose keep mask is
  computed where it is used, after the wgmma scope."""
  _check_partial_wait(variants, "overlap_softmax")
  return variants.overlap_softmax and not (elsewhere or dropout)


def _check_partial_wait(variants: Variants, field: str) -> None:
  """Raises where ``Variants.<field>=True`` asks for an overlap this JAX cannot express (no
  partial wgmma wait: plgpu's ``wgmma_accumulator_load``, as the forward's ``overlap_pv``)."""
  if getattr(variants, field) and wgmma_accumulator_load is None:
    raise ValueError(f"Variants({field}=True) needs the partial wgmma wait of a newer JAX "
                     "(plgpu's wgmma_accumulator_load); upgrade JAX or leave "
                     f"{field}={Variants.__dataclass_fields__[field].default}.")


def dkv_head_splits(group: int, ctas: int, variants: Variants) -> int:
  """CTAs per kv block of the dK/dV kernel (above), for ``ctas`` CTAs unsplit."""
  if variants.dkv_head_splits is not None:
    if group % variants.dkv_head_splits:
      raise ValueError(f"Variants.dkv_head_splits={variants.dkv_head_splits} does not divide the "
                       f"{group} query heads per kv head; use a divisor of {group}.")
    return variants.dkv_head_splits
  if ctas >= variants.dkv_min_waves * sm_count():
    return 1
  return max(d for d in range(1, min(group, variants.dkv_max_splits) + 1) if group % d == 0)


_DETERMINISTIC_FLAGS = ("--xla_gpu_deterministic_ops", "--xla_gpu_exclude_nondeterministic_ops")


def xla_deterministic_ops() -> bool:
  """Whether ``XLA_FLAGS`` asks XLA:GPU for deterministic ops (``--xla_gpu_deterministic_ops``
  or ``--xla_gpu_exclude_nondeterministic_ops``, as for XLA's own scatters and cuDNN's
  backward; a flag's last value counts, as in XLA). Read while tracing, as XLA reads it once:
  set it before the first call."""
  on = {}
  for flag in os.environ.get("XLA_FLAGS", "").split():
    name, eq, value = flag.partition("=")
    if name in _DETERMINISTIC_FLAGS:
      on[name] = not eq or value.lower() in ("true", "1")
  return any(on.values())


def fused_backward(variants: Variants, head_dim: int, kv_len: int,
                   segments: bool = False) -> bool:
  """Whether dQ, dK and dV come from the fused kernel (``dkv_fused``; dQ added in no fixed
  order) rather than the reproducible pair (dK/dV, then dQ by its own kernel), at head dims up
  to ``wide_dkv_above``: as ``Variants.deterministic`` says, else by the rule. The rule: fused
  (faster at head dims 64 and 128: BENCHMARKS.md, "The backward: two kernels or fused") unless
  ``XLA_FLAGS`` asks for deterministic ops (``xla_deterministic_ops``) or the rows are short:
  ``segments`` (packed documents; the pair ran 4-6% faster on documents of 1024 tokens) or, at
  head dims up to 64, ``kv_len`` keys up to ``Variants.pair_up_to_keys``. FP8 q, k, v that run
  the backward's FP8 mode (``fp8_backward``) take the pair whatever this says: the caller
  checks that first."""
  if head_dim > variants.wide_dkv_above:
    return False
  if variants.deterministic is not None:
    return not variants.deterministic
  short = segments or (head_dim <= 64 and kv_len <= variants.pair_up_to_keys)
  return not (xla_deterministic_ops() or short)


def fp8_backward(cfg: common.KernelConfig, head_dim: int, variants: Variants) -> bool:
  """Whether FP8 q, k, v run the backward's FP8 mode: in the reproducible pair of kernels of
  head dims up to ``wide_dkv_above``, unless the fused kernel is asked for
  (``deterministic=False``; it, the wide kernels and the Triton backward take them
  dequantized)."""
  return (variants.fp8_backward and variants.deterministic is not False and
          not cfg.interpret and head_dim <= variants.wide_dkv_above and
          backward_unsupported(cfg, head_dim) is None)


def backward_unsupported(cfg: common.KernelConfig, head_dim: int) -> Optional[str]:
  """Why the Mosaic GPU backward cannot serve a call its forward serves (None when it can);
  ``backward`` then runs ``pallas_triton``'s over the same plan."""
  if (cfg.block_q_bwd, cfg.block_kv_bwd) != (BWD_BLOCK, BWD_BLOCK):
    return (f"backward tiles ({cfg.block_q_bwd}, {cfg.block_kv_bwd}) (it takes "
            f"({BWD_BLOCK}, {BWD_BLOCK}): two warpgroups of {BWD_ROWS} rows)")
  return None
