"""Score terms of the Mosaic GPU kernels beyond ``q.k``, and the vocabulary the kernels use for
them. The kernels name terms by how they enter a tile, never by the feature they implement:

* the soft-cap: part of ``logits``;
* a *position term* (``Terms.alibi``; ALiBi): ``-slope * log2(e) * |q_pos - k_pos|`` from the
  token positions of both sides, one slope per (batch, head) (``position_slope``);
* a *separable* position term (``Terms.separable``; ALiBi under a mask that only sees
  ``k <= q``): a key term added to the logits and a query term folded into the rows' lse;
* a *tile term* (``Terms.tile_term``; an additive bias and a dense mask, ``tile_bias``): an
  additive ``[rows, keys]`` window read per tile (``term_window``), staged through shared memory
  where it fits (``TermStage``);
* dropout: keep decisions from row and column keys (``keep``, ``kept``, ``kept_delta``).

Every kernel computes base-2 logits ``s * c`` (``logits``). ALiBi subtracts
``slope * log2(e) * |q_pos - k_pos|`` from them, with the positions of the token info (exact
int32 distances, so far positions lose no precision). Under a mask that only sees ``k <= q``
(``Terms.separable``) the term splits, as in the Triton kernels, into a key term
``slope * (k - a)`` added to the logits (one add per element) and a query term
``slope * (q - a)`` constant along a row, which only shifts the row's lse; the anchor ``a`` is a
position of the tile's own rows, so the terms of the keys that matter (near the diagonal) stay
small in float32. Dropout keeps each probability where
``common.dropout_keep`` says, from the row keys (one per query row and head, loaded like the row
statistics) and the column keys (an extra row of the keys' token info, ``key_info``); kept terms
are scaled by ``1 / (1 - rate)`` once per output (``o``, ``dq``, ``dk``, ``dv``), and the
backward uses ``delta * (1 - rate)`` (``kept_delta``), as the Triton kernels do. Tiles with either
term read the token info of both sides on every tile, not only on masked ones.

A bias and a dense mask travel as one additive tile term (``tile_bias``): the bias, and ``-inf``
where the dense mask hides a key (``exp2(-inf) = 0``; rows hidden entirely keep their running max
at ``NEG_INF`` and give zeros, as every masked row does). Each consumer reads its ``[rows, keys]``
window of it on every tile with a bias and on the plan's partial tiles with a dense mask alone
(its full tiles are all visible); the dK/dV kernel reads a transposed copy. Where the token
info's batch axes fit the dense mask's (``Terms.dense_vis``), the term also hides what the mask
spec, the segment ids and the padding hide (``dense_visibility``, computed in the XLA fusion that
builds the term), so a partial tile adds the term and computes no visibility of its own. A
16-bit term is staged (``Terms.staged``, ``TermStage``): the producer copies each reader's next
window by TMA into that reader's shared-memory tile as soon as the reader has loaded the
previous one, so the load's latency hides behind a step of matmuls; a float32 term, or one
without room, is read from global memory into registers after the tile's ``q.k^T``. Its
gradient is computed in XLA for every lowering (``pair.ops_grad``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_ring import masks as masks_lib
from pallas_ring.kernels import backend, common
from pallas_ring.kernels.pallas_mosaic_gpu.pipeline import (
    head_view, load_ref, swizzled_smem, token_info)
from pallas_ring.kernels.pallas_mosaic_gpu.tiles import Variants, staged_bias_bytes


@dataclasses.dataclass(frozen=True)
class Terms:
  """Which optional score terms a kernel call applies (static)."""

  alibi: bool = False  # ALiBi slopes ``[Ba, N, 1]`` are given: a position term
  separable: bool = False  # ALiBi under a causal-type mask: key and query terms (above)
  dropout: bool = False  # dropout keys are given (``cfg.dropout_rate > 0``)
  bias: bool = False  # an additive bias is given: ``tile_bias`` on every tile
  dense: bool = False  # a dense mask is given: ``tile_bias`` (on the partial tiles without bias)
  staged: bool = False  # ``tile_bias`` reaches its readers through shared memory (``TermStage``)
  dense_vis: bool = False  # ``tile_bias`` carries the tile's whole visibility (above)

  @property
  def tile_term(self) -> bool:
    """Whether an additive tile term is given (``tile_bias``: a bias, a dense mask or both)."""
    return self.bias or self.dense

  @property
  def every_tile_info(self) -> bool:
    """Whether every tile needs the token info of both sides (positions, column keys)."""
    return self.alibi or self.dropout

  def vis_on(self, masked: bool) -> bool:
    """Whether a tile (``masked``: a partial one) computes its visibility from the token info."""
    return masked and not self.dense_vis

  def tile_info(self, masked):
    """Whether a tile reads the token info of both sides (``masked`` may be traced)."""
    if self.every_tile_info:
      return True
    return False if self.dense_vis else masked

  def tile_term_on(self, masked: bool) -> bool:
    """Whether a tile (``masked``: a partial one) adds the ``tile_bias`` term."""
    return self.bias or (self.dense and masked)

  def inputs(self, ops: common.Operands, cfg: common.KernelConfig,
             transposed: bool = False) -> tuple:
    """The kernels' extra inputs, in order: ALiBi slopes float32 ``[Ba, N, 1]``, dropout row keys
    int32 ``[Bd, Nd, Tp]`` (the column keys travel in ``key_info``), ``tile_bias`` (transposed
    for the dK/dV kernel)."""
    return ((ops.alibi.astype(jnp.float32),) if self.alibi else ()) + (
        (ops.dropout.rows,) if self.dropout else ()) + (
        (tile_bias(ops, transposed, cfg if self.dense_vis else None),)
        if self.tile_term else ())

  def refs(self, refs) -> tuple[TermRefs, tuple]:
    """``(TermRefs, rest)`` from refs that start with ``inputs``."""
    used = (self.alibi, self.dropout, self.tile_term)
    it = iter(refs[:sum(used)])
    return TermRefs(*(next(it) if u else None for u in used)), refs[sum(used):]


class TermRefs(NamedTuple):
  """The kernel refs of ``Terms.inputs`` (None where absent)."""

  slopes: Optional[jax.Array] = None  # the position term's slopes
  row_keys: Optional[jax.Array] = None  # dropout's row keys
  tile_term: Optional[jax.Array] = None  # ``tile_bias``


def terms_of(ops: common.Operands, cfg: common.KernelConfig) -> Terms:
  """The ``Terms`` of a call's operands."""
  alibi, dense = ops.alibi is not None, ops.dense is not None
  # The visibility folds into the term where that does not grow it: token info batched like
  # the dense mask, or shared by the batch.
  infos = (ops.q_info.positions, ops.kv_info.positions, ops.q_info.segment_ids,
           ops.kv_info.segment_ids)
  fits = dense and (cfg.variants or Variants()).dense_visibility and all(
      x is None or x.shape[0] in (1, ops.dense.shape[0]) for x in infos)
  return Terms(alibi=alibi, separable=alibi and masks_lib.is_causal(cfg.mask),
               dropout=ops.dropout is not None, bias=ops.bias is not None, dense=dense,
               dense_vis=fits)


def ops_call(q, ops: common.Operands) -> backend.Call:
  """The ``Call`` of a kernel's inputs (to refuse what ``tiles.unsupported`` names: dtype and
  head dim; every operand is served). FP8 inputs with their descales compute in bfloat16."""
  return backend.Call(jnp.bfloat16 if ops.fp8 is not None else q.dtype, q.shape[-1])


def tile_bias(ops: common.Operands, transposed: bool = False,
              cfg: Optional[common.KernelConfig] = None) -> jax.Array:
  """The additive tile term ``[Bt, Nt, Tp, Sp]`` (``transposed``: ``[Bt, Nt, Sp, Tp]``): the bias
  (natural-log units, in ``tile_term_dtype``), ``-inf`` where the dense mask hides a key (zeros
  and ``-inf`` for a dense mask alone) and, given ``cfg`` (``Terms.dense_vis``), where
  ``dense_visibility`` does."""
  dt = tile_term_dtype(ops)
  x = None if ops.bias is None else ops.bias.astype(dt)
  if ops.dense is not None:
    vis = ops.dense if cfg is None else dense_visibility(ops, cfg)
    x = jnp.where(vis, jnp.zeros((), dt) if x is None else x, -jnp.inf)
  return jnp.swapaxes(x, 2, 3) if transposed else x


def dense_visibility(ops: common.Operands, cfg: common.KernelConfig) -> jax.Array:
  """bool ``[Bm, Nm, Tp, Sp]``: the dense mask and everything ``common.tile_visible`` hides (the
  mask spec on the token positions, the segment ids, the keys' padding)."""
  q, k = ops.q_info, ops.kv_info
  rows = lambda x: None if x is None else x[:, None, :, None]  # [B., 1, Tp, 1]
  cols = lambda x: None if x is None else x[:, None, None, :]  # [B., 1, 1, Sp]
  k_index = jnp.arange(ops.dense.shape[-1], dtype=jnp.int32)
  vis = common.tile_visible(cfg, rows(q.positions), cols(k.positions), k_index,
                            rows(q.segment_ids), cols(k.segment_ids), ops.dense)
  return jnp.broadcast_to(vis, ops.dense.shape)


def tile_term_dtype(ops: common.Operands):
  """The dtype of ``tile_bias``: the bias's (at most float32), else bfloat16."""
  if ops.bias is None:
    return jnp.dtype(jnp.bfloat16)
  dt = jnp.dtype(ops.bias.dtype)
  return jnp.dtype(jnp.float32) if dt.itemsize > 4 else dt


def staged_bytes(terms: Terms, dtype, variants: Variants, readers: int, rows: int,
                 cols: int) -> int:
  """Bytes of a staged tile term's windows (``TermStage``) of ``readers`` readers of
  ``[rows, cols]`` in ``dtype`` (``tile_term_dtype``): 0 without a tile term or where it is not
  staged (``tiles.staged_bias_bytes``); callers stage only where it fits."""
  return staged_bias_bytes(dtype, variants, readers, rows, cols) if terms.tile_term else 0


class TermStage(NamedTuple):
  """A staged tile term's shared-memory windows, one per reader (a consumer warpgroup that adds
  the term), and their barriers. A reader arrives at ``free`` once before its walk
  (``open_stage``) and once per window it has loaded; the producer waits there before each
  copy."""

  smem: Any  # [readers, rows, cols] in the term's dtype (wgmma's swizzled layout)
  full: Any  # per reader: its window has landed
  free: Any  # per reader: its window may be overwritten


def stage_scratch(dtype, readers: int, shape) -> tuple:
  """``TermStage``'s scratch: the windows of ``readers`` readers of ``shape``, and the barriers
  (for ``pl.run_scoped``)."""
  return (swizzled_smem(dtype, readers, *shape), plgpu.Barrier(num_barriers=readers),
          plgpu.Barrier(num_barriers=readers))


def open_stage(terms: Terms, stage: Optional[TermStage], reader) -> None:
  """A reader's first arrival at its ``free`` barrier (before its walk): its tile is free."""
  if terms.staged:
    plgpu.barrier_arrive(stage.free.at[reader])


def _window(ref, batch, head, rows, cols, shape):
  return head_view(ref, batch, head).at[pl.ds(rows, shape[0]), pl.ds(cols, shape[1])]


def copy_tile_term(terms: Terms, ref, stage: Optional[TermStage], readers: int, masked, batch,
                   head, rows, cols, shape) -> None:
  """Producer: where the tile adds the term (``Terms.tile_term_on``; ``masked`` may be traced),
  copies each reader's ``shape`` window of ``tile_bias`` (reader ``w``'s rows from
  ``rows + w * shape[0]``, columns from ``cols``) into its shared-memory tile, once the reader
  has loaded its previous one. Nothing unless staged."""
  if not terms.staged:
    return
  on = terms.tile_term_on(masked)

  def copy():
    @pl.loop(0, readers)
    def _(w):
      plgpu.barrier_wait(stage.free.at[w])
      plgpu.copy_gmem_to_smem(_window(ref, batch, head, rows + w * shape[0], cols, shape),
                              stage.smem.at[w], stage.full.at[w])

  if on is True:
    copy()
  elif on is not False:
    pl.when(on)(copy)


def term_window(terms: Terms, ref, masked, batch, head, rows, cols, shape,
                stage: Optional[TermStage] = None, reader=None):
  """A consumer's ``shape`` window of ``tile_bias`` (rows from ``rows``, columns from ``cols``)
  in float32 (natural-log units) and the wgmma layout: from ``reader``'s tile of ``stage`` when
  staged (then released to the producer), else from global memory; None where the tile adds no
  such term (``Terms.tile_term_on``)."""
  if not terms.tile_term_on(masked):
    return None
  if terms.staged:
    plgpu.barrier_wait(stage.full.at[reader])
    x = load_ref(stage.smem.at[reader], plgpu.Layout.WGMMA)
    # The next TMA copy (the async proxy) overwrites the tile as soon as the reader releases it:
    # its reads must be ordered before that by a proxy fence, or the copy can land first (H200,
    # JAX 0.11.2: dQ and the wide dK/dV wrong without it).
    plgpu.commit_smem()
    plgpu.barrier_arrive(stage.free.at[reader])
  else:
    x = load_ref(_window(ref, batch, head, rows, cols, shape), plgpu.Layout.WGMMA,
                 optimized=False)
  return x.astype(jnp.float32)


def key_info(ops: common.Operands) -> jax.Array:
  """int32 ``[Bi, F, S]``: the keys' token info (``token_info``), then the dropout column keys
  when given: one TMA copy per tile brings all of them."""
  info = token_info(ops.kv_info)
  if ops.dropout is None:
    return info
  cols = ops.dropout.cols[:, None]
  b = max(info.shape[0], cols.shape[0])
  return jnp.concatenate([jnp.broadcast_to(info, (b, *info.shape[1:])),
                          jnp.broadcast_to(cols, (b, 1, info.shape[-1]))], axis=1)


def position_slope(slopes_ref, batch, head):
  """The position term's slope of (batch, head) in base-2 units (a scalar read of the ALiBi
  slopes), or None without a position term."""
  if slopes_ref is None:
    return None
  return slopes_ref[common.sel(slopes_ref.shape[0], batch), head, 0] * common.LOG2E


def logit_slope(slope, cfg: common.KernelConfig, descale=None):
  """A base-2 position ``slope`` in the units of ``logits``'s ``s`` (``with_terms``), or None."""
  return None if slope is None else slope * (1.0 / logit_scale(cfg, descale))


def logit_scale(cfg: common.KernelConfig, descale=None):
  """``c`` of ``logits``: ``scale * log2(e)`` (times the FP8 ``descale`` of the raw ``q.k``,
  None: 1), or 1 with a soft-cap."""
  if cfg.softcap is not None:
    return 1.0
  c = cfg.scale * common.LOG2E
  return c if descale is None else c * descale


def logits(qk, cfg: common.KernelConfig, descale=None):
  """``(s, c)``: logits ``s`` whose base-2 value is ``s * c``. Without a soft-cap ``s`` is the
  raw ``q.k`` and ``c = scale * log2(e)``, so the softmax computes ``exp2(s * c - m)`` as one
  fused multiply-add per element (with the row max taken as ``max(s) * c``). ``descale``: the
  FP8 descale of the raw ``q.k`` (a traced scalar), folded into ``c`` or the soft-cap's
  argument."""
  if cfg.softcap is None:
    return qk, logit_scale(cfg, descale)
  arg = cfg.scale / cfg.softcap
  capped = (cfg.softcap * common.LOG2E) * jnp.tanh(qk * (arg if descale is None else
                                                         arg * descale))
  return capped, logit_scale(cfg)


def with_terms(s, c, position=None, tile=None):
  """``s`` of ``logits`` with the position term and the tile term added in its own units
  (base-2 terms divided by ``c``), so that the softmax's ``exp2(s * c - m)`` stays one fused
  multiply-add per element and a term costs one more (None: absent).

  Args:
    position: ALiBi's ``(slope, q_pos, k_pos)``, the slope in ``s``'s units
      (``position_slope / logit_scale``) and the tile's int32 positions broadcast to its shape:
      ``-slope * |q_pos - k_pos|``; or, separable (above), the keys' term in ``s``'s units
      (``position_term`` of that slope) broadcast to the tile.
    tile: the tile's ``term_window`` (natural-log units).
  """
  if isinstance(position, tuple):
    slope, q_pos, k_pos = position
    s = s - slope * jnp.abs((q_pos - k_pos).astype(jnp.float32))
  elif position is not None:
    s = s + position
  return s if tile is None else s + tile * (common.LOG2E / c)


def position_term(slope, positions, anchor):
  """``slope * (positions - anchor)`` in float32: a separable position term's key or query term
  (ALiBi's) of a vector of int32 positions."""
  return slope * (positions - anchor).astype(jnp.float32)


def keep(cfg: common.KernelConfig, row_keys, col_keys):
  """The dropout keep decisions of a tile from its row and column keys broadcast to its shape."""
  return common.dropout_keep(cfg.dropout_rate, row_keys, col_keys)


def kept(x, keep_mask):
  """``x`` where kept, 0 where dropped (``keep_mask`` None: ``x``); unscaled (see above)."""
  return x if keep_mask is None else jnp.where(keep_mask, x, 0.0)


def kept_delta(delta, cfg: common.KernelConfig):
  """The backward's row term for unscaled kept terms: ``delta * (1 - rate)``."""
  return delta if not cfg.dropout_rate else delta * (1.0 - cfg.dropout_rate)


def broadcast(x, shape, dim: int):
  """A row (``dim=0``) or column (``dim=1``) vector broadcast to a tile of ``shape``."""
  return lax.broadcast_in_dim(x, shape, [dim])
