"""Halo exchange: a ring step sends only the slice of a shard that the mask lets a device see.

A bounded mask (a sliding window, chunked attention) sees a remote shard only through a few of
its tokens: contiguous shards under ``SlidingWindow(left)`` see the previous shard's last
``left`` tokens; each half-chunk of a zigzag shard sees the tail of its neighbouring chunk.
``halo_runs`` finds, from the mask's key bounds and block test on the layout's own positions,
the local token indices of a shard that any device needs at any step of one direction's chain
(``reach.ring_reach``); the ring then sends that slice of K/V (its token info is derived from
the source rank), runs the pair kernel on it, and sends back only its dK/dV.

Every device sends the same slice of its own shard (static shapes): the union over the ring's
devices and the chain's steps, as at most ``MAX_RUNS`` runs of local indices. Where the slice
does not pay (padded to the kernels' tiles it is ``RingVariants.halo_max_share`` of the shard or
more) the whole shard travels, as before.

Positions are data (DESIGN section 1): slices follow the layout's positions, so the ring uses
them only where it derives them, like the reach.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Tuple

import numpy as np
import jax.numpy as jnp

from pallas_ring import block_sparse, layouts, plans
from pallas_ring.config import RingVariants
from pallas_ring import masks as masks_lib
from pallas_ring import reach as reach_lib

Runs = Tuple[Tuple[int, int], ...]  # ((start, stop), ...) local token indices, sorted, disjoint
MAX_RUNS = 4  # runs of one slice (zigzag needs 2; closer runs merge past this)


def _needed_keys(spec, bounds, qpos: np.ndarray, kpos: np.ndarray) -> np.ndarray:
  """bool ``[len(kpos)]``: whether some query at the sorted positions ``qpos`` may see the key
  at each of ``kpos`` (key bounds counted exactly, then the block test on the query runs)."""
  left, right = bounds
  k = kpos.astype(np.int64)
  lo = k - (np.inf if right is None else right)  # a query q sees k only if k - right <= q
  hi = k + (np.inf if left is None else left)  # ... and q <= k + left
  need = np.searchsorted(qpos, hi, "right") > np.searchsorted(qpos, lo, "left")
  if not need.any():
    return need
  qlo, qhi = reach_lib.runs(qpos)
  qb = masks_lib.BlockBounds(qlo[:, None], qhi[:, None])
  kb = masks_lib.BlockBounds(kpos[None, :], kpos[None, :])
  return need & np.any(reach_lib.any_visible(spec, qb, kb), axis=0)


def _to_runs(need: np.ndarray, max_runs: int) -> Runs:
  """The runs of True in ``need``; the closest runs merged until at most ``max_runs`` remain."""
  edges = np.flatnonzero(np.diff(np.concatenate([[0], need.astype(np.int8), [0]])))
  runs = [list(x) for x in edges.reshape(-1, 2)]
  while len(runs) > max_runs:
    gap = int(np.argmin([b[0] - a[1] for a, b in zip(runs, runs[1:])]))
    runs[gap:gap + 2] = [[runs[gap][0], runs[gap + 1][1]]]
  return tuple((int(a), int(b)) for a, b in runs)


@functools.lru_cache(maxsize=256)
def halo_runs(spec: masks_lib.MaskSpec, seq_len: int, layout: str, ring_size: int,
              direction: int, hops: int, max_runs: int = MAX_RUNS, first: int = 1) -> Runs:
  """Local token indices of a shard that some device sees at some step ``first .. hops`` of the
  chain whose K/V travel in ``direction`` (+1: toward higher ranks), on the layout's positions.

  Args:
    spec: the mask spec (global positions).
    seq_len, layout, ring_size: T, the layout and R.
    direction, hops: the chain (``ring.RingStatic.chains``).
    max_runs: the most runs returned (closer runs are merged: a superset).
    first: the chain's first step counted (``hops``: that one step's slice).

  Returns:
    ``((start, stop), ...)`` sorted disjoint runs; ``()`` when no key is visible.
  """
  r = ring_size
  order = np.asarray(layouts.global_order(seq_len, layout, r)).reshape(r, -1)  # [R, C]
  bounds = reach_lib.key_bounds(spec)
  need = np.zeros(order.shape[1], bool)
  for dst in range(r):
    qpos = np.sort(order[dst])
    for step in range(first, hops + 1):
      need |= _needed_keys(spec, bounds, qpos, order[(dst - direction * step) % r])
  return _to_runs(need, max_runs)


def run_length(runs: Runs) -> int:
  """The tokens of ``runs``."""
  return sum(b - a for a, b in runs)


def run_index(runs: Runs) -> np.ndarray:
  """int32 ``[W]`` the local indices of ``runs``, in order."""
  return np.concatenate([np.arange(a, b, dtype=np.int32) for a, b in runs] or
                        [np.zeros(0, np.int32)])


def take(x, runs: Runs, padded: int, axis: int = 1, mode: str = "constant"):
  """``x``'s entries at the local indices of ``runs`` along ``axis`` (static slices, one
  concatenation), padded to ``padded`` (``mode``: ``jnp.pad``'s; zeros by default)."""
  axis %= x.ndim
  pieces = [x[(slice(None),) * axis + (slice(a, b),)] for a, b in runs]
  out = pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis)
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, padded - out.shape[axis])
  return jnp.pad(out, pad, mode=mode) if padded > out.shape[axis] else out


def put(full, part, runs: Runs, axis: int = 1, add: bool = False):
  """``full`` with its entries at ``runs`` along ``axis`` replaced by (``add``: plus) those of
  ``take``'s ``part`` (its padding dropped)."""
  axis %= full.ndim
  at, start = (slice(None),) * axis, 0
  for a, b in runs:
    piece = part[at + (slice(start, start + b - a),)].astype(full.dtype)
    ref = full.at[at + (slice(a, b),)]
    full = ref.add(piece) if add else ref.set(piece)
    start += b - a
  return full


@dataclasses.dataclass(frozen=True)
class SlicePlanner(plans.Planner):
  """A ring planner whose kv operand is the slice ``runs`` of each shard (``kv_len`` its
  tokens, ``kv_padded`` their padded length); its plans are built ahead like the ring's."""

  runs: Runs = ()

  def _build(self, bq: int, bk: int):
    seq_len, layout, r, _ = self.positions
    if r * r > self.limits.max_pairs:
      return None
    order = np.asarray(layouts.global_order(seq_len, layout, r)).reshape(r, -1)
    info = lambda pos, padded: block_sparse.pad_token_info(block_sparse.TokenInfo(pos[None]),
                                                           padded)
    index = run_index(self.runs)
    q_infos = [info(order[i], self.q_padded) for i in range(r)]
    kv_infos = [info(order[j][index], self.kv_padded) for j in range(r)]
    built = block_sparse.plan_table(self.mask, q_infos, kv_infos, block_q=bq, block_kv=bk,
                                    q_len=self.q_len, kv_len=self.kv_len)
    for x in (*built[0], built[1]):
      x.flags.writeable = False
    return built


@dataclasses.dataclass(frozen=True)
class Halo:
  """The slice one chain sends: ``runs`` of ``length`` tokens padded to ``padded``, and the
  kernel config and planner of (q shard, slice) pairs."""

  runs: Runs
  length: int
  padded: int
  cfg: object  # kernels.common.KernelConfig with kv_len = length
  planner: SlicePlanner


def make(cfg, planner: plans.Planner, chain: Tuple[int, int], kv_tiles: Tuple[int, int],
         variants: RingVariants, padded_len) -> Optional[Halo]:
  """The halo of chain ``(direction, hops)`` of a ring whose planner derives positions from the
  layout (``planner.positions``: a ``plans.RingLayout``), or None where the whole shard goes.

  Args:
    cfg: the pair kernel config (``kv_len``: the shard's tokens).
    planner: the ring's planner.
    chain: ``(direction, hops)``.
    kv_tiles: the kernels' key tiles ``(block_kv, block_kv_bwd)``.
    variants: the ring's variants.
    padded_len: ``tuning.padded_len``.
  """
  if not variants.halo or None in reach_lib.key_bounds(cfg.mask):  # (unbounded: all of it)
    return None
  seq_len, layout, r, _ = planner.positions
  runs = halo_runs(cfg.mask, seq_len, layout, r, *chain) or ((0, 1),)
  length = sum(b - a for a, b in runs)
  padded = padded_len(length, *kv_tiles)
  if padded >= variants.halo_max_share * planner.kv_padded:
    return None
  sub = dataclasses.replace(cfg, kv_len=length)
  slicer = SlicePlanner(cfg.mask, cfg.q_len, length, planner.q_padded, padded,
                        planner.forward_tiles, planner.backward_tiles, planner.positions,
                        planner.limits, runs=runs)
  return Halo(runs, length, padded, sub, slicer)


def share(spec: masks_lib.MaskSpec, seq_len: int, layout: str, ring_size: int,
          chain: Tuple[int, int], variants: RingVariants = RingVariants()) -> float:
  """The share of a shard chain ``(direction, hops)`` sends per hop (1.0: the whole shard);
  tiles ignored (``auto``'s cost model)."""
  if not variants.halo or None in reach_lib.key_bounds(spec):
    return 1.0
  c = seq_len // ring_size
  runs = halo_runs(spec, seq_len, layout, ring_size, *chain)
  part = max(1, sum(b - a for a, b in runs)) / c
  return 1.0 if part >= variants.halo_max_share else part


__all__ = ["RingVariants", "Halo", "SlicePlanner", "halo_runs", "run_length", "run_index", "take",
           "put", "make", "share"]
