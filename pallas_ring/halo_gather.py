"""The reach-limited ring in one kernel call: receive the halos, attend once.

Where the mask reaches only slices of the neighbouring shards (``halo.halo_runs``: a sliding
window's last ``left`` tokens, chunked attention across a shard edge), each device receives each
hop's slice once (one ``ppermute`` per hop and direction), appends the slices to its own K/V with
their global positions (and segment ids) and runs ``flash_attention`` on that: no ring steps, no
per-step kernels and no float32 accumulators. Autodiff sends the slices' dK/dV back (the
transposes of the ``ppermute``\\ s and slices).

It serves ``ring.run`` (ring and all_gather strategies) where the positions are the layout's,
no operand spans the keys (``operands.KEYS``: its columns would have to be gathered too) and the
slices are small (``RingVariants.gather_halos``, ``pieces``); elsewhere the ring runs as before.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import jax.numpy as jnp
from jax import lax

from pallas_ring import attention, call, layouts
from pallas_ring import halo as halo_lib
from pallas_ring import masks as masks_lib
from pallas_ring import reach as reach_lib

# (shift, runs): the slice ``runs`` of the shard ``shift`` ranks back (rank - shift), in the
# order the pieces are appended (positions ascending on contiguous shards).
Pieces = Tuple[Tuple[int, halo_lib.Runs], ...]


@functools.lru_cache(maxsize=256)
def pieces(spec: masks_lib.MaskSpec, seq_len: int, layout: str, ring_size: int,
           variants: halo_lib.RingVariants) -> Optional[Pieces]:
  """The slices of other shards a device needs, or None where gathering them does not pay:
  unbounded reach, halos off, or slices of ``variants.halo_max_share`` of a shard or more in
  all."""
  if not (variants.halo and variants.gather_halos) or None in reach_lib.key_bounds(spec):
    return None
  r = ring_size
  forward, backward = reach_lib.ring_reach(spec, seq_len, layout, r)
  out = []
  for direction, hops in ((1, forward), (-1, backward)):
    for hop in range(1, hops + 1):
      runs = halo_lib.halo_runs(spec, seq_len, layout, r, direction, hop, first=hop)
      if runs:
        out.append((direction * hop, runs))
  # Lower ranks' slices first, farthest first, then higher ranks' (nearest first).
  out.sort(key=lambda p: (p[0] < 0, -abs(p[0]) if p[0] > 0 else abs(p[0])))
  tokens = sum(halo_lib.run_length(runs) for _, runs in out)
  if tokens >= variants.halo_max_share * (seq_len // r):
    return None
  return tuple(out)


def run(q, k, v, checked: call.Checked, segment_ids, kv_segment_ids, layout_pos, pieces_: Pieces,
        *, axis_name, layout: str):
  """``flash_attention`` of this device's queries against its K/V plus ``pieces_``.

  Args:
    q: ``[B, C, N, H]``; k, v: ``[B, C, K, H(v)]`` this device's shard in layout order.
    checked: the call (its positions derived from the layout: None).
    segment_ids, kv_segment_ids: ``[B, C]`` of this shard, or None.
    layout_pos: ``[C]`` int32 this shard's global positions.
    pieces_: ``pieces``' slices.
    axis_name, layout: the ring's mesh axis and layout.
  """
  r = lax.axis_size(axis_name)
  rank = lax.axis_index(axis_name)
  t = q.shape[1]
  before = [p for p in pieces_ if p[0] > 0]
  after = [p for p in pieces_ if p[0] < 0]

  send = lambda x, shift: lax.ppermute(x, axis_name, [(i, (i + shift) % r) for i in range(r)])

  def recv(x, shift, runs):  # the slice ``runs`` of the shard ``shift`` ranks back
    return send(halo_lib.take(x, runs, halo_lib.run_length(runs)), shift)

  def recv_kv(shift, runs):
    """K's and V's slices in one collective where they share a dtype (XLA:GPU runs one
    collective at a time, each waiting for its peer: BENCHMARKS.md "Reach-limited ring")."""
    if k.dtype != v.dtype:
      return recv(k, shift, runs), recv(v, shift, runs)
    width = halo_lib.run_length(runs)
    both = jnp.concatenate([halo_lib.take(x, runs, width) for x in (k, v)], axis=-1)
    both = send(both, shift)
    return both[..., :k.shape[-1]], both[..., k.shape[-1]:]

  src_pos = lambda shift, runs: halo_lib.take(
      layouts.positions(t * r, layout, r, (rank - shift) % r), runs, halo_lib.run_length(runs),
      axis=0)

  def joined(x, received=None):  # (``received``: the slices of ``x`` that came, in order)
    if x is None:
      return None
    if received is None:
      received = [recv(x, s, runs) for s, runs in before + after]
    return jnp.concatenate(received[:len(before)] + [x] + received[len(before):], axis=1)

  kv_pieces = [recv_kv(s, runs) for s, runs in before + after]
  kv_pos = jnp.concatenate([src_pos(s, runs) for s, runs in before] + [layout_pos]
                           + [src_pos(s, runs) for s, runs in after])
  arrays = checked.arrays._replace(segment_ids=segment_ids, kv_segment_ids=joined(kv_segment_ids),
                                   q_positions=layout_pos, kv_positions=kv_pos)
  k, v = (joined(x, [p[i] for p in kv_pieces]) for i, x in enumerate((k, v)))
  return attention.run(q, k, v, checked._replace(arrays=arrays))


__all__ = ["pieces", "run"]
