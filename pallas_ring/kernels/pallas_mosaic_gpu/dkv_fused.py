"""The fused backward (head dims <= 128, ``tiles.fused_backward``): the dK/dV kernel's
consumers also write each tile's ``ds^T`` to shared memory and add ``ds^T K`` to a float32 dQ in
global memory by TMA reduce-adds through staging tiles, in whatever order the CTAs reach it: dQ
is not bitwise reproducible, and q.k^T and dO.v^T are computed once instead of twice (5 matmuls
per tile instead of 7). At head dim 128 each consumer adds half of dQ's columns over the CTA's
128 keys (``Variants.dq_split``, below); else all columns over its own 64 keys. The matmul is
issued with dV's and dK's where registers allow (``tiles.dq_with_dkv``), else after them; with
them, first, and at head dim 128 added to dQ while theirs run (``tiles.overlap_dq``).
Here: those steps of a consumer, and the launch that updates dQ in place."""

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


def stage_ds(c: DkvCta, ds):
  """This consumer's ``ds^T`` tile to shared memory: the ``accumulate`` term of ``ds^T K`` (the
  tile's A operand)."""
  ds_t = c.r.dq_smem[0].at[c.wg]
  ds_t[...] = ds
  plgpu.commit_smem()
  return (zeros((c.g.walk, c.g.head_dim)), ds_t.transpose((1, 0)), c.k_own)


def add_dq(c: DkvCta, dq, h, start) -> None:
  """``dq[start:start + walk] += dq`` (``ds^T K`` over this consumer's keys) by a TMA reduce-add
  from its staging tile, once the previous one has read it."""
  _reduce_add(c, dq, c.r.dq.at[c.batch, pl.ds(start, c.g.walk), c.q_head(h)])


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


def split_dq(c: DkvCta, n, h, start, last) -> tuple:
  """Split: ``(term, add)``: ``term()``, the ``accumulate`` term of this consumer's dQ columns of
  the step it adds now, and ``add(dq)``, which adds them to dQ. That step is step ``n`` at query
  head rank ``h`` from ``start`` (consumer 1) or the previous one, ``last = (n, h, start)``
  (consumer 0; none before the first: ``start < 0``, then the term reads a tile no one writes in
  this step, and ``add`` adds nothing)."""
  behind = c.wg == 1
  n_at, h_at, start_at = (jnp.where(behind, now, then)
                          for now, then in zip((n, h, start), last))
  return (lambda: _columns_term(c, n_at, start_at),
          lambda dq: pl.when(start_at >= 0)(lambda: _add_columns(c, dq, h_at, start_at)))


def last_dq(c: DkvCta, last) -> None:
  """Split: consumer 0's dQ columns of the walk's last step ``last = (n, h, start)`` (consumer 1
  wrote its tile before their last meeting, ``pipeline.pingpong``'s)."""
  n, h, start = last

  @pl.when((c.wg == 0) & (start >= 0))
  def _():
    (dq,) = accumulate((_columns_term(c.at_step(start), n, start),))
    _add_columns(c, dq, h, start)


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


def _add_columns(c: DkvCta, dq, h, start) -> None:
  """``dq[start:start + walk, :, cols] += dq`` (this consumer's columns)."""
  start = pl.multiple_of(start, c.g.walk)  # (a selected step's: TMA's tiling needs it proven)
  _reduce_add(c, dq, c.r.dq.at[c.batch, pl.ds(start, c.g.walk), c.q_head(h), _columns(c)])


def _reduce_add(c: DkvCta, dq, dst) -> None:
  """``dst += dq`` (scaled) by a TMA reduce-add from this consumer's staging tile, once the
  previous one has read it."""
  cfg, stage = c.cfg, c.r.dq_smem[1].at[c.wg]
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  stage[...] = dq * (cfg.scale * cfg.keep_scale)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(stage, dst, reduction_op="add")


def fused_call(entry, out_shapes, mesh, params, args):
  """Runs the fused kernel ``entry`` over ``mesh``: it adds to dQ in place, its last argument,
  float32, the start of a ref that it updates (``pl.run_state``; ``pl.kernel`` aliases ref
  arguments, which plgpu.kernel's batching wrapper does not take), and writes ``out_shapes``
  (dK, dV) as fresh outputs. Returns ``(dq, *outputs)``; under vmap, one call per element
  (run_state has no batching rule).

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
