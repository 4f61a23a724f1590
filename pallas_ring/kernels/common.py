"""The kernel contract shared by every lowering.

Each module in ``pallas_ring.kernels`` provides::

    forward(q, k, v, ops, plan, cfg) -> (o, lse)
    backward(q, k, v, do, lse, delta, ops, plan, cfg) -> (dq, dk, dv)

over one (q shard, kv shard) pair, with sequences already padded to block multiples:

* ``q``  ``[B, Tp, N, H]``, ``k, v`` ``[B, Sp, K, H]`` (``N % K == 0``; K/V are never repeated)
* ``ops``: ``Operands`` (token info of both sides and the optional dense mask)
* ``plan``: the ``BlockPlan`` for this pass's tile sizes (see ``block_sparse``)
* ``o`` ``[B, Tp, N, H]`` in ``cfg.out_dtype``, normalised; ``lse`` ``[B, N, Tp]`` float32 (float64
  for float64 inputs, which only the ``xla`` lowering accepts; see ``acc_dtype``),
  ``-inf`` on rows with no visible key (their ``o`` is 0)
* ``do`` ``[B, Tp, N, H]``; ``lse`` and ``delta = sum(o * do, -1)`` ``[B, N, Tp]`` are the *final*
  row statistics (after merging ring steps and sinks), so a pass over one kv shard yields exact
  contributions; ``dq`` ``[B, Tp, N, H]``, ``dk, dv`` ``[B, Sp, K, H]``, all in ``acc_dtype``.

Masked probabilities are zeroed explicitly (never ``exp(mask - mask)``) and no two mask values are
ever added, so rows with no visible key stay finite.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from pallas_ring import block_sparse
from pallas_ring import masks as masks_lib

Array = Any

# Finite stand-in for -inf in running maxima: exp(NEG_INF - finite) == 0, and it is never added
# to another mask value.
NEG_INF = -1e30


def acc_dtype(dtype):
  """Softmax / accumulation dtype for inputs of ``dtype``: float32, or float64 for float64."""
  return jnp.promote_types(dtype, jnp.float32)


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
  out_dtype: Any = jnp.float32  # dtype of the forward output o
  num_warps: Optional[int] = None  # Triton: warps per program (None: heuristic)
  num_stages: Optional[int] = None  # Triton: pipeline stages (None: heuristic)
  interpret: bool = False  # run Pallas kernels in interpret mode


class Operands(NamedTuple):
  """Token metadata of one (q shard, kv shard) pair, padded like q and k.

  Attributes:
    q_info: TokenInfo of the queries (positions ``[Bp, Tp]``, segment ids ``[B, Tp]`` or None).
    kv_info: TokenInfo of the keys (positions ``[Bp, Sp]``, segment ids ``[B, Sp]`` or None).
    dense: bool ``[Bm, Nm, Tp, Sp]`` (Bm in {1, B}, Nm in {1, N}) or None.
  """

  q_info: block_sparse.TokenInfo
  kv_info: block_sparse.TokenInfo
  dense: Optional[Array] = None


def tile_visible(cfg: KernelConfig, q_pos, k_pos, k_index, q_seg=None, k_seg=None, dense=None):
  """Elementwise visibility of a partial tile.

  Args:
    cfg: kernel config (mask spec, kv_len).
    q_pos: ``[bq, 1]`` query positions; ``k_pos``: ``[1, bk]`` key positions.
    k_index: ``[1, bk]`` index of each key inside its (padded) shard; keys at ``>= kv_len`` are
      padding and never visible.
    q_seg, k_seg: ``[bq, 1]`` / ``[1, bk]`` segment ids or None.
    dense: ``[bq, bk]`` bool / int tile of the dense mask or None.

  Returns:
    ``[bq, bk]`` bool.
  """
  vis = cfg.mask.visible(q_pos, k_pos)
  if cfg.kv_len % cfg.block_kv or cfg.kv_len % cfg.block_kv_bwd:
    vis = vis & (k_index < cfg.kv_len)
  if q_seg is not None:
    vis = vis & (q_seg == k_seg)
  if dense is not None:
    vis = vis & (dense != 0)
  return jnp.broadcast_to(vis, (q_pos.shape[0], k_pos.shape[-1]))


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


def finalize(acc, m, l):
  """Normalised output and natural-log lse from running (acc, max, sum); empty rows -> 0, -inf."""
  empty = l == 0.0
  o = acc / jnp.where(empty, 1.0, l)
  lse = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))
  return o, lse


def safe_lse(lse):
  """lse with -inf replaced by +inf, so ``exp(s - lse)`` is 0 on empty rows, never NaN."""
  return jnp.where(lse == -jnp.inf, jnp.inf, lse)
