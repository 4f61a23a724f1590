"""The fused backward (head dims <= 128, ``tiles.fused_backward``): the dK/dV kernel's
consumers also write each tile's ``ds^T`` to shared memory and add ``ds^T K`` to a float32 dQ in
global memory by TMA reduce-adds through staging tiles, in whatever order the CTAs reach it: dQ
is not bitwise reproducible, and q.k^T and dO.v^T are computed once instead of twice (5 matmuls
per tile instead of 7). At head dim 128 each consumer adds half of dQ's columns over the CTA's
128 keys (``Variants.dq_split``, below); else all columns over its own 64 keys. The matmul is
issued with dV's and dK's where registers allow (``tiles.dq_with_dkv``), else after them; with
them, first, and at head dim 128 added to dQ while theirs run (``tiles.overlap_dq``).
With ``Variants.dq_accumulator="int32"`` dQ is fixed point instead (``fixed_point``): integer
adds commute, so dQ is bitwise reproducible whatever the order.
Here: those steps of a consumer, the fixed-point scales, and the launch that updates dQ in
place."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_ring.kernels.pallas_mosaic_gpu.bwd_common import accumulate, zeros
from pallas_ring.kernels.pallas_mosaic_gpu.pipeline import slot_of, step_index
from pallas_ring.kernels.pallas_mosaic_gpu.tiles import COMPUTE_WGS

if TYPE_CHECKING:
  from pallas_ring.kernels.pallas_mosaic_gpu.dkv_kernel import DkvCta


# |every partial sum| of a fixed-point dQ row is at most 2^FIXED_POINT_BITS: int32's range
# with twice the bound's room (for the rounding of each term and of p's sums).
FIXED_POINT_BITS = 30


def fixed_point(do, delta, k, v, heads: int, cfg):
  """``(fac, unit)``, float32 [B, N, Tp]: an int32 fixed-point dQ adds each term of row i as
  ``round(term * fac[i])`` (the raw ``ds^T K`` of a tile; ``fac`` includes the scale) and is
  ``sum * unit[i]``. ``unit = bound / 2^FIXED_POINT_BITS``, ``bound`` bounding the sum of
  ``|ds_ij K_jc|`` over all keys j (so every partial sum, in any order): as ``ds_ij = p_ij
  (dp_ij - delta_i)`` with ``sum_j p_ij <= 1`` and ``|dp_ij| <= |dO_i| max_j |V_j|`` (dropout's
  kept terms scaled by ``keep``; a soft-cap's derivative is at most 1), ``|dq_ic| <= scale keep
  (keep |dO_i| max_j |V_j| + |delta_i|) max_j |K_jc|``. NaN in dO, delta, K or V reaches
  ``unit``, so dQ then is NaN as the float32 adds' would be.

  Args:
    do: [B, Tp, N, Hv]; delta: [B, N, Tp] float32; k: [B, Sp, K, H]; v: [B, Sp, K, Hv].
  """
  f32 = jnp.float32
  group = heads // k.shape[2]
  per_q_head = lambda x: jnp.repeat(x, group, axis=1)[..., None]  # [B, K] -> [B, N, 1]
  k_max = jnp.max(jnp.abs(k.astype(f32)), axis=(1, 3))  # [B, K]
  v_max = jnp.sqrt(jnp.max(jnp.sum(jnp.square(v.astype(f32)), axis=3), axis=1))  # [B, K]
  do_norm = jnp.sqrt(jnp.sum(jnp.square(do.astype(f32)), axis=3)).transpose(0, 2, 1)  # [B, N, Tp]
  keep = cfg.keep_scale
  bound = cfg.scale * keep * (keep * do_norm * per_q_head(v_max) + jnp.abs(delta))
  # (a zero bound, e.g. padding's rows, is raised: fac stays finite, its terms are zero)
  bound = jnp.maximum(bound * per_q_head(k_max), 2.0 ** -64)
  unit = bound * 2.0 ** -FIXED_POINT_BITS
  return (cfg.scale * keep) / unit, unit


def stage_ds(c: DkvCta, ds):
  """This consumer's ``ds^T`` tile to shared memory: the ``accumulate`` term of ``ds^T K`` (the
  tile's A operand)."""
  ds_t = c.r.dq_smem[0].at[c.wg]
  ds_t[...] = ds
  plgpu.commit_smem()
  return (zeros((c.g.walk, c.g.head_dim)), ds_t.transpose((1, 0)), c.k_own)


def add_dq(c: DkvCta, dq, h, start, fac) -> None:
  """``dq[start:start + walk] += dq`` (``ds^T K`` over this consumer's keys) by a TMA reduce-add
  from its staging tile, once the previous one has read it (``fac``: see ``_reduce_add``)."""
  _reduce_add(c, dq, c.r.dq.at[c.batch, pl.ds(start, c.g.walk), c.q_head(h)], fac)


# Split (``Variants.dq_split``, FlashAttention-3's): consumer w adds dQ's columns
# [w * H/2, (w + 1) * H/2) over the CTA's 128 keys, ds^T K from both consumers' ds^T tiles, one
# reduce-add per CTA and tile (half the L2 traffic). The ds^T tiles are double-buffered by step
# parity. Consumer 1 runs half a step behind consumer 0 (``pipeline.pingpong``): when it reaches
# a step's dQ, both tiles of that step are written; consumer 0 adds the previous step's, whose
# tile consumer 1 wrote before their last meeting, and the last step's after the walk. The
# consumers' meetings order every write of a tile after both reads of its buffer's previous one.


def write_ds(c: DkvCta, ds, n):
  """Split: this consumer's ``ds^T`` of walked step ``n`` to its shared-memory tile; returns
  the tile (dK's matmul reads it there where ``ds_from_smem``)."""
  tile = c.r.dq_smem[0].at[slot_of(n, 2), c.wg]
  tile[...] = ds
  plgpu.commit_smem()
  return tile


def split_dq(c: DkvCta, now, last) -> tuple:
  """Split: ``(term, add)``: ``term()``, the ``accumulate`` term of this consumer's dQ columns of
  the step it adds now, and ``add(dq)``, which adds them to dQ. That step is ``now = (n, h,
  start, fac)``, step ``n`` at query head rank ``h`` from ``start`` with the fixed-point row
  factor ``fac`` (or None, ``_reduce_add``) (consumer 1), or the previous one, ``last``
  (consumer 0; none before the first: ``start < 0``, then the term reads a tile no one writes in
  this step, and ``add`` adds nothing)."""
  behind = c.wg == 1
  # (a vector's select needs its condition broadcast under warpgroup semantics)
  pick = lambda x, then: jnp.where(
      lax.broadcast_in_dim(behind, jnp.shape(x), ()) if jnp.ndim(x) else behind, x, then)
  n_at, h_at, start_at, fac_at = (None if x is None else pick(x, then)
                                  for x, then in zip(now, last))
  return (lambda: _columns_term(c, n_at, start_at),
          lambda dq: pl.when(start_at >= 0)(lambda: _add_columns(c, dq, h_at, start_at, fac_at)))


def last_dq(c: DkvCta, last) -> None:
  """Split: consumer 0's dQ columns of the walk's last step ``last = (n, h, start, fac)``
  (consumer 1 wrote its tile before their last meeting, ``pipeline.pingpong``'s)."""
  n, h, start, fac = last

  @pl.when((c.wg == 0) & (start >= 0))
  def _():
    (dq,) = accumulate((_columns_term(c.at_step(start), n, start),))
    _add_columns(c, dq, h, start, fac)


def _columns(c: DkvCta):
  """This consumer's half of dQ's columns (whole swizzle tiles of K)."""
  half = c.g.head_dim // COMPUTE_WGS
  return pl.ds(pl.multiple_of(c.wg * half, half), half)


def _columns_term(c: DkvCta, n, start):
  """The ``accumulate`` term of ``ds K[:, cols]`` of step ``n`` over both consumers' keys."""
  g, r, wg = c.g, c.r, c.wg
  tiles, cols = r.dq_smem[0], _columns(c)
  pairs = tuple((tiles.at[slot_of(n, 2), w].transpose((1, 0)), r.k_own.at[w].at[:, cols])
                for w in (wg, step_index(1 - wg, start, g.step_refs)))
  return zeros((g.walk, cols.size)), pairs


def _add_columns(c: DkvCta, dq, h, start, fac) -> None:
  """``dq[start:start + walk, :, cols] += dq`` (this consumer's columns)."""
  start = pl.multiple_of(start, c.g.walk)  # (a selected step's: TMA's tiling needs it proven)
  _reduce_add(c, dq, c.r.dq.at[c.batch, pl.ds(start, c.g.walk), c.q_head(h), _columns(c)], fac)


def _reduce_add(c: DkvCta, dq, dst, fac) -> None:
  """``dst += dq`` (scaled) by a TMA reduce-add from this consumer's staging tile, once the
  previous one has read it. Fixed point: ``fac`` [walk] (``fixed_point``'s, rows layout) scales
  each row, rounded to int32; else None."""
  cfg, stage = c.cfg, c.r.dq_smem[1].at[c.wg]
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  if fac is None:
    stage[...] = dq * (cfg.scale * cfg.keep_scale)
  else:
    scaled = dq * lax.broadcast_in_dim(fac, dq.shape, (0,))
    stage[...] = lax.round(scaled, lax.RoundingMethod.TO_NEAREST_EVEN).astype(jnp.int32)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(stage, dst, reduction_op="add")


def fused_call(entry, out_shapes, mesh, params, args):
  """Runs the fused kernel ``entry`` over ``mesh``: it adds to dQ in place, its last argument
  (float32, or int32 fixed point), the start of a ref that it updates (``pl.run_state``;
  ``pl.kernel`` aliases ref arguments, which plgpu.kernel's batching wrapper does not take),
  and writes ``out_shapes`` (dK, dV) as fresh outputs. Returns ``(dq, *outputs)``; under vmap,
  one call per element (run_state has no batching rule).

  Only dQ is aliased: given dK and dV as zero-filled refs too, XLA:GPU passed one buffer for
  both where k and v were slices of a larger array (the fusion it builds around a call with
  sliced operands merged the two identical ones), and dK came back as dV."""

  @jax.custom_batching.custom_vmap
  def fused(*args):
    def run(refs):
      dq, *outs = refs
      got = pl.kernel(entry, out_type=tuple(out_shapes), mesh=mesh, compiler_params=params)(
          *args[:-1], dq)
      for ref, x in zip(outs, got):  # (the refs take the outputs whole: no copy, no alias)
        ref[...] = x

    return pl.run_state(run)((args[-1], *(jnp.zeros(o.shape, o.dtype) for o in out_shapes)))

  @fused.def_vmap
  def _(size, batched, *args):
    args = [x if b else jnp.broadcast_to(x, (size, *x.shape)) for x, b in zip(args, batched)]
    outs = lax.map(lambda xs: fused(*xs), args)
    return outs, (True,) * len(outs)

  return fused(*args)
