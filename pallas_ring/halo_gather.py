"""The reach-limited ring in one kernel call: receive the halos, attend once.

Where the mask reaches only slices of the neighbouring shards (``halo.halo_runs``: a sliding
window's last ``left`` tokens, chunked attention across a shard edge), each device receives each
hop's slice once (one ``ppermute`` per hop and direction), appends the slices to its own K/V with
their global positions (and segment ids) and runs ``flash_attention`` on that: no ring steps, no
per-step kernels and no float32 accumulators. Autodiff sends the slices' dK/dV back (the
transposes of the ``ppermute``\\ s and slices). Under ``quantize=`` the slices travel as FP8
bytes, their dK/dV in the inputs' dtype.

It serves ``ring.run`` (ring and all_gather strategies) where the positions are the layout's,
no operand spans the keys (``operands.KEYS``: its columns would have to be gathered too) and the
slices are small (``RingVariants.gather_halos``, ``pieces``); elsewhere the ring runs as before.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_ring import attention, call, layouts
from pallas_ring import halo as halo_lib
from pallas_ring import masks as masks_lib
from pallas_ring import reach as reach_lib
from pallas_ring.kernels import common

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
  # ``quantize=``: k and v are 16/32-bit here (``attention.run`` quantizes them); their slices
  # travel as the FP8 bytes it would make of them. [Bs, K] descales each.
  quantize = checked.settings.quantize
  if quantize is not None:
    descales, group = checked.arrays.terms["fp8"], q.shape[2] // k.shape[2]
    k_descale, v_descale = descales[:, ::group, 1], descales[:, ::group, 2]

  perm = lambda shift: tuple((i, (i + shift) % r) for i in range(r))
  send = lambda x, shift: lax.ppermute(x, axis_name, perm(shift))

  def recv(x, shift, runs):  # the slice ``runs`` of the shard ``shift`` ranks back
    return send(halo_lib.take(x, runs, halo_lib.run_length(runs)), shift)

  def recv_kv(shift, runs):
    """K's and V's slices (``_send_pair``; under ``quantize=`` as FP8 bytes:
    ``_send_quantized``)."""
    width = halo_lib.run_length(runs)
    pair_ = [halo_lib.take(x, runs, width) for x in (k, v)]
    if quantize is not None:
      return _send_quantized(*pair_, k_descale, v_descale, quantize, axis_name, perm(shift))
    return _send_pair(*pair_, axis_name, perm(shift))

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


def _send_pair(k, v, axis_name, perm):
  """``k`` and ``v`` sent over ``perm``, in one collective where they share a dtype (XLA:GPU
  runs one collective at a time, each waiting for its peer: BENCHMARKS.md "Reach-limited
  ring")."""
  if k.dtype != v.dtype:
    return tuple(lax.ppermute(x, axis_name, perm) for x in (k, v))
  both = lax.ppermute(jnp.concatenate([k, v], axis=-1), axis_name, perm)
  return both[..., :k.shape[-1]], both[..., k.shape[-1]:]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _send_quantized(k, v, k_descale, v_descale, dtype, axis_name, perm):
  """K's and V's slices ``[B, L, K, H(v)]`` sent over ``perm`` as FP8 bytes (quantized by
  their ``[Bs, K]`` descales to ``dtype``, one collective) and widened to their dtypes on
  arrival: the values ``quantize=``'s kernels take (which they quantize to the same bytes; in
  float16, a subnormal may move by one FP8 step). The cotangents go back as they are (the
  quantization straight through, as ``quantize=``'s)."""
  k8, v8 = _send_pair(common.quantize_with(k, k_descale, dtype),
                      common.quantize_with(v, v_descale, dtype), axis_name, perm)
  widen = lambda x8, d, like: (x8.astype(jnp.float32) * d[:, None, :, None]).astype(like.dtype)
  return widen(k8, k_descale, k), widen(v8, v_descale, v)


def _send_quantized_fwd(k, v, k_descale, v_descale, dtype, axis_name, perm):
  out = _send_quantized(k, v, k_descale, v_descale, dtype, axis_name, perm)
  return out, (k_descale, v_descale)


def _send_quantized_bwd(dtype, axis_name, perm, descales, cts):
  del dtype
  dk, dv = _send_pair(*cts, axis_name, tuple((j, i) for i, j in perm))
  return (dk, dv, *map(jnp.zeros_like, descales))  # (descales are constants)


_send_quantized.defvjp(_send_quantized_fwd, _send_quantized_bwd)


__all__ = ["pieces", "run"]
