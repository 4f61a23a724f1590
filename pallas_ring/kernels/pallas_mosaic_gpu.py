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
K/V are read per kv head (GQA is never repeated).

The backward is two kernels of the same shape (see the backward section below): dK/dV over the
plan's transposed lists and dQ over its rows, deterministic (no cross-CTA accumulation); dQ
computes the row term ``delta`` when given a ``common.RowTerm``. For
backward tiles other than 128 x 128 it is ``pallas_triton``'s on the same plan
(``backward_unsupported`` says why; the contract allows different lowerings per pass).

Not served here (``unsupported`` says why; ``backend="auto"`` then uses ``pallas_triton``): dense
masks, bias, ALiBi, dropout, float32 inputs, GPUs before sm_90.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Optional

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
import jax.experimental.pallas.mosaic_gpu as plgpu
try:  # an accumulator read that waits for all but the last ``wait_n`` wgmmas (plgpu's indexing
  # waits for all); not exported by plgpu in JAX 0.10 and 0.11
  from jax._src.pallas.mosaic_gpu.primitives import wgmma_accumulator_load
except ImportError:  # a JAX without it: the forward keeps the serial walk (``overlaps``)
  wgmma_accumulator_load = None
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm

from pallas_ring import masks as masks_lib
from pallas_ring.config import BlockSizes
from pallas_ring.kernels import backend, common
from pallas_ring.kernels import pallas_triton

# Rows of one consumer warpgroup's q tile must tile wgmma's M = 64.
WG_ROWS = 64
# Shared memory a CTA may use on sm_90 (227 KiB), less room for row statistics and barriers.
SMEM_BYTES = 227 * 1024 - 4096
DTYPES = (jnp.bfloat16, jnp.float16)
_COMPUTE_WGS = 2
# Registers per thread after setmaxnreg: 2 consumer warpgroups and the producer must fit the
# 64K-register file ((2 x 232 + 40) x 128 threads); asking for more never returns (240 hung).
_CONSUMER_REGS, _PRODUCER_REGS = 232, 40


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
  dq_walk_rows: int = 128  # dQ kernel's K/V tile rows (64 in the wide kernel)
  wide_dkv_above: int = 128  # head dims above which dK/dV owns 64 rows per CTA ("wide")
  wide_dq_above: int = 128  # head dims above which dQ owns 64 rows per CTA
  delta_in_dq: bool = True  # the dQ kernel computes delta from o (False: XLA's separate pass)

  def __post_init__(self):
    if self.item_order not in (None, "heads", "blocks"):
      raise ValueError(f"Variants.item_order={self.item_order!r} is invalid: use 'heads', "
                       "'blocks' or None (the rule).")
    if isinstance(self.dkv_walk_rows, dict):  # (a mapping is accepted, stored hashable)
      object.__setattr__(self, "dkv_walk_rows", tuple(sorted(self.dkv_walk_rows.items())))


def unsupported(call: backend.Call) -> Optional[str]:
  """Why this lowering cannot serve a call (None when it can): dtype, head dim, features."""
  if jnp.dtype(call.dtype) not in [jnp.dtype(d) for d in DTYPES]:
    return f"inputs of dtype {jnp.dtype(call.dtype)} (wgmma takes bfloat16 or float16)"
  head_dim = BACKEND.padded_head_dim(call.head_dim)
  if head_dim % 64 or head_dim > 256:
    return f"head dim {head_dim} (the kernel takes 64, 128 or 256 after padding)"
  for what, used in call.features:
    if used:
      return f"{what} (not implemented in the Mosaic GPU forward yet)"
  return None


def _ops_call(q, ops: common.Operands) -> backend.Call:
  """The ``Call`` of kernel operands (to refuse what ``unsupported`` names)."""
  return backend.Call(q.dtype, q.shape[-1], dense=ops.dense is not None,
                      bias=ops.bias is not None, alibi=ops.alibi is not None,
                      dropout=ops.dropout is not None)


def slots(cfg: common.KernelConfig, head_dim: int, itemsize: int) -> int:
  """K/V shared-memory slots: ``cfg.num_stages`` or as many as fit (at least 2)."""
  if cfg.num_stages:
    return cfg.num_stages
  q_bytes = cfg.block_q * head_dim * itemsize
  kv_bytes = 2 * cfg.block_kv * head_dim * itemsize
  return max(2, min(4, (SMEM_BYTES - q_bytes) // kv_bytes))


def check_tiles(cfg: common.KernelConfig, head_dim: int, itemsize: int) -> None:
  """Raises ValueError naming the rule when the forward tiles cannot run."""
  if cfg.block_q % (_COMPUTE_WGS * WG_ROWS):
    raise ValueError(
        f"block_q={cfg.block_q} cannot be used by backend 'pallas_mosaic_gpu': a CTA's query rows "
        f"are split between {_COMPUTE_WGS} warpgroups of multiples of {WG_ROWS} rows, so block_q "
        f"must be a multiple of {_COMPUTE_WGS * WG_ROWS}.")
  if cfg.block_kv % 64:
    raise ValueError(f"block_kv={cfg.block_kv} cannot be used by backend 'pallas_mosaic_gpu': "
                     "it must be a multiple of 64.")
  n = slots(cfg, head_dim, itemsize)
  need = (cfg.block_q + 2 * n * cfg.block_kv) * head_dim * itemsize
  if n < 2 or need > SMEM_BYTES:
    raise ValueError(
        f"pallas_mosaic_gpu tiles block_q={cfg.block_q}, block_kv={cfg.block_kv} with {n} K/V "
        f"slots need {need // 1024} KiB of shared memory at head dim {head_dim} (at least 2 slots; "
        f"{SMEM_BYTES // 1024} KiB available): use a smaller block_kv or num_stages.")


# Layouts of a wgmma accumulator's row and column vectors.
_ROWS, _COLS = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)


# JAX 0.11 deprecated load's separate index argument that 0.10 requires.
_LOAD_NEEDS_INDEX = (inspect.signature(plgpu.load).parameters["idx"].default
                     is inspect.Parameter.empty)


def _load(ref, layout, optimized=True):
  """The whole of a ref as an array in ``layout`` (``optimized=False`` for an untiled one)."""
  if _LOAD_NEEDS_INDEX:
    return plgpu.load(ref, (), layout=layout, optimized=optimized)
  return plgpu.load(ref, layout=layout, optimized=optimized)


def _slot(step, slots: int):
  """The ring slot of a kv step (in the step's own integer dtype, also under x64)."""
  return lax.rem(step, jnp.asarray(slots, step.dtype))


def _row_vector(x, rows: int):
  """``[rows]`` float32 vector in the layout of a wgmma accumulator's rows."""
  return plgpu.layout_cast(jnp.full((rows,), x, jnp.float32), _ROWS)


def _smem(dtype, *shape):
  """A shared-memory tile of 16-bit or 32-bit elements in wgmma's swizzled layout."""
  itemsize = jnp.dtype(dtype).itemsize
  return plgpu.SMEM(shape, dtype, transforms=(
      plgpu.TilingTransform((8, 128 // itemsize)), plgpu.SwizzleTransform(128)))


def _info_rows(ref, layout, shape, dim, info_rows):
  """Token-info rows (positions, then segment ids) of a tile, broadcast to ``shape``."""
  return [lax.broadcast_in_dim(_load(ref.at[f], layout), shape, [dim]) for f in range(info_rows)]


def token_info(info) -> jax.Array:
  """int32 ``[Bi, F, L]``: positions, then segment ids when present (one TMA copy per tile)."""
  if info.segment_ids is None:
    return info.positions[:, None]
  b = info.segment_ids.shape[0]
  pos = jnp.broadcast_to(info.positions, (b, info.positions.shape[-1]))
  return jnp.stack([pos, info.segment_ids], axis=1)


# FlashAttention-3's intra-warpgroup overlap: each step issues tile j's q.k^T and tile j-1's
# p.v together, waits for q.k^T only and runs tile j's softmax while p.v runs, then rescales the
# accumulator. It keeps a second 16-bit p tile and the q.k^T accumulator live beside the output
# accumulator, so it runs where those fit the registers (``overlaps``). H100, bf16, same runs:
# dense T=16k 0.977x and 1.031x cuDNN against 0.893x and 0.904x serial, causal 1.009x and
# 1.061x against 0.988x and 1.013x, H=256 T=8k 1.023x against 0.929x. ``Variants.overlap_pv``:
# None: that rule; True/False force it (``tools/mosaic_gpu_sweep.py variants
# overlap_pv=False,True``).


def overlaps(block_kv: int, head_dim: int, segments: bool, variants: Variants) -> bool:
  """Whether the forward overlaps each tile's softmax with the previous tile's p.v.

  A consumer thread then holds the float32 output (head_dim / 2 registers), the float32 logits
  (block_kv / 2) and two 16-bit p tiles (block_kv / 4 each) at once, which must fit beside the
  rest. Calls with segment ids (documents) keep the serial walk: their rows are short, and the
  overlapped walk's unpaired first and last tiles cost more than the overlap saves (H100, 16
  causal documents of 1024: 0.227 against 0.207 ms).
  """
  if variants.overlap_pv is not None:
    return variants.overlap_pv
  return (wgmma_accumulator_load is not None and not segments
          and head_dim // 2 + block_kv <= 192)


KEEP_ALIVE = "// p.v's A operand stays live until here"  # (a PTX comment)


def _keep_alive(x):
  """Keeps the registers of ``x`` (a 16-bit wgmma A operand) live until this point, so that
  the compiler does not reuse them while an asynchronous wgmma still reads them (ptxas would
  then serialize every wgmma of the kernel, C7513)."""

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,))
  def emit(_, arr):
    i32 = ir.IntegerType.get_signless(32)
    regs = [llvm.bitcast(i32, r) for r in arr.registers.flat]
    llvm.inline_asm(ir.Type.parse("!llvm.void"), regs, KEEP_ALIVE, ",".join(["r"] * len(regs)),
                    has_side_effects=True)

  emit(x)


def _logits(qk, cfg):
  """``(s, c)``: logits ``s`` whose base-2 value is ``s * c``. Without a soft-cap ``s`` is the
  raw ``q.k`` and ``c = scale * log2(e)``, so the softmax computes ``exp2(s * c - m)`` as one
  fused multiply-add per element (with the row max taken as ``max(s) * c``)."""
  if cfg.softcap is None:
    return qk, cfg.scale * common.LOG2E
  return (cfg.softcap * common.LOG2E) * jnp.tanh(qk * (cfg.scale / cfg.softcap)), 1.0


# The forward's consumers schedule their matmuls on two hardware ("named") barriers, id
# _SCHED_BAR + w for consumer warpgroup w: Mosaic GPU itself uses ids 0 to 3 (0, and 1 +
# warpgroup index). H100, T=16k, bf16, against meetings at a shared-memory barrier (as the
# backward's): dense 0.900x vs 0.877x cuDNN, causal 0.978x vs 0.953x, documents 0.210 vs
# 0.220 ms. The backward's meetings got slower on hardware barriers (dense forward+backward
# 0.897x vs 0.931x), so they stay on shared-memory ones (``_meet``).
_SCHED_BAR = 4


def _bar(op: str, whose: str):
  """``bar.<op>`` (``"sync"`` or ``"arrive"``) of both consumers' 256 threads on this
  warpgroup's (``whose="own"``) or the other consumer's (``"other"``) schedule barrier."""

  @plgpu.inline_mgpu()
  def emit(_):
    i32 = ir.IntegerType.get_signless(32)
    wg = mgpu_utils.warpgroup_idx(sync=True)
    bar = (arith.addi(mgpu_utils.c(_SCHED_BAR, i32), wg) if whose == "own" else
           arith.subi(mgpu_utils.c(_SCHED_BAR + 1, i32), wg))
    llvm.inline_asm(ir.Type.parse("!llvm.void"), [bar], f"bar.{op} $0, 256;", "r",
                    has_side_effects=True)

  emit()


def _issued():
  """A forward consumer has issued its step's first matmul (in the overlapped walk: both): the
  other may issue its next."""
  _bar("arrive", "other")


def _may_issue():
  """Waits until the other forward consumer has issued its matmuls (``_issued``), so that this
  one's follow them on the tensor cores."""
  _bar("sync", "own")


def _meet(sched):
  """Both consumer warpgroups wait until both arrive at the 2-arrival barrier ``sched``."""
  plgpu.barrier_arrive(sched)
  plgpu.barrier_wait(sched)


def _pingpong(loop, before, after):
  """Runs a consumer's ``loop()`` offset by half a step from the other warpgroup's, so one's
  elementwise work overlaps the other's matmuls: warpgroup 1 calls ``before()`` first,
  warpgroup 0 ``after()`` last (both walk the same tiles)."""
  wg = lax.axis_index("wg")
  pl.when(wg == 1)(before)
  out = loop()
  pl.when(wg == 0)(after)
  return out


# Persistent forward: at most one CTA per SM, each walking work items (a q block of one head) in
# turn, so the producer streams the next item's first K/V tiles while the consumers finish the
# current one, and a CTA starts once per SM instead of once per item. It pays where rows are
# short and alike: sliding windows of at most ``Variants.persistent_window`` keys, in the
# overlapped walk.
# H100, T=16k, bf16, causal window 1024: 0.325-0.340 ms against 0.352-0.357 in five runs (cuDNN
# 0.332-0.354), 0.339 against 0.340 in a sixth; windows of 2048 and 4096 keys: a wash
# (0.528-0.548 against 0.538-0.560 ms; 0.914-0.933 against 0.886-0.938). Where rows differ it loses:
# items go to CTAs round-robin, while one CTA per item lets the hardware hand the next item to
# whichever SM is free (causal 1.98 against 1.89-1.93 ms; 16 causal documents of 1024, serial
# walk, 0.252-0.267 against 0.212 ms). ``Variants.persistent``: None: that rule; True/False force
# it; an int sets the CTA count (tests: several items per CTA at small sizes).
# ``tools/mosaic_gpu_sweep.py variants window persistent=None,False``.


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


@dataclasses.dataclass(frozen=True)
class _Geometry:
  """Static sizes of one forward call."""

  bq: int  # rows per consumer warpgroup
  bk: int  # key tile
  slots: int  # K/V shared-memory slots
  group: int  # query heads per kv head
  head_dim: int
  dtype: object
  info_rows: int  # token-info rows: 1 (positions) or 2 (and segment ids)
  q_blocks: int  # q blocks (plan rows) along the sequence
  heads: int  # query heads
  batch: int
  ctas: int  # CTAs launched; each walks work items ctas apart (``_each_item``)
  merge: bool = False  # merge into the earlier passes' (o, lse) (``common.Partial``)
  overlap: bool = False  # each tile's softmax overlaps the previous tile's p.v (``overlaps``)
  order: str = "heads"  # work items' launch order (``item_order``)

  @property
  def items(self) -> int:
    """Work items: one q block (``2 * bq`` rows) of one head."""
    return self.heads * self.q_blocks * self.batch


# The forward's work items in launch order (``_item``): q blocks from the last, so the longest
# rows of causal-type masks start first and the short ones fill the tail, and
#   "heads": heads vary fastest, then q blocks: the longest rows of all heads start first;
#   "blocks": q blocks vary fastest, then heads: CTAs that run at the same time read the same
#     head's K/V, which L2 then serves to all of them.
# ``Variants.item_order``; None: "blocks" from ``Variants.blocks_first_keys`` keys on, else
# "heads". H200, bf16, N=16, H=128 (``tools/mosaic_gpu_sweep.py spans ... item_order=heads,
# blocks``), in batches / one call:
#   dense T=64k   68.5 / 61.7 ms heads, 55.3 / 53.6 ms blocks (cuDNN 58.4 / 60.9)
#   causal T=64k  29.3 / 27.4 ms heads, 27.6 / 27.5 ms blocks (cuDNN 29.8 / 31.2)
#   T=16k dense and causal: the same within the spread; shorter rows lose with "blocks", whose
#   last heads start their longest rows late: causal T=4k 0.127 / 0.123 ms heads against
#   0.150 / 0.144, GQA 32/8 and H=256 at T=8k 4-5%, 16 documents of 1024 2.5%.


def item_order(keys: int, variants: Variants) -> str:
  """The launch order of a forward over ``keys`` keys (padded K/V length)."""
  if variants.item_order is not None:
    return variants.item_order
  return "blocks" if keys >= variants.blocks_first_keys else "heads"


def _item(g: _Geometry, i):
  """``(batch, head, qi)`` of work item ``i`` in ``g.order`` (``item_order``); q blocks run from
  the last (H100: causal 1.73 vs 1.98 ms with heads fastest)."""
  heads, q_blocks = (jnp.asarray(n, i.dtype) for n in (g.heads, g.q_blocks))  # (also under x64)
  if g.order == "blocks":
    qi, rest = lax.rem(i, q_blocks), lax.div(i, q_blocks)
    return lax.div(rest, heads), lax.rem(rest, heads), q_blocks - 1 - qi
  head, rest = lax.rem(i, heads), lax.div(i, heads)
  return lax.div(rest, q_blocks), head, q_blocks - 1 - lax.rem(rest, q_blocks)


def _each_item(g: _Geometry, body, carry):
  """``carry = body(i, carry)`` for each work item ``i`` of this CTA: ``cta``, ``cta + g.ctas``,
  ... (one item, ``cta``, unless persistent)."""
  cta = lax.axis_index("cta")
  ctas = jnp.asarray(g.ctas, cta.dtype)
  return lax.fori_loop(jnp.asarray(0, cta.dtype), lax.div(g.items - 1 - cta, ctas) + 1,
                       lambda t, carry: body(cta + t * ctas, carry), carry)


def _fwd_kernel(idx_ref, cnt_ref, full_ref, qinfo_ref, kinfo_ref, q_ref, k_ref, v_ref, *io,
                cfg, g: _Geometry):
  *acc_refs, o_ref, lse_ref, scoped = io  # acc_refs: the earlier passes' (o, lse) when merging
  (q_smem2, k_smem, v_smem, lse_smem2, qinfo_smem2, kinfo_smem), bars = scoped
  (k_bar, v_bar, q_bar), (k_free, v_free) = bars
  wg = lax.axis_index("wg")
  bq, bk, h = g.bq, g.bk, g.head_dim

  def plan_row(batch, head, qi):
    """``(kv index row, count, n_full)`` of an item's plan row."""
    lists = lambda ref: ref.at[common.sel(ref.shape[0], batch), common.sel(ref.shape[1], head)]
    return lists(idx_ref).at[qi], lists(cnt_ref)[qi], lists(full_ref)[qi]

  @pl.when(wg < _COMPUTE_WGS)
  def _consumer():
    plgpu.set_max_registers(_CONSUMER_REGS, action="increase")
    q_smem, lse_smem, qinfo_smem = q_smem2.at[wg], lse_smem2.at[wg], qinfo_smem2.at[wg]
    m0, l0 = _row_vector(common.NEG_INF, bq), _row_vector(0.0, bq)

    first_row = lambda qi: qi * (_COMPUTE_WGS * bq) + wg * bq  # this consumer's, in q block qi

    def load_q(i):
      """Issues the loads of this consumer's q rows of item ``i`` and their token info."""
      batch, head, qi = _item(g, i)
      q0 = first_row(qi)
      plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(q0, bq), head], q_smem, q_bar.at[wg])
      plgpu.copy_gmem_to_smem(qinfo_ref.at[common.sel(qinfo_ref.shape[0], batch), :,
                                           pl.ds(q0, bq)], qinfo_smem, q_bar.at[wg])

    def item(i, base):
      """This consumer's rows of item ``i``; ``base`` counts the CTA's earlier tiles (the slot
      ring runs on across items). Returns it with this item's tiles added."""
      batch, head, qi = _item(g, i)
      q0 = first_row(qi)
      idx_row, count, n_full = plan_row(batch, head, qi)
      at = lambda j: _slot(base + j, g.slots)  # the slot of the item's tile j
      plgpu.barrier_wait(q_bar.at[wg])
      # Token info rows (positions, then segment ids) broadcast to the [bq, bk] tile.
      q_info = _info_rows(qinfo_smem, _ROWS, (bq, bk), 0, g.info_rows)

      def visible(k0, slot):
        k_info = _info_rows(kinfo_smem.at[slot], _COLS, (bq, bk), 1, g.info_rows)
        k_index = k0 + plgpu.broadcasted_iota(jnp.int32, (bq, bk), 1, layout=plgpu.Layout.WGMMA)
        return common.tile_visible(cfg, q_info[0], k_info[0], k_index, *q_info[1:], *k_info[1:])

      def softmax(s_raw, k0, slot, m, l, masked):
        """``(p16, m, l, alpha)`` after the raw logits of the tile of keys from ``k0``; releases
        the tile's K slot."""
        s, c = _logits(s_raw, cfg)
        # The slot's key info is read before the slot is released to the producer (which then
        # overwrites it with a later tile's).
        vis = visible(k0, slot) if masked else None
        plgpu.barrier_arrive(k_free.at[slot])
        if masked:
          s = jnp.where(vis, s, common.NEG_INF)
        m_new = jnp.maximum(m, s.max(axis=1) * c)  # base 2
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s * c - lax.broadcast_in_dim(m_new, s.shape, [0]))
        if masked:
          p = jnp.where(vis, p, 0.0)
        return p.astype(g.dtype), m_new, l * alpha + p.sum(axis=1), alpha

      def serial_step(j, carry, masked):
        """Tile j: q.k^T, its softmax, then p.v, complete before tile j+1's q.k^T."""
        acc, m, l = carry
        slot = at(j)

        def qk(acc_ref):
          plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
          _issued()
          return acc_ref[...]

        p16, m_new, l, alpha = softmax(pl.run_scoped(qk, plgpu.ACC((bq, bk), jnp.float32)),
                                       idx_row[j] * bk if masked else None, slot, m, l, masked)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
        plgpu.barrier_wait(v_bar.at[slot])
        _may_issue()

        def pv(acc_ref):
          plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
          nxt = j + 1

          @pl.when(nxt < count)
          def _():
            plgpu.barrier_wait(k_bar.at[at(nxt)])

        acc = pl.run_state(pv)(plgpu.ACC.init(acc))
        plgpu.barrier_arrive(v_free.at[slot])
        return acc, m_new, l

      def serial_walk():
        @pl.when(count > 0)
        def _():
          plgpu.barrier_wait(k_bar.at[at(0)])

        acc = plgpu.layout_cast(jnp.zeros((bq, h), jnp.float32), plgpu.Layout.WGMMA)
        full = lax.fori_loop(0, n_full, functools.partial(serial_step, masked=False),
                             (acc, m0, l0))
        return lax.fori_loop(n_full, count, functools.partial(serial_step, masked=True), full)

      def overlapped_step(o_ref, j, p16_prev, m, l, masked):
        """Issues tile j's q.k^T and (unless ``p16_prev`` is None) tile j-1's p.v into
        ``o_ref``, and returns tile j's ``(p16, m, l)`` from its softmax, run while p.v runs;
        then waits for p.v and rescales ``o_ref``."""
        slot, prev = at(j), at(j + g.slots - 1)
        plgpu.barrier_wait(k_bar.at[slot])
        _may_issue()

        def qk(s_ref):
          plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
          if p16_prev is not None:
            plgpu.barrier_wait(v_bar.at[prev])
            plgpu.wgmma(o_ref, p16_prev, v_smem.at[prev])
          _issued()
          # q.k^T was issued first, so it is done once at most p.v is in flight.
          return wgmma_accumulator_load(s_ref, wait_n=0 if p16_prev is None else 1)

        p16, m_new, l, alpha = softmax(pl.run_scoped(qk, plgpu.ACC((bq, bk), jnp.float32)),
                                       idx_row[j] * bk if masked else None, slot, m, l, masked)
        if p16_prev is not None:
          plgpu.wgmma_wait(0)
          _keep_alive(p16_prev)
          plgpu.barrier_arrive(v_free.at[prev])
          o_ref[...] = o_ref[...] * lax.broadcast_in_dim(alpha, (bq, h), [0])
        return p16, m_new, l

      def overlapped_walk(o_ref):
        step = lambda masked: lambda j, carry: overlapped_step(o_ref, j, *carry, masked=masked)
        # The first tile is always masked (its token info is loaded for that), as only it has
        # no p.v to overlap.
        first = lambda: overlapped_step(o_ref, jnp.int32(0), None, m0, l0, masked=True)
        p16 = plgpu.layout_cast(jnp.zeros((bq, bk), g.dtype), plgpu.Layout.WGMMA)
        carry = lax.cond(count > 0, first, lambda: (p16, m0, l0))
        carry = lax.fori_loop(1, n_full, step(False), carry)
        p16, m, l = lax.fori_loop(jnp.maximum(n_full, 1), count, step(True), carry)

        @pl.when(count > 0)
        def _():  # the last tile's p.v
          last = at(count - 1)
          _may_issue()
          plgpu.barrier_wait(v_bar.at[last])
          plgpu.wgmma(o_ref, p16, v_smem.at[last])
          _issued()
          plgpu.wgmma_wait(0)
          plgpu.barrier_arrive(v_free.at[last])

        return o_ref[...], m, l

      if g.overlap:
        acc, m, l = pl.run_scoped(overlapped_walk, plgpu.ACC((bq, h), jnp.float32))
      else:
        acc, m, l = serial_walk()

      nxt = i + g.ctas
      if g.merge:  # (the q tile is free: the next item's q loads while these rows merge)
        pl.when(nxt < g.items)(lambda: load_q(nxt))
      empty = l == 0.0
      inv = 1.0 / jnp.where(empty, 1.0, l)
      lse = jnp.where(empty, -jnp.inf, m * common.LN2 + jnp.log(jnp.where(empty, 1.0, l)))
      rows = lambda x: lax.broadcast_in_dim(x, acc.shape, [0])
      seq = pl.ds(q0, bq)
      own_o, own_lse = o_ref.at[batch, seq, head], lse_ref.at[batch, head, seq]
      if g.merge:  # the earlier passes' rows, read from and written to global memory in float32
        acc_o, acc_lse = acc_refs
        lse, c_acc, c_own = common.merge_weights(
            _load(acc_lse.at[batch, head, seq], _ROWS, optimized=False), lse)
        earlier = _load(acc_o.at[batch, seq, head], plgpu.Layout.WGMMA, optimized=False)
        own_o[...] = earlier * rows(c_acc) + acc * rows(inv * c_own)
        own_lse[...] = lse
      else:  # through the q tile's shared memory, which the next item's q then overwrites
        q_smem[...] = (acc * rows(inv)).astype(g.dtype)
        lse_smem[...] = lse
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, own_o)
        plgpu.copy_smem_to_gmem(lse_smem, own_lse)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        pl.when(nxt < g.items)(lambda: load_q(nxt))
      return base + count

    load_q(lax.axis_index("cta"))
    # The consumers' schedule runs on across items, as one walk. Overlapped: one issue phase
    # per step, warpgroup 1 lets warpgroup 0 issue first and warpgroup 0 takes that extra
    # arrival last; serial: warpgroup 1 waits for warpgroup 0's first issue.
    _pingpong(lambda: _each_item(g, item, jnp.int32(0)),
              *((_issued, _may_issue) if g.overlap else (_may_issue, _issued)))
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == _COMPUTE_WGS)
  def _producer():
    plgpu.set_max_registers(_PRODUCER_REGS, action="decrease")

    def item(i, base):
      """Streams item ``i``'s K/V tiles into the slot ring, which runs on from ``base``."""
      batch, head, qi = _item(g, i)
      idx_row, count, n_full = plan_row(batch, head, qi)
      kv_head = lax.div(head, jnp.asarray(g.group, head.dtype))
      k_info_b = common.sel(kinfo_ref.shape[0], batch)

      @pl.loop(0, count)
      def _(j):
        n = base + j  # the CTA's tile count
        slot = _slot(n, g.slots)
        keys = pl.ds(idx_row[j] * bk, bk)
        src = (batch, keys, kv_head)

        @pl.when(n >= g.slots)
        def _():
          plgpu.barrier_wait(k_free.at[slot])

        plgpu.copy_gmem_to_smem(k_ref.at[src], k_smem.at[slot], k_bar.at[slot])

        # Only masked tiles read the keys' token info (and the overlapped walk's first tile,
        # which it always masks).
        with_info = (j >= n_full) | (j == 0) if g.overlap else j >= n_full

        @pl.when(with_info)
        def _():
          plgpu.copy_gmem_to_smem(kinfo_ref.at[k_info_b, :, keys], kinfo_smem.at[slot],
                                  k_bar.at[slot])

        @pl.when(jnp.logical_not(with_info))
        def _():
          plgpu.barrier_arrive(k_bar.at[slot])  # the phase's second arrival, without data

        @pl.when(n >= g.slots)
        def _():
          plgpu.barrier_wait(v_free.at[slot])

        plgpu.copy_gmem_to_smem(v_ref.at[src], v_smem.at[slot], v_bar.at[slot])

      return base + count

    _each_item(g, item, jnp.int32(0))


@functools.partial(jax.jit, static_argnames=("cfg",))
def forward(q, k, v, ops: common.Operands, plan, cfg: common.KernelConfig, acc=None):
  """See ``kernels.common``: returns ``(o [B, Tp, N, Hp], lse [B, N, Tp] float32)``.

  ``o`` leaves the kernel in the inputs' 16-bit dtype (it is staged through the q tile's shared
  memory) and is cast to ``cfg.out_dtype``. Given ``acc`` (the ring's running result) the kernel
  merges into it instead: each consumer reads its rows of ``acc`` once it has finished its walk
  and writes the merged float32 rows (H100, 8k tokens/GPU, N=16, H=128: a ring step's forward
  0.963 ms against 0.980 with the merge after the kernel, 0.898 for the kernel alone; the read
  after the walk stalls each CTA, see BENCHMARKS.md).
  """
  if cfg.interpret:  # no Mosaic GPU interpreter for this kernel: Triton's emulates the plan walk
    return pallas_triton.forward(q, k, v, ops, plan, dataclasses.replace(cfg, num_stages=None),
                                 acc)
  why = unsupported(_ops_call(q, ops))
  if why is not None:
    raise NotImplementedError(f"backend 'pallas_mosaic_gpu' cannot serve {why}.")
  b, tp, n, hp = q.shape
  itemsize = jnp.dtype(q.dtype).itemsize
  check_tiles(cfg, hp, itemsize)
  variants = cfg.variants or Variants()
  overlap = overlaps(cfg.block_kv, hp, ops.q_info.segment_ids is not None, variants)
  g = _Geometry(bq=cfg.block_q // _COMPUTE_WGS, bk=cfg.block_kv,
                slots=slots(cfg, hp, itemsize), group=n // k.shape[2], head_dim=hp,
                dtype=q.dtype, info_rows=1 if ops.q_info.segment_ids is None else 2,
                q_blocks=tp // cfg.block_q, heads=n, batch=b,
                ctas=persistent_ctas(n * (tp // cfg.block_q) * b, cfg.mask, overlap, variants),
                merge=acc is not None, overlap=overlap, order=item_order(k.shape[1], variants))
  smem = functools.partial(_smem, q.dtype)
  scratch = (smem(_COMPUTE_WGS, g.bq, hp), smem(g.slots, g.bk, hp), smem(g.slots, g.bk, hp),
             plgpu.SMEM((_COMPUTE_WGS, g.bq), jnp.float32),
             plgpu.SMEM((_COMPUTE_WGS, g.info_rows, g.bq), jnp.int32),
             plgpu.SMEM((g.slots, g.info_rows, g.bk), jnp.int32))
  # q and k tiles arrive with their token info: two copies, so two arrivals per phase.
  barriers = ((plgpu.Barrier(num_arrivals=2, num_barriers=g.slots),
               plgpu.Barrier(num_barriers=g.slots),
               plgpu.Barrier(num_arrivals=2, num_barriers=_COMPUTE_WGS)),
              (plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=g.slots),) * 2)

  def entry(*refs):
    pl.run_scoped(lambda *scoped: _fwd_kernel(*refs, (scoped[:6], scoped[6:]), cfg=cfg, g=g),
                  *scratch, *barriers, collective_axes="wg")

  o_dtype = jnp.float32 if g.merge else q.dtype
  o, lse = plgpu.kernel(
      entry,
      out_type=(jax.ShapeDtypeStruct(q.shape, o_dtype), jax.ShapeDtypeStruct((b, n, tp),
                                                                             jnp.float32)),
      grid=(g.ctas,), grid_names=("cta",), num_threads=_COMPUTE_WGS + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )(plan.kv_index, plan.kv_count, plan.kv_full, token_info(ops.q_info),
    token_info(ops.kv_info), q, k, v, *(() if acc is None else (acc.o.astype(jnp.float32),
                                                                acc.lse.astype(jnp.float32))))
  return o.astype(cfg.out_dtype), lse


# ---------------------------------------------------------------------------------- backward --
#
# Two kernels, each warp-specialized like the forward (a producer warpgroup streams tiles by TMA
# into `slots` shared-memory slots, consumer warpgroups own 64 rows each), and neither
# accumulates across CTAs, so results are bitwise reproducible:
#   dK/dV: a CTA owns 128 keys of one kv head (two consumers of 64) and walks, for each query head
#     of the group, the transposed plan row of its kv block (q_index): q, dO, lse and delta in
#     ``Variants.dkv_walk_rows`` tiles. dK and dV accumulate per kv head in registers (GQA needs no
#     per-query-head temporary). The consumers alternate their matmuls like the forward's (H100,
#     T=16k: dK/dV 5% faster dense, 8% causal; the same schedule made the dQ kernel slower,
#     4.4 -> 5.4 ms dense with 64-key tiles, forward+backward 0.89x -> 0.86x cuDNN with 128,
#     so it has none).
#   dQ: a CTA owns 128 query rows of one head (two consumers of 64) and walks its plan row
#     (kv_index): K and V in ``Variants.dq_walk_rows`` tiles. It runs first: given delta as a RowTerm, it
#     computes delta = sum(o * dO) - dlse of its rows (o read from global memory into registers
#     once) and writes it for dK/dV, so no separate pass reads o and dO.
# Above head dim 128 ("wide"), a warpgroup's float32 dK and dV of 64 keys alone would fill its
# registers (2 x 128 per thread at H=256), so both kernels own 64 rows per CTA:
#   dK/dV: the two consumers share the CTA's 64 keys and split the work: warpgroup 0 computes
#     p^T = exp(K q^T - lse) and dV += p^T dO, warpgroup 1 dp^T = V dO^T and dK += ds^T q, with
#     ds^T = p^T (dp^T - delta); p^T passes through two shared-memory buffers. Each warpgroup
#     runs two of the four matmuls, and the wait for p^T offsets warpgroup 1 by half a step, so
#     one's elementwise work overlaps the other's matmuls.
#   dQ: one consumer owns the CTA's 64 rows (two sets of q, dO and K/V slots do not fit in
#     shared memory).
# In every kernel the output staging tiles share memory with the walked slots (plgpu.RefUnion):
# the consumers meet once both are done with the slots, then write. This leaves room for longer
# walked tiles (dQ at H=128: 128 keys, wgmmas of N = 128) or more slots.

BWD_ROWS = WG_ROWS  # rows of an owned tile per warpgroup
BWD_BLOCK = _COMPUTE_WGS * BWD_ROWS  # the backward plan's tiles (block_q_bwd = block_kv_bwd)
# Rows of a walked tile (``Variants``). dK/dV walks q tiles of ``dkv_walk_rows``, 128 at head
# dims <= 64 (H100: 0.97x cuDNN forward+backward at H=64 against 0.92x with 64): above, its
# float32 dK, dV, s^T and dp^T fill the registers. dQ walks K/V tiles of ``dq_walk_rows`` (64 in
# wide kernels, whose float32 dQ takes 128 registers; and where two slots would not fit).
# ``Variants.delta_in_dq``: whether the dQ kernel computes delta from a RowTerm (False: XLA's
# separate pass computes it; ``tools/mosaic_gpu_sweep.py bwd delta_in_dq=True,False``). H100,
# T=16k: documents 0.814 vs 0.854 ms forward+backward; dense and causal take the same GPU time
# either way (profiler traces of alternating runs: the dQ kernel's 15-25 us more against XLA's
# 48 us pass), although wall-clock medians of causal read 2-4% slower with it.


def backward_unsupported(cfg: common.KernelConfig, head_dim: int) -> Optional[str]:
  """Why the Mosaic GPU backward cannot serve a call its forward serves (None when it can);
  ``backward`` then runs ``pallas_triton``'s over the same plan."""
  if (cfg.block_q_bwd, cfg.block_kv_bwd) != (BWD_BLOCK, BWD_BLOCK):
    return (f"backward tiles ({cfg.block_q_bwd}, {cfg.block_kv_bwd}) (it takes "
            f"({BWD_BLOCK}, {BWD_BLOCK}): two warpgroups of {BWD_ROWS} rows)")
  return None


def _owners(wide: bool) -> int:
  """Owned tiles (of 64 rows) per backward CTA: one when wide, else one per consumer."""
  return 1 if wide else _COMPUTE_WGS


@dataclasses.dataclass(frozen=True)
class _BwdGeometry:
  """Static sizes of one backward kernel call."""

  slots: int  # walked-tile shared-memory slots
  group: int  # query heads per kv head
  head_dim: int
  dtype: object  # the inputs' 16-bit dtype
  info_rows: int  # token-info rows: 1 (positions) or 2 (and segment ids)
  blocks: int  # CTAs along the owned sequence
  walked_heads: int  # query heads walked per CTA: `group` for dK/dV, 1 for dQ
  walk: int  # rows of a walked tile
  wide: bool  # 64 owned rows per CTA (see above): head dims above ``Variants.wide_*_above``
  delta_from_o: bool = False  # dQ: computes delta from o (a ``common.RowTerm``) and returns it
  add_dq: bool = False  # dQ: adds ``dq_acc`` (the ring's running dq) to its rows

  rows = BWD_ROWS  # owned rows per warpgroup

  @property
  def nsub(self) -> int:
    """Walked tiles per plan block."""
    return BWD_BLOCK // self.walk

  @property
  def owners(self) -> int:
    """Owned tiles per CTA (``_owners``)."""
    return _owners(self.wide)

  @property
  def cta_rows(self) -> int:
    """Owned rows per CTA."""
    return self.owners * BWD_ROWS

  def plan_block(self, cta):
    """The plan block (row of the plan's lists) of the CTA at ``cta`` along the sequence."""
    return lax.div(cta, jnp.asarray(BWD_BLOCK // self.cta_rows, cta.dtype))


def _walk(g: _BwdGeometry, plan_row, body, carry):
  """Calls ``carry = body(head, start, masked, carry)`` for every tile the CTA walks.

  Args:
    plan_row: ``head -> (index_row_ref, count, n_full)`` for query head ``head`` (a rank in
      ``[0, g.walked_heads)``); the entries ``[0, n_full)`` are walked mask-free, the rest masked.
    body: one walked tile at row ``start``; producer and consumers walk identically, so a carried
      tile counter gives both the same ring slot.
  """

  def head(h, carry):
    idx_row, count, n_full = plan_row(h)

    def tile(t, carry, masked):
      t, nsub = jnp.asarray(t, jnp.int32), jnp.int32(g.nsub)
      start = idx_row[lax.div(t, nsub)] * BWD_BLOCK + lax.rem(t, nsub) * g.walk
      return body(h, start, masked, carry)

    carry = lax.fori_loop(0, n_full * g.nsub, functools.partial(tile, masked=False), carry)
    return lax.fori_loop(n_full * g.nsub, count * g.nsub, functools.partial(tile, masked=True),
                         carry)

  if g.walked_heads == 1:
    return head(0, carry)
  # (int32 bounds: the head index stays int32 under x64)
  return lax.fori_loop(jnp.int32(0), jnp.int32(g.walked_heads), head, carry)


def _zeros(shape):
  return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)


def _products(tile, pairs, issued=lambda: None):
  """``[a b^T for a, b in pairs]``, float32 ``tile``-shaped, from shared-memory operands (one
  wgmma wait); ``issued()`` runs once all are issued."""

  def run(refs):
    for ref, (a, b) in zip(refs, pairs):
      plgpu.wgmma(ref, a, b.transpose((1, 0)))
    issued()

  return pl.run_state(run)(tuple(plgpu.ACC.init(_zeros(tile)) for _ in pairs))


def _accumulate(terms):
  """``[acc + a b for acc, a, b in terms]``: ``a`` in registers (16-bit, wgmma layout), ``b`` in
  shared memory (one wgmma wait)."""

  def run(refs):
    for ref, (_, a, b) in zip(refs, terms):
      plgpu.wgmma(ref, a, b)

  return pl.run_state(run)(tuple(plgpu.ACC.init(acc) for acc, _, _ in terms))


def _probs(s_raw, lse2, vis, cfg, row_axis: int):
  """``(p, dlogits)`` of a tile from raw ``q.k`` products: ``lse2`` (base 2) is a vector along
  axis ``row_axis`` of the tile's query rows (0 for dQ's ``[q, k]`` tiles, 1 for dK/dV's
  transposed ``[k, q]`` ones); ``dlogits`` is the soft-cap's derivative (None without)."""
  s, c = _logits(s_raw, cfg)
  p = jnp.exp2(s * c - lax.broadcast_in_dim(lse2, s.shape, [row_axis]))
  if vis is not None:
    p = jnp.where(vis, p, 0.0)
  return p, None if cfg.softcap is None else common.softcap_grad(s * common.LN2, cfg)


def _grad_logits(p, dp, delta, dlogits, row_axis: int):
  """``ds``, the raw-logit gradient / scale, from ``p`` and ``dp = dO.v`` (``_probs``)."""
  ds = p * (dp - lax.broadcast_in_dim(delta, p.shape, [row_axis]))
  return ds if dlogits is None else ds * dlogits


def _finish(done, stage, *results):
  """Writes a consumer's ``(dst, value)`` results, ``[rows, H]`` float32 tiles, to global memory
  through its staging tile ``stage``, once the consumers have met at ``done`` (None: the only
  consumer): the staging tiles alias the walked slots."""
  if done is not None:
    _meet(done)
  for dst, value in results:
    stage[...] = value.astype(stage.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(stage, dst)
    plgpu.wait_smem_to_gmem(0)


def _dkv_kernel(idx_ref, cnt_ref, full_ref, qinfo_ref, kinfo_ref, q_ref, k_ref, v_ref, do_ref,
                lse_ref, delta_ref, dk_ref, dv_ref, owned, walked, out2, bars, *, cfg,
                g: _BwdGeometry):
  k_own2, v_own2, kinfo_own2, p_smem = owned  # p_smem: the wide kernel's p^T buffers
  q_smem, do_smem, lse_smem, delta_smem, qinfo_smem = walked
  own_bar, q_bar, do_bar, free, sched, p_full, p_free = bars
  batch, kv_head, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
  kj = lax.axis_index("kv_seq")  # causal-type masks give the first kv blocks the longest lists
  rows = g.rows
  q_info_b, k_info_b = common.sel(qinfo_ref.shape[0], batch), common.sel(kinfo_ref.shape[0], batch)
  q_head = lambda h: kv_head * g.group + h
  tile = (rows, g.walk)  # [keys, queries]

  def plan_row(h):
    at = lambda ref: ref.at[common.sel(ref.shape[0], batch), common.sel(ref.shape[1], q_head(h))]
    blk = g.plan_block(kj)
    return at(idx_ref).at[blk], at(cnt_ref)[blk], at(full_ref)[blk]

  # The owned tiles of this consumer (wide kernels: one K/V pair, shared by both consumers).
  # (Refs are indexed by traced values only: JAX 0.11.2 fails on static ones inside loops.)
  k_own, v_own, kinfo_own = (k_own2, v_own2, kinfo_own2) if g.wide else (
      k_own2.at[wg], v_own2.at[wg], kinfo_own2.at[wg])

  def own_keys(k=True, v=True):
    """Loads this consumer's owned tiles: K with the keys' token info (``k``) and V (``v``).
    Returns the keys' output block and, with ``k``, their token info and index in a tile."""
    k0 = kj * rows if g.wide else kj * BWD_BLOCK + wg * rows
    own, bar = (batch, pl.ds(k0, rows), kv_head), own_bar.at[wg]
    copies = ([(k_ref.at[own], k_own), (kinfo_ref.at[k_info_b, :, pl.ds(k0, rows)], kinfo_own)]
              if k else []) + ([(v_ref.at[own], v_own)] if v else [])
    for src, dst in copies:
      plgpu.copy_gmem_to_smem(src, dst, bar)
    for _ in range(3 - len(copies)):  # (wide consumers: the phase's other arrivals, no data)
      plgpu.barrier_arrive(bar)
    plgpu.barrier_wait(bar)
    if not k:
      return own, None
    k_info = _info_rows(kinfo_own, _ROWS, tile, 0, g.info_rows)
    return own, (k_info, k0 + plgpu.broadcasted_iota(jnp.int32, tile, 0,
                                                     layout=plgpu.Layout.WGMMA))

  def visible(slot, keys):
    (k_info, k_index), q_info = keys, _info_rows(qinfo_smem.at[slot], _COLS, tile, 1, g.info_rows)
    return common.tile_visible(cfg, q_info[0], k_info[0], k_index, *q_info[1:], *k_info[1:])

  def walk(body, *acc):
    """The consumers' walk from accumulators ``acc``; returns them."""
    return _walk(g, plan_row, body, (jnp.int32(0), *acc))[1:]

  if not g.wide:
    @pl.when(wg < _COMPUTE_WGS)
    def _consumer():  # each consumer: its own 64 keys' p, ds, dK and dV
      plgpu.set_max_registers(_CONSUMER_REGS, action="increase")
      own, keys = own_keys()

      def body(h, start, masked, carry):
        n, dk, dv = carry
        slot = _slot(n, g.slots)
        q, do = q_smem.at[slot], do_smem.at[slot]
        plgpu.barrier_wait(q_bar.at[slot])
        plgpu.barrier_wait(do_bar.at[slot])
        # s^T = K q^T, dp^T = V dO^T
        s, dp = _products(tile, ((k_own, q), (v_own, do)),
                          functools.partial(_meet, sched))
        p, dlogits = _probs(s, _load(lse_smem.at[slot], _COLS),
                            visible(slot, keys) if masked else None, cfg, row_axis=1)
        ds = _grad_logits(p, dp, _load(delta_smem.at[slot], _COLS), dlogits, row_axis=1)
        p, ds = lax.optimization_barrier((p.astype(g.dtype), ds.astype(g.dtype)))
        _meet(sched)  # the other warpgroup's matmuls are issued
        dv, dk = _accumulate(((dv, p, do), (dk, ds, q)))  # dV += p^T dO, dK += ds^T q
        plgpu.barrier_arrive(free.at[slot])
        return n + 1, dk, dv

      acc = _zeros((rows, g.head_dim))
      meet = functools.partial(_meet, sched)
      dk, dv = _pingpong(lambda: walk(body, acc, acc), meet, meet)
      _finish(sched, out2.at[wg], (dk_ref.at[own], dk * cfg.scale), (dv_ref.at[own], dv))

  if g.wide:
    @pl.when(wg == 0)
    def _p_and_dv():  # p^T = exp(K q^T - lse) to warpgroup 1, dV += p^T dO
      plgpu.set_max_registers(_CONSUMER_REGS, action="increase")
      own, keys = own_keys(v=False)

      def body(h, start, masked, carry):
        n, dv = carry
        slot, buf = _slot(n, g.slots), _slot(n, 2)
        plgpu.barrier_wait(q_bar.at[slot])
        (s,) = _products(tile, ((k_own, q_smem.at[slot]),))
        p, dlogits = _probs(s, _load(lse_smem.at[slot], _COLS),
                            visible(slot, keys) if masked else None, cfg, row_axis=1)

        @pl.when(n >= 2)
        def _():
          plgpu.barrier_wait(p_free.at[buf])

        p_smem.at[buf][...] = (p if dlogits is None else p * dlogits).astype(g.dtype)
        plgpu.barrier_arrive(p_full.at[buf])
        plgpu.barrier_wait(do_bar.at[slot])
        (dv,) = _accumulate(((dv, p.astype(g.dtype), do_smem.at[slot]),))
        plgpu.barrier_arrive(free.at[slot])
        return n + 1, dv

      (dv,) = walk(body, _zeros((rows, g.head_dim)))
      _finish(sched, out2.at[wg], (dv_ref.at[own], dv))

    @pl.when(wg == 1)
    def _ds_and_dk():  # dp^T = V dO^T; ds^T from warpgroup 0's p^T; dK += ds^T q
      plgpu.set_max_registers(_CONSUMER_REGS, action="increase")
      own, _ = own_keys(k=False)

      def body(h, start, masked, carry):
        n, dk = carry
        slot, buf = _slot(n, g.slots), _slot(n, 2)
        plgpu.barrier_wait(do_bar.at[slot])
        (dp,) = _products(tile, ((v_own, do_smem.at[slot]),))
        plgpu.barrier_wait(p_full.at[buf])
        p = _load(p_smem.at[buf], plgpu.Layout.WGMMA).astype(jnp.float32)  # (soft-cap folded)
        plgpu.barrier_arrive(p_free.at[buf])
        ds = _grad_logits(p, dp, _load(delta_smem.at[slot], _COLS), None, row_axis=1)
        plgpu.barrier_wait(q_bar.at[slot])
        (dk,) = _accumulate(((dk, ds.astype(g.dtype), q_smem.at[slot]),))
        plgpu.barrier_arrive(free.at[slot])
        return n + 1, dk

      (dk,) = walk(body, _zeros((rows, g.head_dim)))
      _finish(sched, out2.at[wg], (dk_ref.at[own], dk * cfg.scale))

  @pl.when(wg == _COMPUTE_WGS)
  def _producer():
    plgpu.set_max_registers(_PRODUCER_REGS, action="decrease")

    def body(h, start, masked, n):
      slot = _slot(n, g.slots)
      qh, seq = q_head(h), pl.ds(start, g.walk)

      @pl.when(n >= g.slots)
      def _():
        plgpu.barrier_wait(free.at[slot])

      plgpu.copy_gmem_to_smem(q_ref.at[batch, seq, qh], q_smem.at[slot], q_bar.at[slot])
      plgpu.copy_gmem_to_smem(lse_ref.at[batch, qh, seq], lse_smem.at[slot], q_bar.at[slot])
      if masked:
        plgpu.copy_gmem_to_smem(qinfo_ref.at[q_info_b, :, seq], qinfo_smem.at[slot],
                                q_bar.at[slot])
      else:
        plgpu.barrier_arrive(q_bar.at[slot])  # the phase's third arrival, without data
      plgpu.copy_gmem_to_smem(do_ref.at[batch, seq, qh], do_smem.at[slot], do_bar.at[slot])
      plgpu.copy_gmem_to_smem(delta_ref.at[batch, qh, seq], delta_smem.at[slot], do_bar.at[slot])
      return n + 1

    _walk(g, plan_row, body, jnp.int32(0))


def _dq_kernel(idx_ref, cnt_ref, full_ref, qinfo_ref, kinfo_ref, q_ref, k_ref, v_ref, do_ref,
               lse_ref, *refs, cfg, g: _BwdGeometry):
  # The row term's refs: delta in, or (``g.delta_from_o``) o and optionally dlse in, delta out;
  # then dq_acc in (``g.add_dq``).
  *io, owned, walked, out2, bars = refs
  outs = 2 if g.delta_from_o else 1
  ins, (dq_ref, *delta_out) = io[:-outs], io[-outs:]
  acc_ref = ins[-1] if g.add_dq else None
  ins = ins[:-1] if g.add_dq else ins
  if g.delta_from_o:
    o_ref, *dlse_ref = ins
    row_in, delta_out = (dlse_ref[0] if dlse_ref else None), delta_out[0]
  else:
    (row_in,), o_ref = ins, None
  q_own2, do_own2, lse_own2, delta_own2, qinfo_own2 = owned
  k_smem, v_smem, kinfo_smem = walked
  own_bar, k_bar, v_bar, free, done = bars
  batch, head, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
  qi = g.blocks - 1 - lax.axis_index("q_seq")  # longest causal rows first, as in the forward
  rows, consumers = g.rows, g.owners
  q_info_b, k_info_b = common.sel(qinfo_ref.shape[0], batch), common.sel(kinfo_ref.shape[0], batch)
  kv_head = lax.div(head, jnp.asarray(g.group, head.dtype))

  def plan_row(h):
    del h
    at = lambda ref: ref.at[common.sel(ref.shape[0], batch), common.sel(ref.shape[1], head)]
    blk = g.plan_block(qi)
    return at(idx_ref).at[blk], at(cnt_ref)[blk], at(full_ref)[blk]

  @pl.when(wg < consumers)
  def _consumer():
    plgpu.set_max_registers(_CONSUMER_REGS, action="increase")
    q_own, do_own = q_own2.at[wg], do_own2.at[wg]
    q0 = qi * g.cta_rows + wg * rows
    own, seq = (batch, pl.ds(q0, rows), head), pl.ds(q0, rows)
    delta_own = delta_own2.at[wg]  # delta, dlse, or nothing (then computed from o alone)
    for src, dst in ((q_ref.at[own], q_own), (do_ref.at[own], do_own),
                     (lse_ref.at[batch, head, seq], lse_own2.at[wg]),
                     (qinfo_ref.at[q_info_b, :, seq], qinfo_own2.at[wg]),
                     *([(row_in.at[batch, head, seq], delta_own)] if row_in is not None else [])):
      plgpu.copy_gmem_to_smem(src, dst, own_bar.at[wg])
    if g.delta_from_o:  # (global loads issued while the copies fly; o is read only here)
      o = _load(o_ref.at[own], plgpu.Layout.WGMMA, optimized=False)
    plgpu.barrier_wait(own_bar.at[wg])
    tile = (rows, g.walk)  # [queries, keys]
    q_info = _info_rows(qinfo_own2.at[wg], _ROWS, tile, 0, g.info_rows)
    lse2 = _load(lse_own2.at[wg], _ROWS)
    if g.delta_from_o:  # delta = sum(o * dO) - dlse, also the dK/dV kernel's
      delta = (o.astype(jnp.float32) * _load(do_own, plgpu.Layout.WGMMA).astype(jnp.float32)
               ).sum(axis=1)
      if row_in is not None:
        delta = delta - _load(delta_own, _ROWS)
      delta_own[...] = delta
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(delta_own, delta_out.at[batch, head, seq])  # (waited in _finish)
    else:
      delta = _load(delta_own, _ROWS)

    def body(h, start, masked, carry):
      n, dq = carry
      slot = _slot(n, g.slots)
      k, v = k_smem.at[slot], v_smem.at[slot]
      plgpu.barrier_wait(k_bar.at[slot])
      plgpu.barrier_wait(v_bar.at[slot])

      s, dp = _products(tile, ((q_own, k), (do_own, v)))  # s = q K^T, dp = dO V^T
      vis = None
      if masked:
        k_info = _info_rows(kinfo_smem.at[slot], _COLS, tile, 1, g.info_rows)
        k_index = start + plgpu.broadcasted_iota(jnp.int32, tile, 1, layout=plgpu.Layout.WGMMA)
        vis = common.tile_visible(cfg, q_info[0], k_info[0], k_index, *q_info[1:], *k_info[1:])
      p, dlogits = _probs(s, lse2, vis, cfg, row_axis=0)
      ds = _grad_logits(p, dp, delta, dlogits, row_axis=0)
      (dq,) = _accumulate(((dq, ds.astype(g.dtype), k),))  # dq += ds K
      plgpu.barrier_arrive(free.at[slot])
      return n + 1, dq

    _, dq = _walk(g, plan_row, body, (jnp.int32(0), _zeros((rows, g.head_dim))))
    dq = dq * cfg.scale
    if acc_ref is not None:  # (read once the walk is done: no registers are free before)
      dq = dq + _load(acc_ref.at[own], plgpu.Layout.WGMMA, optimized=False).astype(jnp.float32)
    _finish(done, out2.at[wg], (dq_ref.at[own], dq))

  @pl.when(wg == consumers)
  def _producer():
    plgpu.set_max_registers(_PRODUCER_REGS, action="decrease")

    def body(h, start, masked, n):
      slot = _slot(n, g.slots)
      keys = pl.ds(start, g.walk)
      src = (batch, keys, kv_head)

      @pl.when(n >= g.slots)
      def _():
        plgpu.barrier_wait(free.at[slot])

      plgpu.copy_gmem_to_smem(k_ref.at[src], k_smem.at[slot], k_bar.at[slot])
      if masked:
        plgpu.copy_gmem_to_smem(kinfo_ref.at[k_info_b, :, keys], kinfo_smem.at[slot],
                                k_bar.at[slot])
      else:
        plgpu.barrier_arrive(k_bar.at[slot])  # the phase's second arrival, without data
      plgpu.copy_gmem_to_smem(v_ref.at[src], v_smem.at[slot], v_bar.at[slot])
      return n + 1

    _walk(g, plan_row, body, jnp.int32(0))


def _bwd_call(kernel, consumers: int, scratch, out_shapes, grid, grid_names, args, *, cfg, g):
  """Runs a backward kernel: ``consumers`` warpgroups and the producer over ``grid``, with
  ``scratch = (owned, walked, out staging, barriers)`` (the staging aliases the walked slots)."""
  owned, walked, out, bars = scratch
  shared = plgpu.RefUnion(walked, out)

  def entry(*refs):
    pl.run_scoped(lambda own, sh, b: kernel(*refs, own, *sh, b, cfg=cfg, g=g),
                  owned, shared, bars, collective_axes="wg")

  return plgpu.kernel(
      entry, out_type=out_shapes, grid=grid, grid_names=grid_names,
      num_threads=consumers + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True))(*args)


@functools.partial(jax.jit, static_argnames=("cfg", "parts"))
def backward(q, k, v, do, lse, delta, ops: common.Operands, plan, cfg: common.KernelConfig,
             dq_acc=None, parts=common.BOTH):
  """See ``kernels.common``: returns ``(dq, dk, dv)`` in ``cfg.out_dtype`` (the dQ kernel adds
  ``dq_acc``, the ring's running dq, to its rows before writing them).

  Backward tiles other than 128 x 128 (``backward_unsupported``) and interpret mode run the
  ``pallas_triton`` backward on the same plan instead (``cfg.num_stages`` means the forward's
  K/V slots here, so Triton gets its own default).
  """
  b, tp, n, hp = q.shape
  sp, kh = k.shape[1], k.shape[2]
  if cfg.interpret or backward_unsupported(cfg, hp) is not None:
    return pallas_triton.backward(q, k, v, do, lse, delta, ops, plan,
                                  dataclasses.replace(cfg, num_stages=None), dq_acc, parts)
  want_dq, want_dkv = common.wants(parts)
  why = unsupported(_ops_call(q, ops))
  variants = cfg.variants or Variants()
  if why is not None:
    raise NotImplementedError(f"backend 'pallas_mosaic_gpu' cannot serve {why}.")
  info_rows = 1 if ops.q_info.segment_ids is None else 2
  out_dt = jnp.dtype(cfg.out_dtype)
  dt, rows, f32, i32 = q.dtype, BWD_ROWS, jnp.float32, jnp.int32
  tile_bytes = rows * hp * dt.itemsize  # one owned [64, H] tile
  out_bytes = rows * hp * out_dt.itemsize  # one output staging tile

  def geometry(dkv: bool, seq, heads, walk=None):
    """The dK/dV (``dkv``) or dQ kernel's tiles walked ``walk`` rows at a time (default
    ``variants.dkv_walk_rows`` / ``dq_walk_rows``) in as many slots as fit beside its owned
    tiles (the output staging aliases the slots)."""
    wide = hp > (variants.wide_dkv_above if dkv else variants.wide_dq_above)
    owners = _owners(wide)
    if walk is None:
      walk = (dict(variants.dkv_walk_rows).get(hp, rows) if dkv else
              rows if wide else variants.dq_walk_rows)
    # Owned: dK/dV: K and V of 64 keys (and their token info) per owner, and the wide kernel's
    # p^T buffers; dQ: q, dO, lse, delta and token info of 64 rows per owner.
    owned = owners * (2 * tile_bytes + 4 * rows * (info_rows if dkv else 2 + info_rows))
    owned += 2 * rows * walk * dt.itemsize if dkv and wide else 0
    staging = (2 if dkv else owners) * out_bytes
    per_slot = walk * (2 * hp * dt.itemsize + 4 * (2 + info_rows))
    room = SMEM_BYTES - owned
    n_slots = min(4, room // per_slot)
    if n_slots < 2 and walk > rows:  # shorter walked tiles
      return geometry(dkv, seq, heads, rows)
    assert n_slots >= 2 and staging <= room, (hp, out_dt)  # (holds for every served head dim)
    return _BwdGeometry(slots=n_slots, group=n // kh, head_dim=hp, dtype=dt,
                        info_rows=info_rows, blocks=seq // (owners * rows),
                        walked_heads=heads, walk=walk, wide=wide)

  lse2 = common.safe_lse(lse) * common.LOG2E  # base 2; empty rows: +inf, so p = 0
  infos = (token_info(ops.q_info), token_info(ops.kv_info))
  # `num` barriers (one per owned tile or per slot) of `count` arrivals each.
  barriers = lambda count, num: plgpu.Barrier(num_arrivals=count, num_barriers=num)
  smem = functools.partial(_smem, dt)

  # dQ first: the owned tiles are q, dO, lse, delta (and token info), the walked ones K/V. Given
  # a RowTerm it computes delta from o and returns it for the dK/dV kernel (H100, 16 causal
  # documents of 1024: forward+backward 0.800 ms against 0.848 with XLA's separate pass).
  if not variants.delta_in_dq or not want_dq:
    delta = common.delta_array(delta, do)
  dq = None
  if want_dq:
    from_o = isinstance(delta, common.RowTerm)
    row_in = delta.dlse if from_o else delta  # the owned row input: delta, dlse or None
    row_in = () if row_in is None else (row_in.astype(f32),)
    g = dataclasses.replace(geometry(False, tp, 1), delta_from_o=from_o,
                            add_dq=dq_acc is not None)
    sl, w, owners = g.slots, g.walk, g.owners
    out = _bwd_call(
        _dq_kernel, owners,
        ((smem(owners, rows, hp), smem(owners, rows, hp), plgpu.SMEM((owners, rows), f32),
          plgpu.SMEM((owners, rows), f32), plgpu.SMEM((owners, info_rows, rows), i32)),
         (smem(sl, w, hp), smem(sl, w, hp), plgpu.SMEM((sl, info_rows, w), i32)),
         _smem(out_dt, owners, rows, hp),
         (barriers(4 + len(row_in), owners), barriers(2, sl), barriers(1, sl),
          barriers(owners, sl), barriers(owners, 1) if owners > 1 else None)),
        (jax.ShapeDtypeStruct(q.shape, out_dt), *([jax.ShapeDtypeStruct((b, n, tp), f32)]
                                                  if from_o else [])),
        (n, g.blocks, b), ("heads", "q_seq", "batch"),
        (plan.kv_index, plan.kv_count, plan.kv_full, *infos, q, k, v, do, lse2,
         *([delta.o] if from_o else []), *row_in,
         *([] if dq_acc is None else [dq_acc.astype(out_dt)])), cfg=cfg, g=g)
    dq, delta = out if from_o else (out[0], *row_in)
  if not want_dkv:
    return dq, None, None

  # dK/dV: the owned tiles are K/V, the walked ones q, dO, lse, delta (and q token info).
  g = geometry(True, sp, n // kh)
  sl, w, two, wide = g.slots, g.walk, _COMPUTE_WGS, g.wide
  own = () if wide else (two,)  # owned K/V tiles: one pair (wide) or one per consumer
  dkv_shape = jax.ShapeDtypeStruct((b, sp, kh, hp), out_dt)
  dk, dv = _bwd_call(
      _dkv_kernel, two,
      ((smem(*own, rows, hp), smem(*own, rows, hp), plgpu.SMEM((*own, info_rows, rows), i32),
        smem(2, rows, w) if wide else None),
       (smem(sl, w, hp), smem(sl, w, hp), plgpu.SMEM((sl, w), f32), plgpu.SMEM((sl, w), f32),
        plgpu.SMEM((sl, info_rows, w), i32)),
       _smem(out_dt, two, rows, hp),
       (barriers(3, two), barriers(3, sl), barriers(2, sl), barriers(two, sl), barriers(two, 1),
        barriers(1, 2) if wide else None, barriers(1, 2) if wide else None)),
      (dkv_shape, dkv_shape), (kh, g.blocks, b), ("heads", "kv_seq", "batch"),
      (plan.q_index, plan.q_count, plan.q_full, *infos, q, k, v, do, lse2, delta), cfg=cfg, g=g)
  return dq, dk, dv


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


_MIN_TILE = {"block_q": _COMPUTE_WGS * WG_ROWS, "block_kv": 64, "block_q_bwd": 16,
             "block_kv_bwd": 16}


class MosaicGpuBackend(backend.Backend):
  """Pallas through Mosaic GPU on Hopper (sm_90+), bfloat16 and float16 (``unsupported``)."""

  name = "pallas_mosaic_gpu"
  platform = "gpu"
  variants_cls = Variants
  fallback = "pallas_triton"

  def supports(self, call):
    why = unsupported(call)
    if why is None and jax.devices()[0].platform == "gpu" and not hopper():
      dev = jax.devices()[0]
      why = (f"GPU {dev.device_kind} (compute capability "
             f"{getattr(dev, 'compute_capability', '?')}; it needs sm_90 or newer)")
    return why

  def auto_eligible(self):
    return hopper()

  def default_block_sizes(self, head_dim, device_kind):
    # 2 x 64 rows per CTA; the backward kernels take 128 x 128.
    block_kv = 256 if head_dim <= 64 else 128 if head_dim <= 128 else 64
    return BlockSizes(128, block_kv, BWD_BLOCK, BWD_BLOCK, None, None)

  def block_size_error(self, field, value):
    low = _MIN_TILE[field]
    if value < low or value & (value - 1):
      return (f"its tiles are powers of two, block_q >= 128 (two warpgroups of >= 64 rows), "
              f"block_kv >= 64, and the backward's >= 16 (its own kernels take 128 x 128 "
              f"backward tiles; other tiles run the Triton backward). Use "
              f"{max(low, backend.next_pow2(value))}, or None for the tuned default.")
    return None

  def clamp(self, tiles, q_len, kv_len):
    cap_q, cap_k = max(128, backend.next_pow2(q_len)), max(64, backend.next_pow2(kv_len))
    bq, bk, bqb, bkb = tiles
    # (the backward kernels own 128 keys per CTA)
    return min(bq, cap_q), min(bk, cap_k), min(bqb, cap_q), min(bkb, max(BWD_BLOCK, cap_k))

  def padded_head_dim(self, head_dim):
    return max(64, backend.next_pow2(head_dim))  # wgmma tiles of 64; powers of two

  def tuning_candidates(self, head_dim, interpret):
    # Forward tiles and K/V slots; the backward's are fixed.
    fwd = [dict(block_q=128, block_kv=k, num_stages=s)
           for k in ((64, 128) if interpret else (64, 128, 256)) for s in (2, 3)]
    return {"fwd": fwd, "bwd": [dict(block_q_bwd=BWD_BLOCK, block_kv_bwd=BWD_BLOCK)]}

  forward = staticmethod(forward)
  backward = staticmethod(backward)


BACKEND = MosaicGpuBackend()

__all__ = ["forward", "backward", "unsupported", "backward_unsupported", "check_tiles", "slots",
           "Variants", "BACKEND", "hopper"]
