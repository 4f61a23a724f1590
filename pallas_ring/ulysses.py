"""Ulysses sequence parallelism: all-to-all from sequence-sharded to head-sharded, attend locally
(or, in the 2-D ``ulysses_ring`` scheme, run the ring over another axis on the exchanged chunk).

Each device holds a sequence shard ``[B, T/R, N, H]`` in layout order. One all-to-all over the
axis trades it for every token of ``N/R`` heads (``[B, T, N/R, H]``, tokens in layout order),
``flash_attention`` attends the whole sequence of those heads with the call's mask, segment
ids, positions and extras, and a second all-to-all returns the output to sequence shards. The
backward is JAX's transpose of the same program (all-to-alls both ways, the kernels' custom VJP
between), so nothing here has its own gradient.

K/V heads: with ``K % R != 0`` (MQA, or GQA with fewer kv heads than devices) each kv head is
repeated ``R / gcd(K, R)`` times before the exchange, the fewest copies that let every device
hold whole kv heads of its own query heads (K/V traffic and memory grow by that factor).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from pallas_ring import attention, call, layouts, packing, ring


def check_heads(n: int, r: int, field: str, axis: str) -> None:
  """Ulysses' rule: query heads split evenly over its all-to-all's axis (the config ``field``
  naming it)."""
  if n % r:
    raise ValueError(f"Ulysses shards the {n} query heads over the {r} devices of "
                     f"{field}={axis!r}, so N must be a multiple of {r}. Use a mesh axis "
                     f"whose size divides {n}, or strategy='ring'.")


def kv_repeats(kv_heads: int, r: int) -> int:
  """How many times each kv head is repeated so that ``R`` divides the kv heads."""
  return r // math.gcd(kv_heads, r)


def _to_heads(x, axis_name):
  """``[B, T/R, M, H] -> [B, T, M/R, H]`` (tokens of every device in layout order)."""
  return lax.all_to_all(x, axis_name, split_axis=2, concat_axis=1, tiled=True)


def _to_tokens(x, axis_name):
  """``[B, T, M/R, H] -> [B, T/R, M, H]``, the inverse of ``_to_heads``."""
  return lax.all_to_all(x, axis_name, split_axis=1, concat_axis=2, tiled=True)


def _gather_tokens(x, axis_name, axis=1):
  return None if x is None else lax.all_gather(x, axis_name, axis=axis, tiled=True)


def run(q, k, v, checked: call.Checked, *, axis_name, layout: str, cu_seqlens=None,
        ring_axis=None, scan_unroll: int = 1, variants=None):
  """Ulysses attention of a checked call over this device's shards (``call.check``; its
  optional operands hold this device's heads after the exchange: see ``sharded``).

  Args:
    q: ``[B, L, N, H]``; k, v: ``[B, L, K, H]``, this device's tokens in layout order.
    checked: the call; its positions and segment ids are this device's tokens.
    axis_name: the mesh axis of the all-to-all (U devices).
    layout: the token layout over the sequence-parallel axis (``axis_name``, or ``ring_axis``).
    cu_seqlens: int ``[D + 1]`` packed sequences of the natural order (B = 1), or None.
    ring_axis: None: the U devices hold the whole sequence (``L = T / U``) and each attends all
      of it for ``N / U`` heads. A mesh axis: the 2-D scheme, the U devices hold one ring
      rank's chunk, split contiguously, and after the all-to-all the ring runs over this axis
      (``scan_unroll`` steps per scan iteration, ``variants``: its ``RingVariants``) on that
      chunk.

  Returns:
    ``[B, L, N, H]`` (and lse ``[B, N, L]`` when the call asks).
  """
  u = lax.axis_size(axis_name)
  rank = lax.axis_index(axis_name)
  arrays = checked.arrays
  rep = kv_repeats(k.shape[2], u)
  if rep > 1:
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
  q, k, v = (_to_heads(x, axis_name) for x in (q, k, v))
  positions = _gather_tokens(arrays.q_positions, axis_name, axis=-1)
  segment_ids = _gather_tokens(arrays.segment_ids, axis_name)
  offsets = arrays.offsets
  if offsets is not None:  # dropout hashes the global query head
    offsets = offsets + jnp.asarray([0, 1], offsets.dtype) * rank * q.shape[2]
  local = arrays._replace(segment_ids=segment_ids, kv_segment_ids=segment_ids,
                          q_positions=positions, kv_positions=positions, offsets=offsets)
  if ring_axis is not None:  # (the ring derives positions and packed segments of its chunk)
    out = ring.run(q, k, v, checked._replace(arrays=local), axis_name=ring_axis, layout=layout,
                   strategy="ring", scan_unroll=scan_unroll, cu_seqlens=cu_seqlens,
                   variants=variants)
  else:
    t = q.shape[1]
    order = layouts.global_order(t, layout, u)  # [T] positions in layout order
    if positions is None and layout != "contiguous":
      local = local._replace(q_positions=order, kv_positions=order)
    if cu_seqlens is not None:  # sequences of the natural order: each token's by its position
      index = order if positions is None else positions.reshape(-1)  # (a Placement's, B = 1)
      local = local._replace(segment_ids=packing.packed_segment_ids(cu_seqlens, index,
                                                                    packing.Q_PAD),
                             kv_segment_ids=packing.packed_segment_ids(cu_seqlens, index,
                                                                       packing.KV_PAD))
    out = attention.run(q, k, v, checked._replace(arrays=local))
  if checked.settings.return_lse:
    o, lse = out
    lse = lax.all_to_all(lse, axis_name, split_axis=2, concat_axis=1, tiled=True)
    return _to_tokens(o, axis_name), lse
  return _to_tokens(out, axis_name)


__all__ = ["run", "check_heads", "kv_repeats"]
