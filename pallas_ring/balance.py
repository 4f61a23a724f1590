"""Balanced placement of packed documents over a ring (``layouts.balance``), on the host.

A packed row of documents (``segment_ids [B, T]``) is attended with a document mask, so the
work of a query token is the number of keys of its own document that the mask lets it see
(``k <= q`` for causal: token ``i`` of a document does ``i + 1``). In the contiguous layout shard
``r`` holds tokens ``[r*C, (r+1)*C)``; a long document at one end of the row then gives one
device most of the work, and a lock-step ring waits for it at every step. ``balance`` permutes
the tokens of each row over the ``R`` shards instead, so that every shard holds exactly
``C = T / R`` tokens and close to ``1 / R`` of the row's work:

1. Documents are taken by work, largest first. The ``k`` largest are split over all ``R``
   devices zigzag-style: device ``j`` gets a piece from the document's front and its mirror
   from its back, so each gets ``L / R`` tokens (remainders handed round-robin) and, for a
   causal mask, the same work up to one token.
2. The others go whole to the least-loaded device with room for them (longest-processing-time
   greedy); a document no device has room for fills the least-loaded devices' remaining room.
3. ``k`` runs over 0, 1, 2, 4, ... and D (every document); the placement kept is the one with the
   fewest split documents among those whose busiest device is within 1% of the best found.

Whole documents keep communication low: a document on one device needs no other device's K/V,
so its ring steps on other devices are empty and skipped. Each shard's tokens keep their
original order (documents stay contiguous inside a shard, for tight kernel blocks), and masks
compare the tokens' original indices (``Placement.positions``), so the result is the packed row's
attention, only computed elsewhere.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from pallas_ring import masks as masks_lib

_SLACK = 0.01  # a placement within 1% of the best balance found may split fewer documents
_ROW_CHUNK = 512  # query rows per chunk when visible keys are counted elementwise


def _check_x(x, b: int, t: int, axis: int, what: str):
  shape = tuple(np.shape(x))
  if len(shape) < 2 or not -len(shape) <= axis < len(shape) or axis % len(shape) == 0:
    raise ValueError(f"Placement.{what}: `x` has shape {shape} and `axis`={axis}; expected the "
                     f"batch first (B={b}) and the token axis (T={t}) at `axis` >= 1, e.g. "
                     f"[B, T, ...] with axis=1.")
  if shape[0] != b or shape[axis] != t:
    raise ValueError(f"Placement.{what}: `x` has shape {shape}, but this placement was built for "
                     f"B={b} rows of T={t} tokens (batch at axis 0, tokens at axis {axis}). "
                     "Build the placement from this batch's segment ids: layouts.balance(...).")


@dataclasses.dataclass(frozen=True, eq=False)
class Placement:
  """A per-row permutation of packed tokens over the ``R`` shards of a contiguous ring.

  Use it with ``layout="contiguous"``: ``x_placed = placement.permute(x)`` for tokens, labels
  and segment ids, ``positions=placement.positions`` for attention, and
  ``placement.unpermute(out)`` for outputs.

  Attributes:
    perm: int32 ``[B, T]``: ``perm[b, i]`` is the original index of the token stored at
      index ``i`` (layout order; shard ``r`` holds ``[r*C, (r+1)*C)``).
    positions: int32 ``[B, T]``: the global positions masks compare, in layout order (each
      token's original index, so a mask means what it means on the packed row).
    ring_size: R, the number of shards the placement balances.
    work: float64 ``[B, R]``: each shard's work (visible (query, key) pairs under the mask and
      the document mask).
    layout: the layout it is used with, always ``"contiguous"``.
  """

  perm: np.ndarray  # [B, T] int32
  positions: np.ndarray  # [B, T] int32
  ring_size: int  # R
  work: np.ndarray  # [B, R] float64
  layout: str = "contiguous"

  @property
  def imbalance(self) -> np.ndarray:
    """``[B]``: the busiest shard's work over the mean shard's (1.0 is perfect)."""
    mean = self.work.mean(axis=1)
    return np.where(mean > 0, self.work.max(axis=1) / np.maximum(mean, 1e-300), 1.0)

  def permute(self, x, axis: int = 1):
    """``x [B, ..., T, ...]`` (tokens at ``axis``) from the packed order into layout order."""
    return self._take(x, self.perm, axis, "permute")

  def unpermute(self, x, axis: int = 1):
    """The inverse of ``permute``: from layout order back to the packed order."""
    return self._take(x, np.argsort(self.perm, axis=1, kind="stable"), axis, "unpermute")

  def _take(self, x, index: np.ndarray, axis: int, what: str):
    b, t = self.perm.shape
    _check_x(x, b, t, axis, what)
    axis %= len(np.shape(x))
    if isinstance(x, np.ndarray):
      return np.moveaxis(np.moveaxis(x, axis, 1)[np.arange(b)[:, None], index], 1, axis)
    # (jax arrays stay on device, explicitly sharded ones keep their sharding)
    from pallas_ring.layouts import take_tokens  # (layouts imports this module)
    return take_tokens(x, index, axis)

  def check(self, *, layout: str, ring_size: int, seq_len: int, where: str) -> None:
    """Raises unless the placement fits a call of ``layout`` over ``ring_size`` shards of a
    ``seq_len``-token sequence (``where`` names the call)."""
    fix = (f"Build it for this ring: layouts.balance(segment_ids, {ring_size}), and call with "
           "layout='contiguous'.")
    if layout != self.layout:
      raise ValueError(f"{where}: the Placement's positions are for layout='contiguous' (each "
                       f"shard a contiguous slice of the placed tokens), but the call's layout is "
                       f"{layout!r}. Use SequenceParallelConfig(layout='contiguous') with a "
                       "Placement (it replaces zigzag and striped for packed documents).")
    if ring_size != self.ring_size:
      raise ValueError(f"{where}: the Placement was built for a ring of {self.ring_size} shards, "
                       f"but the ring has {ring_size}; its balance holds only for its own ring. "
                       f"{fix}")
    if seq_len != self.perm.shape[1]:
      raise ValueError(f"{where}: the Placement is for T={self.perm.shape[1]} tokens, the call "
                       f"has {seq_len}. {fix}")


class PlacedPositions(np.ndarray):
  """``Placement.positions``: an int32 ndarray that remembers its placement, so that
  ``sharded_attention`` can check the layout and ring size it is used with."""

  placement: Any = None

  def __array_finalize__(self, obj):
    # Slices and arithmetic results are plain positions, not the placement's.
    self.placement = None


def placement_of(positions):
  """The ``Placement`` whose ``positions`` these are (unsliced), or None."""
  return getattr(positions, "placement", None) if isinstance(positions, PlacedPositions) else None


def _closed_form_work(spec, pos: np.ndarray):
  """Visible keys of each token of a contiguous document at positions ``pos`` (sorted), or None
  when the spec has no closed form."""
  s, e = int(pos[0]), int(pos[-1])  # first and last position (inclusive)
  if isinstance(spec, masks_lib.Full):
    return np.full(pos.shape, e - s + 1, np.float64)
  if isinstance(spec, masks_lib.Causal):
    return (pos - s + 1).astype(np.float64)
  if isinstance(spec, masks_lib.SlidingWindow):
    return (np.minimum(e, pos + spec.right) - np.maximum(s, pos - spec.left) + 1).astype(
        np.float64)
  if isinstance(spec, masks_lib.ChunkedCausal):
    return (pos - np.maximum(s, pos // spec.chunk * spec.chunk) + 1).astype(np.float64)
  if isinstance(spec, masks_lib.PrefixLM):
    return (np.minimum(e, np.maximum(pos, spec.prefix - 1)) - s + 1).astype(np.float64)
  return None


def token_work(spec: masks_lib.MaskSpec, pos: np.ndarray) -> np.ndarray:
  """``[L]`` float64: how many tokens of a document (positions ``pos``, sorted) each of its
  tokens sees under ``spec``. Closed forms for the primitive specs on contiguous documents;
  elementwise counting (O(L^2)) for combined and custom specs."""
  pos = np.asarray(pos, np.int64)
  if pos[-1] - pos[0] + 1 == pos.size:
    work = _closed_form_work(spec, pos)
    if work is not None:
      return work
  out = np.empty(pos.shape, np.float64)
  keys = pos.astype(np.int32)[None, :]
  for i in range(0, pos.size, _ROW_CHUNK):
    rows = pos[i:i + _ROW_CHUNK].astype(np.int32)[:, None]
    out[i:i + _ROW_CHUNK] = np.asarray(spec.visible(rows, keys)).sum(axis=1)
  return out


def _zigzag_counts(length: int, r: int, offset: int) -> np.ndarray:
  """Tokens of a ``length``-token document per device: ``length // R`` each, the remainder to
  the devices from ``offset`` on (round-robin over documents)."""
  counts = np.full(r, length // r, np.int64)
  counts[(offset + np.arange(length % r)) % r] += 1
  return counts


def _zigzag_pieces(work: np.ndarray, counts: np.ndarray):
  """Splits a document (per-token ``work [L]``) into one piece per device, ``counts[j]`` tokens
  for device j, zigzag-style: device j takes a front part from the front (in device order) and a
  back part from the back (mirrored), the two sized so that its work is its token share of the
  document's (a causal document: half and half, the classic zigzag). Returns index arrays."""
  n = work.size
  cum = np.concatenate([[0.0], np.cumsum(work)])  # work of [a, z) = cum[z] - cum[a]
  a, z, pieces = 0, n, []
  for count in counts:
    f = np.arange(count + 1)  # candidate front sizes
    got = cum[a + f] - cum[a] + cum[z] - cum[z - (count - f)]
    best = int(np.argmin(np.abs(got - cum[-1] * count / n)))
    pieces.append(np.concatenate([np.arange(a, a + best), np.arange(z - (count - best), z)]))
    a, z = a + best, z - (count - best)
  return pieces


def _assign(docs, r: int, c: int, n_split: int):
  """One placement: the ``n_split`` first of ``docs`` (by work, largest first; each
  ``(idx, work)``) zigzag over every device, the rest whole by least load (split only where no
  device has room). Returns ``(pieces per device, load [R], documents split)``."""
  cap = np.full(r, c, np.int64)
  load = np.zeros(r, np.float64)
  pieces = [[] for _ in range(r)]
  split, offset = 0, 0
  for d, (idx, work) in enumerate(docs):
    n = idx.size
    if d < n_split and n >= 2 * r:
      counts = _zigzag_counts(n, r, offset)
      offset = (offset + n % r) % r
      if np.all(counts <= cap):
        for j, piece in enumerate(_zigzag_pieces(work, counts)):
          pieces[j].append(idx[piece])
          load[j] += work[piece].sum()
        cap -= counts
        split += 1
        continue
    room = np.flatnonzero(cap >= n)
    if room.size:  # whole, on the least-loaded device with room
      j = room[np.argmin(load[room])]
      pieces[j].append(idx)
      load[j] += work.sum()
      cap[j] -= n
      continue
    split += 1  # no device has room: fill the least-loaded devices' room, zigzag-style
    counts, left = np.zeros(r, np.int64), n
    for j in np.argsort(load, kind="stable"):
      counts[j] = min(int(cap[j]), left)
      left -= counts[j]
    for j, piece in enumerate(_zigzag_pieces(work, counts)):
      if piece.size:
        pieces[j].append(idx[piece])
        load[j] += work[piece].sum()
    cap -= counts
  return pieces, load, split


def _balance_row(seg: np.ndarray, r: int, spec) -> tuple[np.ndarray, np.ndarray]:
  """``(perm [T], work [R])`` of one row."""
  t = seg.size
  c = t // r
  _, inverse = np.unique(seg, return_inverse=True)
  order = np.argsort(inverse, kind="stable")  # tokens grouped by document, each ascending
  bounds = np.flatnonzero(np.diff(inverse[order])) + 1
  docs = []
  for idx in np.split(order, bounds):
    docs.append((idx, token_work(spec, idx)))
  docs.sort(key=lambda d: (-d[1].sum(), -d[0].size, d[0][0]))
  d = len(docs)
  grid = sorted({0, d} | {min(2 ** i, d) for i in range(d.bit_length())})
  tried = [_assign(docs, r, c, k) for k in grid]
  best = min(load.max() for _, load, _ in tried)
  pieces, load, _ = min((x for x in tried if x[1].max() <= best * (1 + _SLACK)),
                        key=lambda x: (x[2], x[1].max()))
  perm = np.concatenate([np.sort(np.concatenate(p)) if p else np.zeros(0, np.int64)
                         for p in pieces])
  return perm, load


def balance(segment_ids, ring_size: int, mask: masks_lib.MaskSpec = masks_lib.Causal()
            ) -> Placement:
  """A per-row placement of packed documents over a contiguous ring that balances the work.

  Runs on the host (numpy), once per batch at data loading. See the module docstring for the
  algorithm.

  Args:
    segment_ids: int ``[B, T]``: document ids of the packed rows (tokens with equal ids attend
      each other), in the packed (natural) order. ``T`` must be a multiple of ``ring_size``.
    ring_size: R, the number of devices of the sequence-parallel axis.
    mask: the attention's mask spec (in the packed row's positions); it weighs each token's work.

  Returns:
    A ``Placement``: ``perm``, ``positions``, ``permute`` / ``unpermute`` and the per-shard
    ``work``; use it with ``layout="contiguous"``.

  Example::

    placement = layouts.balance(segment_ids, ring_size=8)
    out = sharded_attention(placement.permute(q), placement.permute(k), placement.permute(v),
                            mesh=mesh, config=cfg, mask=masks.Causal(),
                            segment_ids=placement.permute(segment_ids),
                            positions=placement.positions)
    out = placement.unpermute(out)  # the packed order again
  """
  spec = masks_lib.as_spec(mask)
  try:
    seg = np.asarray(segment_ids)
  except Exception as e:  # traced
    raise TypeError("layouts.balance runs on the host at data loading: `segment_ids` must be a "
                    "concrete array (numpy or a jax array outside jit), got a traced value."
                    ) from e
  if seg.ndim != 2 or not np.issubdtype(seg.dtype, np.integer):
    raise ValueError(f"`segment_ids` has shape {seg.shape} and dtype {seg.dtype}; expected an "
                     "integer [B, T] array of document ids (add a batch axis with x[None]).")
  if isinstance(ring_size, bool) or not isinstance(ring_size, (int, np.integer)) or ring_size < 1:
    raise ValueError(f"`ring_size`={ring_size!r} is invalid: it must be an int >= 1, the size of "
                     "the sequence-parallel mesh axis.")
  b, t = seg.shape
  if t % ring_size:
    raise ValueError(f"`segment_ids` has T={t} tokens, which the {ring_size} shards of the ring "
                     f"cannot split evenly: T must be a multiple of ring_size={ring_size}. Pad "
                     f"the rows to {-(-t // ring_size) * ring_size} tokens (a padding document).")
  rows = [_balance_row(seg[i], int(ring_size), spec) for i in range(b)]
  perm = np.stack([p for p, _ in rows]).astype(np.int32)
  work = np.stack([w for _, w in rows])
  positions = perm.copy().view(PlacedPositions)
  placement = Placement(perm, positions, int(ring_size), work)
  positions.placement = placement
  perm.flags.writeable = False
  positions.flags.writeable = False
  return placement


def contiguous_work(segment_ids, ring_size: int, layout: str = "contiguous",
                    mask: masks_lib.MaskSpec = masks_lib.Causal()) -> np.ndarray:
  """``[B, R]``: each shard's work when the packed rows are laid out by ``layout`` (the
  baseline ``balance`` improves on)."""
  from pallas_ring import layouts  # (layouts imports this module)
  seg = np.asarray(segment_ids)
  b, t = seg.shape
  spec = masks_lib.as_spec(mask)
  order = np.asarray(layouts.global_order(t, layout, ring_size))
  out = np.zeros((b, ring_size))
  for i in range(b):
    work = np.empty(t)
    _, inverse = np.unique(seg[i], return_inverse=True)
    for d in range(inverse.max() + 1):
      idx = np.flatnonzero(inverse == d)
      work[idx] = token_work(spec, idx)
    out[i] = work[order].reshape(ring_size, -1).sum(axis=1)
  return out


__all__ = ["Placement", "balance", "token_work", "contiguous_work", "placement_of"]
