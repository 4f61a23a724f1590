"""How far a ring must rotate K/V: the ring steps a mask needs, from its static key bounds.

At ring step ``s`` device ``r`` holds the K/V shard of device ``r - s`` (mod R). A step is needed
when some device can see some key of the shard it holds then; with a local mask (a sliding
window, chunked attention) most steps are not. ``ring_reach`` finds, for a ring whose positions
follow its layout, the shortest ring that covers every needed step: K/V travel ``forward`` hops
toward higher ranks (device r sees the shards of r-1 .. r-forward) and ``backward`` hops toward
lower ranks (the shards of r+1 .. r+backward). Contiguous shards of a causal window need only
``forward``; zigzag and striped shards, whose tokens sit on both sides of their neighbours', need
both (a bidirectional ring).

A shard pair is needed unless one of two sound tests rules it out (each never rules out a pair
with a visible (query, key)):

* key bounds: every key a query ``q`` sees lies in ``[q - left, q + right]`` (``key_bounds``,
  ``masks.key_bounds`` plus ``ChunkedCausal``'s ``left = chunk - 1``); counted exactly on the
  shards' sorted positions;
* block test: the mask's own block test (``MaskSpec.block_test``) on the contiguous runs of the
  two shards' positions (their min and max past ``_MAX_RUNS`` runs); ``Custom`` specs count as
  visible (their block function may not run in numpy).

Positions are data (DESIGN section 1): this holds only for the layout's own positions, so the
ring uses it only when it derives them; caller-given positions (a ``Placement``) keep the whole
ring, whose empty steps the kernels skip block by block.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import numpy as np

from pallas_ring import layouts
from pallas_ring import masks as masks_lib

_MAX_RUNS = 4  # contiguous runs per shard given to the block test (zigzag has 2)


def key_bounds(spec: masks_lib.MaskSpec) -> Tuple[Optional[int], Optional[int]]:
  """``(left, right)``: every key a query ``q`` sees lies in ``[q - left, q + right]`` (None:
  unbounded on that side). ``masks.key_bounds``, and a chunk's ``chunk - 1`` to the left."""
  if isinstance(spec, masks_lib.ChunkedCausal):
    return spec.chunk - 1, 0
  if isinstance(spec, (masks_lib.And, masks_lib.Or)):
    pick = min if isinstance(spec, masks_lib.And) else max
    out = []
    for x, y in zip(key_bounds(spec.a), key_bounds(spec.b)):
      if isinstance(spec, masks_lib.And):  # the tighter bound of either side
        out.append(y if x is None else x if y is None else pick(x, y))
      else:  # the looser one, bounded only where both are
        out.append(None if x is None or y is None else pick(x, y))
    return tuple(out)
  return masks_lib.key_bounds(spec)


def runs(pos: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
  """``(lo [n], hi [n])`` of the contiguous runs of sorted positions, or their min and max when
  there are more than ``_MAX_RUNS``."""
  breaks = np.flatnonzero(np.diff(pos) != 1) + 1
  if breaks.size >= _MAX_RUNS:
    return pos[:1], pos[-1:]
  starts = np.concatenate([[0], breaks])
  ends = np.concatenate([breaks, [pos.size]]) - 1
  return pos[starts], pos[ends]


def any_visible(spec, qb, kb) -> np.ndarray:
  """The block test's ``any_visible`` in numpy; ``Custom`` specs: visible."""
  if isinstance(spec, masks_lib.And):
    return any_visible(spec.a, qb, kb) & any_visible(spec.b, qb, kb)
  if isinstance(spec, masks_lib.Or):
    return any_visible(spec.a, qb, kb) | any_visible(spec.b, qb, kb)
  if isinstance(spec, masks_lib.Custom):
    return np.ones(np.broadcast_shapes(qb.lo.shape, kb.lo.shape), bool)
  return np.asarray(spec.block_test(qb, kb)[0])


def _pair_needed(spec, bounds, qpos: np.ndarray, kpos: np.ndarray) -> bool:
  """Whether a query at ``qpos`` may see a key at ``kpos`` (both sorted int32)."""
  left, right = bounds
  lo = qpos.astype(np.int64) - (np.inf if left is None else left)
  hi = qpos.astype(np.int64) + (np.inf if right is None else right)
  if not np.any(np.searchsorted(kpos, hi, "right") > np.searchsorted(kpos, lo, "left")):
    return False
  (qlo, qhi), (klo, khi) = runs(qpos), runs(kpos)
  qb = masks_lib.BlockBounds(qlo[:, None], qhi[:, None])
  kb = masks_lib.BlockBounds(klo[None, :], khi[None, :])
  return bool(np.any(any_visible(spec, qb, kb)))


@functools.lru_cache(maxsize=256)  # (static arguments; auto, run and the ring each ask)
def ring_reach(spec: masks_lib.MaskSpec, seq_len: int, layout: str, ring_size: int
               ) -> Tuple[int, int]:
  """``(forward, backward)`` hops K/V must travel for ``spec`` on the layout's positions.

  ``(R - 1, 0)`` is today's whole ring (every shard visits every device); a local mask gives
  less, e.g. ``SlidingWindow(C / 2)``: ``(1, 0)`` on contiguous shards, ``(1, 1)`` on zigzag.
  Of the shortest covers (fewest hops in all) the one with the shorter longer side is taken.
  """
  r = ring_size
  if r == 1:
    return 0, 0
  order = np.asarray(layouts.global_order(seq_len, layout, r)).reshape(r, -1)
  shards = [np.sort(x) for x in order]
  bounds = key_bounds(spec)
  needed = [s for s in range(1, r)
            if any(_pair_needed(spec, bounds, shards[i], shards[(i - s) % r]) for i in range(r))]
  best = (r - 1, 0)
  for f in range(r):
    b = max((r - s for s in needed if s > f), default=0)
    if (f + b, max(f, b)) < (sum(best), max(best)):
      best = (f, b)
  return best if sum(best) < r - 1 else (r - 1, 0)


__all__ = ["ring_reach", "key_bounds", "runs", "any_visible"]
