"""The forward's tile scheduler: its static geometry, work items (one q block of one head) in
launch order, the items each CTA walks, and an item's plan row."""

from __future__ import annotations

import dataclasses

from jax import lax
import jax.numpy as jnp

from pallas_ring.kernels.pallas_mosaic_gpu import fp8
from pallas_ring.kernels.pallas_mosaic_gpu.pipeline import head_view
from pallas_ring.kernels.pallas_mosaic_gpu.terms import Terms
from pallas_ring.kernels.pallas_mosaic_gpu.tiles import Variants, stages_o


@dataclasses.dataclass(frozen=True)
class FwdGeometry:
  """Static sizes of one forward call."""

  bq: int  # rows per consumer warpgroup
  bk: int  # key tile
  slots: int  # K/V shared-memory slots
  group: int  # query heads per kv head
  head_dim: int  # H: q's and k's (padded)
  value_dim: int  # Hv: v's and the output's (padded), at most H
  dtype: object  # q's, k's and v's: 16-bit, or FP8 (``fp8``: the FP8 mode)
  out_dtype: object  # the staged output's (not merging): 16-bit
  info_rows: int  # token-info rows: 1 (positions) or 2 (and segment ids)
  q_blocks: int  # q blocks (plan rows) along the sequence
  heads: int  # query heads
  batch: int
  ctas: int  # CTAs launched; each walks work items ctas apart (``each_item``)
  merge: bool = False  # merge into the earlier passes' (o, lse) (``common.Partial``)
  overlap: bool = False  # each tile's softmax overlaps the previous tile's p.v (``overlaps``)
  order: str = "heads"  # work items' launch order (``item_order``)
  terms: Terms = Terms()  # score terms beyond q.k (``terms``)
  regs: tuple = Variants().regs  # registers per thread: consumer, producer
  step_refs: bool = False  # q's ref re-derived per step (``tiles.step_refs``)

  @property
  def fp8(self) -> bool:
    """Whether the kernel runs its FP8 mode (``fp8``)."""
    return fp8.is_fp8(self.dtype)

  @property
  def o_staging(self) -> str:
    """Where a consumer stages its output rows: "none" when merging (into the ring's result, in
    global memory), "own" (a tile of its own: ``tiles.stages_o``), "q" (its q tile) or "q_view"
    (its q tile seen at a narrower v's Hv columns: ``tiles.o_view_rows``)."""
    if self.merge:
      return "none"
    if stages_o(jnp.dtype(self.dtype).itemsize, jnp.dtype(self.out_dtype).itemsize):
      return "own"
    return "q" if self.value_dim == self.head_dim else "q_view"

  @property
  def key_rows(self) -> int:
    """Rows of the keys' token info: ``info_rows``, then the dropout column keys."""
    return self.info_rows + self.terms.dropout

  @property
  def items(self) -> int:
    """Work items: one q block (``2 * bq`` rows) of one head."""
    return self.heads * self.q_blocks * self.batch


def work_item(g: FwdGeometry, i):
  """``(batch, head, qi)`` of work item ``i`` in ``g.order`` (``item_order``); q blocks run from
  the last, so that causal-type masks' longest rows start first."""
  heads, q_blocks = (jnp.asarray(n, i.dtype) for n in (g.heads, g.q_blocks))  # (also under x64)
  if g.order == "blocks":
    qi, rest = lax.rem(i, q_blocks), lax.div(i, q_blocks)
    return lax.div(rest, heads), lax.rem(rest, heads), q_blocks - 1 - qi
  head, rest = lax.rem(i, heads), lax.div(i, heads)
  return lax.div(rest, q_blocks), head, q_blocks - 1 - lax.rem(rest, q_blocks)


def each_item(g: FwdGeometry, body, carry):
  """``carry = body(i, carry)`` for each work item ``i`` of this CTA: ``cta``, ``cta + g.ctas``,
  ... (one item, ``cta``, unless persistent)."""
  cta = lax.axis_index("cta")
  ctas = jnp.asarray(g.ctas, cta.dtype)
  return lax.fori_loop(jnp.asarray(0, cta.dtype), lax.div(g.items - 1 - cta, ctas) + 1,
                       lambda t, carry: body(cta + t * ctas, carry), carry)


def plan_row(plan, batch, head, qi):
  """``(kv index row, count, n_full)`` of an item's row of the plan's lists ``plan = (kv_index,
  kv_count, kv_full)`` (refs)."""
  idx_ref, cnt_ref, full_ref = plan
  lists = lambda ref: head_view(ref, batch, head)
  return lists(idx_ref).at[qi], lists(cnt_ref)[qi], lists(full_ref)[qi]
