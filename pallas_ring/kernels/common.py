"""The kernel contract shared by every lowering.

Each module in ``pallas_ring.kernels`` provides::

    forward(q, k, v, ops, plan, cfg, acc=None) -> (o, lse)
    backward(q, k, v, do, lse, delta, ops, plan, cfg, dq_acc=None, parts=BOTH,
             dkv_acc=None) -> (dq, dk, dv)

over one (q shard, kv shard) pair, with sequences already padded to block multiples:

* ``q``  ``[B, Tp, N, H]``, ``k, v`` ``[B, Sp, K, H]`` (``N % K == 0``; K/V are never repeated).
  A lowering whose ``Backend.padded_value_dim`` says so also takes a narrower ``v [B, Sp, K,
  Hv]`` (MLA); ``o``, ``do`` and ``dv`` then have ``Hv`` columns where ``H`` is written below
* ``ops``: ``Operands`` (token info of both sides, the optional dense mask, additive bias, ALiBi
  slopes and dropout keys)
* ``plan``: the ``BlockPlan`` for this pass's tile sizes (see ``block_sparse``)
* ``o`` ``[B, Tp, N, H]`` in ``cfg.out_dtype``, normalised; ``lse`` ``[B, N, Tp]`` float32 (float64
  for float64 inputs, which only the ``xla`` lowering accepts; see ``acc_dtype``),
  ``-inf`` on rows with no visible key (their ``o`` is 0)
* ``do`` ``[B, Tp, N, H]``; ``lse`` and ``delta = sum(o * do, -1) - dlse`` ``[B, N, Tp]`` are the
  *final* row statistics (after merging ring steps and sinks), so a pass over one kv shard yields
  exact contributions. ``delta`` may also come as a ``RowTerm`` (the final ``o`` and ``dlse``):
  the lowering then computes it, in a pass that reads ``do`` anyway where it can (``row_delta``
  elsewhere); ``dq`` ``[B, Tp, N, H]``, ``dk, dv`` ``[B, Sp, K, H]``, all in ``cfg.out_dtype``
  (accumulated in ``acc_dtype`` inside the pass; the ring sets ``out_dtype`` to the accumulation
  dtype because it sums several passes, ``flash_attention`` to the inputs' dtype).

The ring sums passes over its kv shards into running results that stay on the device: the
forward's ``Partial`` ``(o, lse)`` and the backward's dq (dK/dV travel with their shard). Given
``acc`` a forward returns its result merged into it (``merge``); given ``dq_acc`` (and
``dkv_acc = (dk_acc, dv_acc)``, the dK/dV received with their shard) a backward returns them plus
its own dq (dk, dv); all in ``cfg.out_dtype`` (the ring's accumulation dtype). A
lowering may do this inside its kernels, which hold the rows anyway, instead of another pass
over them in memory; the others call ``merged`` / ``accumulated`` on their result. ``parts``
(``BOTH``, ``DQ`` or ``DKV``) asks a backward for only dq or only dk and dv (the others are
None), so that the ring can run a pair's two halves at different steps; each lowering then runs
only the kernels those need.

Logits are ``s = softcap(q.k * scale) + bias - slope * |q_pos - k_pos|`` (``score_terms``), then
the mask. With ``cfg.dropout_rate > 0`` each probability is kept where ``dropout_keep`` says and the
output is scaled by ``1 / (1 - rate)``; lse is that of the undropped probabilities. The backward
uses ``ds = p * (keep * dp / (1 - rate) - delta)``.

Masked probabilities are zeroed explicitly (never ``exp(mask - mask)``) and no two mask values are
ever added, so rows with no visible key stay finite.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple, Optional

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from pallas_ring import block_sparse
from pallas_ring import masks as masks_lib

Array = Any

LOG2E = math.log2(math.e)  # exp(x) == exp2(x * LOG2E)
LN2 = math.log(2.0)  # log(x) == log2(x) * LN2
# Finite stand-in for -inf in running maxima: exp(NEG_INF - finite) == 0, and it is never added
# to another mask value.
NEG_INF = -1e30


def sel(size: int, idx):
  """Index ``idx`` into an axis that is either full-size or broadcast (size 1: index 0), as the
  leading ``[Bp, Np]`` axes of plans and token info are."""
  return idx if size > 1 else 0


def acc_dtype(dtype):
  """Softmax / accumulation dtype for inputs of ``dtype``: float32, or float64 for float64."""
  return jnp.dtype(jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Static configuration of one kernel call (hashable: used as a jit static argument)."""

  mask: masks_lib.MaskSpec  # visibility in global positions
  scale: float  # logit scale
  softcap: Optional[float]  # logit soft-cap, None for none
  q_len: int  # real (unpadded) query tokens
  kv_len: int  # real (unpadded) key tokens
  block_q: int  # forward query tile
  block_kv: int  # forward key tile
  block_q_bwd: int  # backward query tile
  block_kv_bwd: int  # backward key tile
  out_dtype: Any = jnp.float32  # dtype of the forward output o and of dq, dk, dv
  num_warps: Optional[int] = None  # Triton: warps per program (None: heuristic)
  num_stages: Optional[int] = None  # Triton: pipeline stages (None: heuristic)
  interpret: bool = False  # run Pallas kernels in interpret mode
  dropout_rate: float = 0.0  # attention-probability dropout rate in [0, 1)
  # The backend's kernel-variant config (``Backend.variants``; None for a backend without
  # variants): a static field, so a changed variant is a new jit key.
  variants: Any = None

  @property
  def keep_scale(self) -> float:
    """``1 / (1 - dropout_rate)``: the scale of kept probabilities."""
    return 1.0 / (1.0 - self.dropout_rate)


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """Static configuration of a backend's dedicated decode kernel (``Backend.decode``): a few
  query rows per kv head against a cache cut into chunks, one program per (chunk, row, kv head).
  """

  mask: masks_lib.MaskSpec  # visibility in global positions (slot index = key position)
  scale: float  # logit scale
  softcap: Optional[float]  # logit soft-cap, None for none
  tokens: int  # T query tokens per batch row
  group: int  # G query heads per kv head: a program's real rows are T*G, ordered (t, g)
  chunks: int  # P chunks of the cache's slots, each streamed by its own programs
  block_kv: int  # key tile (slots read per step)
  slots: int  # the cache's real slots (this shard's); those past it are the tiles' padding
  num_warps: Optional[int] = None  # Triton: warps per program (None: heuristic)
  num_stages: Optional[int] = None  # Triton: pipeline stages (None: heuristic)
  interpret: bool = False  # run the Pallas kernel in interpret mode


class Operands(NamedTuple):
  """Token metadata of one (q shard, kv shard) pair, padded like q and k.

  Attributes:
    q_info: TokenInfo of the queries (positions ``[Bp, Tp]``, segment ids ``[B, Tp]`` or None).
    kv_info: TokenInfo of the keys (positions ``[Bp, Sp]``, segment ids ``[B, Sp]`` or None).
    dense: bool ``[Bm, Nm, Tp, Sp]`` (Bm in {1, B}, Nm in {1, N}) or None.
    bias: float ``[Bb, Nb, Tp, Sp]`` additive logit bias (Bb in {1, B}, Nb in {1, N}) or None.
    alibi: float32 ``[Ba, N, 1]`` ALiBi slopes (Ba in {1, B}) or None.
    dropout: ``DropoutKeys`` when ``cfg.dropout_rate > 0``, else None.
    fp8: float32 ``[Bs, N, 3]`` (Bs in {1, B}): q's, k's and v's descales per query head, where
      q, k and v are FP8 (``Backend.forward_reads_fp8``); else None.
  """

  q_info: block_sparse.TokenInfo
  kv_info: block_sparse.TokenInfo
  dense: Optional[Array] = None
  bias: Optional[Array] = None
  alibi: Optional[Array] = None
  dropout: Optional["DropoutKeys"] = None
  fp8: Optional[Array] = None


class DropoutKeys(NamedTuple):
  """Per-row and per-column halves of the dropout hash (see ``dropout_keep``).

  Attributes:
    rows: int32 ``[Bd, Nd, Tp]`` (Bd in {1, B}, Nd in {1, N}): the key, global batch index, global
      query head and query position, hashed (``row_keys``).
    cols: int32 ``[Bp, Sp]`` (Bp as the key positions'): the key and the key position, hashed
      (``col_keys``).
  """

  rows: Array
  cols: Array


# --- dropout hash: int32 arithmetic (wrapping multiply, logical shifts) that every lowering has.
_M1, _M2 = np.int32(-2048144789), np.int32(-1028477387)  # murmur3 fmix32: 0x85ebca6b, 0xc2b2ae35
_P_BATCH, _P_HEAD = np.int32(-1640531535), np.int32(-2048144777)  # 0x9e3779b1, 0x85ebca77
_P_ROW, _P_COL = np.int32(-1028477379), np.int32(668265263)  # 0xc2b2ae3d, 0x27d4eb2f
_M_ELEM = np.int32(-1640531535)  # 0x9e3779b1: the per-element multiplier


def _i32(x):
  return jnp.asarray(x).astype(jnp.int32)


def mix32(x):
  """murmur3's 32-bit finaliser on int32 (wrapping), a bijection with full avalanche."""
  x = x ^ lax.shift_right_logical(x, np.int32(16))
  x = x * _M1
  x = x ^ lax.shift_right_logical(x, np.int32(13))
  x = x * _M2
  return x ^ lax.shift_right_logical(x, np.int32(16))


def row_keys(seed, batch_index, head_index, q_pos):
  """Row half of the dropout hash: int32, broadcasting its int arguments."""
  head = mix32(_i32(seed) ^ mix32(_i32(batch_index) * _P_BATCH + _i32(head_index) * _P_HEAD))
  return mix32(head ^ (_i32(q_pos) * _P_ROW))


def col_keys(seed, k_pos):
  """Column half of the dropout hash: int32 ``[..., S]``."""
  return mix32(_i32(seed) ^ (_i32(k_pos) * _P_COL))


def keep_threshold(rate: float) -> int:
  """Probabilities are kept where the (signed) int32 element hash is >= this:
  ``rate * 2**32 - 2**31``, so a uniform hash keeps a fraction ``1 - rate``."""
  return min(int(round(float(rate) * 2.0 ** 32)) - 2 ** 31, 2 ** 31 - 1)


def dropout_keep(rate: float, row_key, col_key):
  """``[bq, bk]`` keep decisions from ``[bq, 1]`` row and ``[1, bk]`` column keys.

  The row and column keys are fully mixed once (``row_keys``, ``col_keys``); each element then
  costs an add, a xorshift, a multiply and a compare.
  """
  x = row_key + col_key
  x = (x ^ lax.shift_right_logical(x, np.int32(15))) * _M_ELEM
  return x >= np.int32(keep_threshold(rate))


def dropped(x, keep, cfg: KernelConfig):
  """``x`` where kept, scaled by ``1 / (1 - rate)``; 0 where dropped (``keep`` None: ``x``)."""
  return x if keep is None else jnp.where(keep, x * cfg.keep_scale, 0.0)


def score_terms(s, bias=None, slope=None, q_pos=None, k_pos=None, weight: float = 1.0):
  """Adds ``weight * (bias - slope * |q_pos - k_pos|)`` to logits ``s [bq, bk]``.

  Args:
    s: ``[bq, bk]`` (soft-capped) logits (``weight = log2(e)`` for base-2 logits).
    bias: ``[bq, bk]`` bias tile or None.
    slope: a ``[1, 1]`` (or broadcastable) ALiBi slope or None; q_pos ``[bq, 1]``, k_pos
      ``[1, bk]`` positions.
  """
  if bias is not None:
    b = bias.astype(s.dtype)
    s = s + (b if weight == 1.0 else b * weight)
  if slope is not None:
    dist = jnp.abs(q_pos.astype(s.dtype) - k_pos.astype(s.dtype))
    s = s - (slope.astype(s.dtype) * weight) * dist
  return s


def tile_visible(cfg: KernelConfig, q_pos, k_pos, k_index, q_seg=None, k_seg=None, dense=None):
  """Elementwise visibility of a partial tile.

  Args:
    cfg: kernel config (mask spec, kv_len).
    q_pos: ``[bq, 1]`` query positions; ``k_pos``: ``[1, bk]`` key positions (or any leading
      axes that broadcast, e.g. ``[B, 1, bq, 1]`` / ``[B, 1, 1, S]``).
    k_index: ``[1, bk]`` index of each key inside its (padded) shard; keys at ``>= kv_len`` are
      padding and never visible.
    q_seg, k_seg: ``[bq, 1]`` / ``[1, bk]`` segment ids or None.
    dense: ``[bq, bk]`` bool / int tile of the dense mask or None.

  Returns:
    ``[bq, bk]`` bool (the broadcast shape).
  """
  vis = cfg.mask.visible(q_pos, k_pos)
  if cfg.kv_len % cfg.block_kv or cfg.kv_len % cfg.block_kv_bwd:
    vis = vis & (k_index < cfg.kv_len)
  if q_seg is not None:
    vis = vis & (q_seg == k_seg)
  if dense is not None:
    vis = vis & (dense != 0)
  return jnp.broadcast_to(vis, jnp.broadcast_shapes(vis.shape,
                                                    q_pos.shape[:-1] + k_pos.shape[-1:]))


def logits(q, k, cfg: KernelConfig):
  """``[bq, bk]`` scaled (and soft-capped) logits in ``acc_dtype`` of a q tile against a k tile."""
  s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                          preferred_element_type=acc_dtype(q.dtype))
  s = s * cfg.scale
  if cfg.softcap is not None:
    s = cfg.softcap * jnp.tanh(s / cfg.softcap)
  return s


def softcap_grad(s, cfg: KernelConfig):
  """d(capped logit)/d(raw logit) expressed through the capped logit ``s``."""
  if cfg.softcap is None:
    return 1.0
  t = s / cfg.softcap
  return 1.0 - t * t


def finalize(acc, m, l, keep_scale: float = 1.0):
  """Normalised output and natural-log lse from running (acc, max, sum); empty rows -> 0, -inf.

  ``keep_scale`` (``1 / (1 - dropout rate)``) scales the output, not the lse.
  """
  empty = l == 0.0
  o = acc / jnp.where(empty, 1.0, l)
  if keep_scale != 1.0:
    o = o * keep_scale
  lse = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))
  return o, lse


class Partial(NamedTuple):
  """A normalised result over some of a row's keys (the ring's running accumulator).

  Attributes:
    o: ``[B, Tp, N, H]`` output in ``acc_dtype``.
    lse: ``[B, N, Tp]`` its lse (``-inf`` on rows with no key seen yet, whose ``o`` is 0).
  """

  o: Array
  lse: Array


def merge_weights(lse1, lse2):
  """``(lse, c1, c2)``: the lse over the union of two disjoint key sets from theirs, and the
  factors of their normalised outputs in the union's (``o = c1 * o1 + c2 * o2``); rows empty in
  both give ``(-inf, 0, 0)``, never NaN."""
  m = jnp.maximum(lse1, lse2)
  m_safe = jnp.where(m == -jnp.inf, 0.0, m)
  w1, w2 = jnp.exp(lse1 - m_safe), jnp.exp(lse2 - m_safe)
  total = w1 + w2
  empty = total == 0.0
  lse = jnp.where(empty, -jnp.inf, m_safe + jnp.log(jnp.where(empty, 1.0, total)))
  inv = 1.0 / jnp.where(empty, 1.0, total)
  return lse, w1 * inv, w2 * inv


def merge(o1, lse1, o2, lse2):
  """Merges two normalised partial results of the same rows over disjoint keys.

  Args:
    o1, o2: ``[B, T, N, H]`` float32; lse1, lse2: ``[B, N, T]`` float32 (``-inf`` = no keys).

  Returns:
    ``(o, lse)`` over the union of the keys; rows empty in both stay ``(0, -inf)``, never NaN.
  """
  lse, c1, c2 = merge_weights(lse1, lse2)
  rows = lambda c: jnp.swapaxes(c, 1, 2)[..., None]  # [B, N, T] -> [B, T, N, 1]
  return o1 * rows(c1) + o2.astype(o1.dtype) * rows(c2), lse


def merge_reduced(o, lse, reduce_max: Callable, reduce_sum: Callable):
  """Merges many normalised partial results of the same rows over disjoint keys, along an axis
  that ``reduce_max`` / ``reduce_sum`` reduce (a stacked array axis, or a mesh axis through
  ``lax.pmax`` / ``lax.psum``).

  Args:
    o: ``[..., B, T, N, H]`` float32; lse: ``[..., B, N, T]`` float32 (``-inf`` = no keys).
    reduce_max, reduce_sum: reduce their argument over the partials.

  Returns:
    ``(o [B, T, N, H], lse [B, N, T])`` over the union of the keys; rows empty in every partial
    are ``(0, -inf)``, never NaN.
  """
  m = reduce_max(lse)
  m_safe = jnp.where(m == -jnp.inf, 0.0, m)
  w = jnp.exp(lse - m_safe)  # [..., B, N, T]
  total = reduce_sum(w)
  empty = total == 0.0
  lse = jnp.where(empty, -jnp.inf, m_safe + jnp.log(jnp.where(empty, 1.0, total)))
  rows = lambda c: jnp.swapaxes(c, -1, -2)[..., None]  # [.., B, N, T] -> [.., B, T, N, 1]
  return reduce_sum(o * rows(w)) / rows(jnp.where(empty, 1.0, total)), lse


def descale_of(x, dtype, headroom: float = 1.0):
  """float32 ``[..., heads]``: the descale that maps ``headroom`` times the absolute maximum of
  each batch row and head of ``x [..., L, heads, H]`` to ``dtype``'s largest finite value (1
  for an all-zero head, NaN for a head holding NaN or infinity: no scale represents it)."""
  x = jnp.asarray(x, jnp.float32)
  # [..., heads]: NaN counted as infinity (a max over it may return either)
  amax = jnp.max(jnp.where(jnp.isnan(x), jnp.inf, jnp.abs(x)), axis=(-3, -1))
  scaled = jnp.where(amax == 0, 1.0, amax * headroom / float(jnp.finfo(dtype).max))
  return jnp.where(jnp.isfinite(amax), scaled, jnp.nan).astype(jnp.float32)


def quantize_with(x, descale, dtype):
  """``x [..., L, heads, H]`` divided by ``descale [..., heads]`` in ``dtype`` (FP8), values
  beyond the dtype's range saturated."""
  top = float(jnp.finfo(dtype).max)
  xf = jnp.asarray(x, jnp.float32) / descale[..., None, :, None]
  return jnp.clip(xf, -top, top).astype(dtype)


def dequantize(q, k, v, descales, dtype):
  """FP8 ``q [B, T, N, H]``, ``k [B, S, K, H]``, ``v [B, S, K, Hv]`` times their descales
  (``Operands.fp8``: ``[Bs, N, 3]``) in ``dtype``."""
  return (_descaled(q, descales, 0, 1, dtype),
          *dequantize_kv(k, v, descales, q.shape[2] // k.shape[2], dtype))


def dequantize_kv(k, v, descales, group: int, dtype):
  """``dequantize``'s k and v alone (``group`` query heads per kv head)."""
  return _descaled(k, descales, 1, group, dtype), _descaled(v, descales, 2, group, dtype)


def _descaled(x, descales, i: int, group: int, dtype):
  d = descales[:, None, ::group, i:i + 1]  # [Bs, 1, heads, 1]
  return (x.astype(jnp.float32) * d).astype(dtype)


def merged(acc: Optional[Partial], o, lse):
  """A forward pass's ``(o, lse)`` merged into ``acc`` (unchanged when ``acc`` is None)."""
  return (o, lse) if acc is None else merge(acc.o, acc.lse, o, lse)


# What a backward computes (``parts``): dq and dk/dv, only dq, or only dk and dv.
BOTH, DQ, DKV = "both", "dq", "dkv"


def wants(parts: str) -> tuple[bool, bool]:
  """``(dq, dkv)``: which of its results a backward asked for ``parts`` computes."""
  if parts not in (BOTH, DQ, DKV):
    raise ValueError(f"backward parts={parts!r}: expected {BOTH!r}, {DQ!r} or {DKV!r}.")
  return parts != DKV, parts != DQ


def accumulated(dq, grads, dkv=None):
  """A backward pass's ``(dq, dk, dv)`` with the earlier passes' ``dq`` and ``dkv = (dk, dv)``
  added (each unchanged where its accumulator is None, and where the pass computed none)."""
  accs = (dq, *(dkv or (None, None)))
  return tuple(g if a is None or g is None else a + g.astype(a.dtype)
               for a, g in zip(accs, grads))


class RowTerm(NamedTuple):
  """The backward's row term ``delta = sum(o * do, -1) - dlse``, left to the lowering.

  Attributes:
    o: ``[B, Tp, N, H]`` the final (normalised, sinks merged) output.
    dlse: ``[B, N, Tp]`` cotangent of the lse output, or None (zero).
  """

  o: Array
  dlse: Optional[Array] = None


def row_delta(o, do, dlse=None):
  """The backward's row term ``delta = sum(o * do, -1) - dlse``, ``[B, N, T]``.

  ``d lse / d s = p``, so the cotangent of the returned lse enters every score gradient as
  ``ds = p * (dp - delta + dlse)``: folding ``-dlse`` into delta makes the lse differentiable in
  every kernel (and for the sinks) without touching the kernels.

  Args:
    o, do: ``[B, T, N, H]`` output and its cotangent.
    dlse: ``[B, N, T]`` cotangent of the lse output, or None (zero).
  """
  acc = acc_dtype(o.dtype)
  delta = jnp.swapaxes(jnp.sum(o.astype(acc) * do.astype(acc), axis=-1), 1, 2)
  if dlse is None:
    return delta
  return delta - dlse.astype(acc)


def widen(x, width: int):
  """``x`` zero-padded along its last axis to ``width`` columns (None stays None): a narrower
  v (or o, do) for a lowering that takes one head dim."""
  if x is None or x.shape[-1] == width:
    return x
  return jnp.pad(x, ((0, 0),) * (x.ndim - 1) + ((0, width - x.shape[-1]),))


def delta_array(delta, do):
  """A backward's ``delta`` argument as the ``[B, N, Tp]`` array (a ``RowTerm`` computed by
  ``row_delta``)."""
  return row_delta(delta.o, do, delta.dlse) if isinstance(delta, RowTerm) else delta


def safe_lse(lse):
  """lse with -inf replaced by +inf, so ``exp(s - lse)`` is 0 on empty rows, never NaN."""
  return jnp.where(lse == -jnp.inf, jnp.inf, lse)
