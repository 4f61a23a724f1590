"""What the Mosaic GPU backward kernels share: their static geometry, the walk over the plan (the
tile scheduler: producer and consumers walk the same tiles), the tile arithmetic (products,
probabilities, logit gradients) and the epilogue writing a consumer's results.

A backward CTA *owns* 64 rows per consumer warpgroup (dK/dV: keys, dQ: queries) and *walks* the
other side's tiles of its plan row through a ring of shared-memory slots (``bwd_kernels``)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_ring.kernels import common
from pallas_ring.kernels.pallas_mosaic_gpu.pipeline import meet, wgmma_accumulator_load
from pallas_ring.kernels.pallas_mosaic_gpu.terms import Terms, keep, kept, logits, with_terms
from pallas_ring.kernels.pallas_mosaic_gpu.tiles import BWD_BLOCK, BWD_ROWS, COMPUTE_WGS, Variants


def owned_tiles(wide: bool) -> int:
  """Owned tiles (of 64 rows) per backward CTA: one when wide, else one per consumer."""
  return 1 if wide else COMPUTE_WGS


@dataclasses.dataclass(frozen=True)
class BwdGeometry:
  """Static sizes of one backward kernel call."""

  slots: int  # walked-tile shared-memory slots (dK/dV: dO's and delta's)
  group: int  # query heads per kv head
  head_dim: int  # H: q's and k's (padded)
  value_dim: int  # Hv: v's and dO's (padded), at most H
  dtype: object  # the inputs' 16-bit dtype
  info_rows: int  # token-info rows: 1 (positions) or 2 (and segment ids)
  blocks: int  # CTAs along the owned sequence
  walked_heads: int  # query heads walked per CTA: `group` for dK/dV, 1 for dQ
  walk: int  # rows of a walked tile
  wide: bool  # 64 owned rows per CTA (``bwd_kernels``): head dims above ``Variants.wide_*_above``
  splits: int = 1  # dK/dV: CTAs sharing a kv block's query heads (each walks walked_heads)
  delta_from_o: bool = False  # dQ: computes delta from o (a ``common.RowTerm``) and returns it
  add_dq: bool = False  # dQ: adds ``dq_acc`` (the ring's running dq) to its rows
  fused_dq: bool = False  # dK/dV: also adds ds K to a float32 dQ (``tiles.fused_backward``)
  dq_with_dkv: bool = False  # fused: ds^T K issued with the dV/dK matmuls (else after them)
  dq_split: bool = False  # fused: dQ's columns split over the consumers (``tiles.dq_split``)
  step_refs: bool = False  # consumers' own tiles re-derived per step (``tiles.step_refs``)
  overlap_softmax: bool = False  # dK/dV: p from q.k^T while dO.v^T runs (``Variants``)
  overlap_dq: bool = False  # fused with dq_with_dkv: dQ's add while dV/dK's matmuls run
  ds_from_smem: bool = False  # split: dK's matmul reads ds^T from its shared-memory tile
  terms: Terms = Terms()  # score terms beyond q.k (``terms``)
  # FP8 mode: q, k, v and dO's FP8 dtype (``fp8.backward_operands``: q.k^T, dO.v^T and the dK/dV
  # kernel's p^T dO in FP8; ds's products in ``dtype``); else None
  fp8: Any = None
  regs: tuple = Variants().regs  # registers per thread: consumer, producer
  extra_q_slot: bool = False  # dK/dV: q, lse and token info in one slot more (``Variants``)

  rows = BWD_ROWS  # owned rows per warpgroup

  @property
  def q_slots(self) -> int:
    """Slots of the walked q-side tiles (q, lse, token info): the dK/dV kernel's may have one
    more than ``slots``."""
    return self.slots + self.extra_q_slot

  @property
  def narrow_v(self) -> bool:
    """Whether v (dO, dV) is narrower than q and k."""
    return self.value_dim != self.head_dim

  @property
  def key_rows(self) -> int:
    """Rows of the keys' token info: ``info_rows``, then the dropout column keys."""
    return self.info_rows + self.terms.dropout

  @property
  def nsub(self) -> int:
    """Walked tiles per plan block."""
    return BWD_BLOCK // self.walk

  @property
  def owners(self) -> int:
    """Owned tiles per CTA (``owned_tiles``)."""
    return owned_tiles(self.wide)

  @property
  def cta_rows(self) -> int:
    """Owned rows per CTA."""
    return self.owners * BWD_ROWS

  def plan_block(self, cta):
    """The plan block (row of the plan's lists) of the CTA at ``cta`` along the sequence."""
    return lax.div(cta, jnp.asarray(BWD_BLOCK // self.cta_rows, cta.dtype))


def walk(g: BwdGeometry, plan_row, body, carry):
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


def zeros(shape):
  """A float32 accumulator of zeros in the wgmma layout."""
  return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)


def products(tile, pairs, issued=lambda: None, first=None, ready=()):
  """``[a b^T for a, b in pairs]``, float32 ``tile``-shaped, from shared-memory operands (one
  wgmma wait); ``issued()`` runs once all are issued. ``first``: the first product is replaced
  by ``first(it)``, computed as soon as it is done, while the others' wgmmas run. ``ready``:
  per pair, None or a function run just before its matmul is issued (a wait for its operands;
  the earlier ones' run meanwhile)."""

  def issue(refs):
    for ref, (a, b), wait in zip(refs, pairs, (*ready, *[None] * (len(pairs) - len(ready)))):
      if wait is not None:
        wait()
      plgpu.wgmma(ref, a, b.transpose((1, 0)))
    issued()

  if first is None:
    return pl.run_state(issue)(tuple(plgpu.ACC.init(zeros(tile)) for _ in pairs))

  def run_first(*refs):
    issue(refs)
    # (issued first: done once at most the others are in flight)
    head = first(wgmma_accumulator_load(refs[0], wait_n=len(refs) - 1))
    return (head, *(wgmma_accumulator_load(ref, wait_n=0) for ref in refs[1:]))

  return pl.run_scoped(run_first, *(plgpu.ACC(tile, jnp.float32) for _ in pairs))


def accumulate(terms, first=None):
  """``[acc + a b for acc, a, b in terms]``: ``a`` in registers (16-bit, wgmma layout) or shared
  memory, ``b`` in shared memory (one wgmma wait); a term ``(acc, ((a, b), ...))`` adds several
  products. ``first``: called with the first result as soon as it is done, while the others'
  wgmmas run."""

  def run(refs):
    for ref, (_, *ops) in zip(refs, terms):
      for a, b in ops[0] if len(ops) == 1 else (ops,):
        plgpu.wgmma(ref, a, b)
    if first is not None:  # (the later terms one wgmma each: as many may stay in flight)
      first(wgmma_accumulator_load(refs[0], wait_n=len(refs) - 1))

  return pl.run_state(run)(tuple(plgpu.ACC.init(acc) for acc, *_ in terms))


class TileTerms(NamedTuple):
  """What a walked tile applies beyond ``q.k``: visibility (masked tiles), the position term
  (``with_terms``' argument, and for a separable one the query term added to the rows' base-2
  lse) and a function computing dropout's keep mask (called where it is used, so the mask is not
  live across the softmax: registers); each None where absent."""

  vis: Any = None
  position: Any = None
  lse_shift: Any = None
  keep: Any = None
  tile: Any = None  # the tile's ``term_window``

  def keep_mask(self):
    """Dropout's keep mask of the tile (computed now), or None without dropout."""
    return None if self.keep is None else self.keep()


def tile_terms(cfg, g: BwdGeometry, masked, q_info, k_info, k_index, row_keys, slope=None,
               separable=None, tile=None):
  """The ``TileTerms`` of a tile from its sides' token info (broadcast to the tile, queries'
  rows then keys': positions, segment ids, and the keys' dropout column keys), the broadcast
  dropout ``row_keys``, the position term: ``slope`` in ``with_terms``' units, or, separable,
  ``separable = (key term in those units broadcast to the tile, base-2 query term)``
  (``terms.position_term``), and its ``term_window``."""
  vis = (common.tile_visible(cfg, q_info[0], k_info[0], k_index, *q_info[1:],
                             *k_info[1:g.info_rows]) if g.terms.vis_on(masked) else None)
  position, lse_shift = separable if separable is not None else (
      None if slope is None else (slope, q_info[0], k_info[0]), None)
  return TileTerms(vis, position, lse_shift,
                   (lambda: keep(cfg, row_keys, k_info[-1])) if g.terms.dropout else None, tile)


def probs(s_raw, lse2, terms: TileTerms, cfg, row_axis: int, descale=None):
  """``(p, dlogits)`` of a tile from raw ``q.k`` products: ``lse2`` (base 2) is a vector along
  axis ``row_axis`` of the tile's query rows (0 for dQ's ``[q, k]`` tiles, 1 for dK/dV's
  transposed ``[k, q]`` ones); ``dlogits`` is the soft-cap's derivative (None without);
  ``descale``: the FP8 factor of the raw products (``terms.logits``)."""
  s, c = logits(s_raw, cfg, descale)
  dlogits = None if cfg.softcap is None else common.softcap_grad(s * common.LN2, cfg)
  s = with_terms(s, c, terms.position, terms.tile)
  if terms.lse_shift is not None:
    lse2 = lse2 + terms.lse_shift
  p = jnp.exp2(s * c - lax.broadcast_in_dim(lse2, s.shape, [row_axis]))
  if terms.vis is not None:
    p = jnp.where(terms.vis, p, 0.0)
  return p, dlogits


def grad_logits(p, dp, delta, dlogits, row_axis: int, keep_mask=None):
  """``ds``, the raw-logit gradient / (scale x keep scale), from ``p`` and ``dp = dO.v``
  (``probs``); ``delta`` is ``kept_delta``'s."""
  ds = p * (kept(dp, keep_mask) - lax.broadcast_in_dim(delta, p.shape, [row_axis]))
  return ds if dlogits is None else ds * dlogits


def signed_grad_logits(ps, dp, delta):
  """``grad_logits`` of the wide dK/dV kernel's second warpgroup under dropout, from ``ps``: the
  first's probabilities (soft-cap folded) with dropped ones negated, so the keep mask needs no
  second computation: kept ``ps * (dp - delta)``, dropped ``-ps * -delta`` (``delta`` along the
  tile's columns, ``kept_delta``'s)."""
  delta = lax.broadcast_in_dim(delta, ps.shape, [1])
  return jnp.where(ps >= 0.0, ps * (dp - delta), ps * delta)


def finish(done, *results):
  """Epilogue: writes a consumer's ``(stage, dst, value)`` results, float32 tiles, to global
  memory through their staging tiles, once the consumers have met at ``done`` (None: the only
  consumer): the staging tiles alias the walked slots."""
  if done is not None:
    meet(done)
  for stage, dst, value in results:
    stage[...] = value.astype(stage.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(stage, dst)
    plgpu.wait_smem_to_gmem(0)
