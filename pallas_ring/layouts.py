"""Sequence layouts for a ring of ``R`` devices.

A layout is the order in which tokens are stored so that shard ``r`` (the r-th slice of length
``T / R`` along the sequence axis) holds a chosen set of global positions:

* ``contiguous``: rank r holds ``[r*C, (r+1)*C)`` with ``C = T / R``.
* ``zigzag``: the sequence is cut into ``2R`` chunks; rank r holds chunks ``r`` and ``2R-1-r``
  (also called dual-chunk-swap). Balances causal work across ranks.
* ``striped``: token t lives on rank ``t mod R`` (rank r holds ``r, r+R, r+2R, ...``).

Tokens, labels, segment ids and RoPE positions are permuted once at data loading with
``permute``; model outputs are restored with ``unpermute``. Masks always compare the global
positions returned by ``positions``.

Packed documents: ``balance(segment_ids, ring_size, mask)`` returns a ``Placement``, a per-row
permutation of the tokens over the shards of a contiguous ring that balances the mask's work
per device (``pallas_ring.balance``); its ``positions`` are passed to the attention call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from pallas_ring.balance import Placement, balance

LAYOUTS = ("contiguous", "zigzag", "striped")


def check_layout(layout: str, argname: str = "layout") -> str:
  if layout not in LAYOUTS:
    raise ValueError(f"`{argname}`={layout!r} is not a known layout; use one of {LAYOUTS}.")
  return layout


def divisor(layout: str, ring_size: int) -> int:
  """The number the sequence length must be a multiple of for ``layout`` on ``ring_size`` ranks."""
  return 2 * ring_size if check_layout(layout) == "zigzag" else ring_size


def _is_int(x) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def check_length(seq_len: int, layout: str, ring_size: int, argname: str = "seq_len") -> None:
  if not _is_int(ring_size) or ring_size < 1:
    raise ValueError(f"ring_size={ring_size!r} must be an int >= 1 (the devices of the ring).")
  if not _is_int(seq_len):
    raise ValueError(f"`{argname}`={seq_len!r} must be an int (a number of tokens).")
  d = divisor(layout, ring_size)
  if seq_len % d:
    rule = "2R (two chunks per rank)" if layout == "zigzag" else "R (the ring size)"
    raise ValueError(
        f"`{argname}`={seq_len} cannot be split by the {layout!r} layout over a ring of "
        f"{ring_size}: it must be a multiple of {rule} = {d}. Pad the sequence to a multiple of "
        f"{d} (mask the padding with segment ids) or change the ring size.")


def global_order(seq_len: int, layout: str, ring_size: int) -> np.ndarray:
  """Global positions in layout order: ``order[i]`` is the position stored at index ``i``."""
  check_length(seq_len, layout, ring_size)
  t = np.arange(seq_len, dtype=np.int32)
  r = ring_size
  if layout == "contiguous" or r == 1:
    return t
  if layout == "striped":
    return t.reshape(seq_len // r, r).T.reshape(-1)
  chunks = t.reshape(2 * r, seq_len // (2 * r))
  pairs = [np.concatenate([chunks[i], chunks[2 * r - 1 - i]]) for i in range(r)]
  return np.concatenate(pairs)


def positions(seq_len: int, layout: str, ring_size: int, rank=None):
  """Global positions held by ``rank`` (int or traced scalar), or all ranks when ``rank`` is None.

  Returns:
    ``[seq_len // ring_size]`` int32 positions of that rank, or ``[seq_len]`` in layout order.
  """
  if rank is None:
    return jnp.asarray(global_order(seq_len, layout, ring_size))
  check_length(seq_len, layout, ring_size)
  if not isinstance(rank, jax.core.Tracer):  # (a traced one, lax.axis_index's, is in range)
    if np.ndim(rank) or not jnp.issubdtype(jnp.result_type(rank), jnp.integer):
      raise TypeError(f"`rank`={rank!r} must be an integer scalar (or None).")
    if not 0 <= int(rank) < ring_size:
      raise ValueError(f"`rank`={rank} is not a rank of a ring of {ring_size}: it must be in "
                       f"[0, {ring_size - 1}] (or None for every rank's positions in layout "
                       "order).")
  r, n = ring_size, seq_len // ring_size
  i = jnp.arange(n, dtype=jnp.int32)
  rank = jnp.asarray(rank, jnp.int32)
  if layout == "contiguous" or r == 1:
    return rank * n + i
  if layout == "striped":
    return i * r + rank
  c = n // 2  # zigzag: chunk `rank`, then chunk `2R - 1 - rank`
  return jnp.where(i < c, rank * c + i, (2 * r - 1 - rank) * c + i - c)


def take_tokens(x, index: np.ndarray, axis: int):
  """``x`` reordered along ``axis`` by ``index``: ``[L]`` (every batch row alike) or ``[B, L]``
  (a row's own, batch at axis 0). An explicitly sharded ``x`` keeps its sharding: it is gathered
  along an unsharded token axis and resharded back (a gather given ``out_sharding`` on the output
  of a ``shard_map`` failed to transpose under ``jit``: its scatter-add's mesh was Auto)."""
  x = jnp.asarray(x)
  axis %= x.ndim
  shape = [1] * x.ndim  # ``index`` broadcast along x's other axes
  shape[axis] = index.shape[-1]
  if index.ndim == 2:
    shape[0] = index.shape[0]
  index = jnp.asarray(np.reshape(index, shape))
  sharding = getattr(jax.typeof(x), "sharding", None)
  spec = tuple(getattr(sharding, "spec", ()))
  if not any(p is not None for p in spec):
    return jnp.take_along_axis(x, index, axis=axis)
  local = NamedSharding(sharding.mesh, P(*(None if i == axis else p for i, p in enumerate(spec))))
  return jax.reshard(jnp.take_along_axis(jax.reshard(x, local), index, axis=axis), sharding)


def _token_axis(x, axis: int, what: str) -> int:
  """The length of ``x``'s token axis ``axis`` (checked)."""
  shape = np.shape(x)
  if not -len(shape) <= axis < len(shape):
    raise ValueError(f"{what}: `axis`={axis} is not an axis of x, whose shape is {shape}; pass "
                     "the token axis (1 for [B, T, ...]).")
  return shape[axis]


def permute(x, layout: str, ring_size: int, axis: int = 1):
  """Reorders ``x`` along ``axis`` from natural order into layout order."""
  order = global_order(_token_axis(x, axis, "permute"), layout, ring_size)
  return take_tokens(x, order, axis)


def unpermute(x, layout: str, ring_size: int, axis: int = 1):
  """Inverse of ``permute``: from layout order back to natural order."""
  order = global_order(_token_axis(x, axis, "unpermute"), layout, ring_size)
  return take_tokens(x, np.argsort(order), axis)


__all__ = ["LAYOUTS", "positions", "permute", "unpermute", "divisor", "check_length", "balance",
           "Placement"]
