"""The fused backward (``Variants(deterministic=False)``, head dims <= 128): the dK/dV kernel's
consumers also write each tile's ``ds^T`` to shared memory and add ``ds^T K`` of their 64 keys
to a float32 dQ in global memory by a TMA reduce-add through a staging tile, in whatever order
the CTAs reach it: dQ is not bitwise reproducible, and q.k^T and dO.v^T are computed once
instead of twice (5 matmuls per tile instead of 7). Where registers allow
(``Variants.dq_with_dkv_up_to``) the ``ds^T K`` matmul is issued with dV's and dK's, else after
them. Here: those two steps of a consumer, and the launch that updates dQ in place."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_ring.kernels.pallas_mosaic_gpu.bwd_common import zeros

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
  cfg = c.cfg
  stage = c.r.dq_smem[1].at[c.wg]
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  stage[...] = dq * (cfg.scale * cfg.keep_scale)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(stage, c.r.dq.at[c.batch, pl.ds(start, c.g.walk), c.q_head(h)],
                          reduction_op="add")


def fused_call(entry, out_shapes, mesh, params, args):
  """Runs the fused kernel ``entry`` over ``mesh``: it adds to dQ in place, its last argument,
  float32, the start of a ref that it updates, as are dK/dV (``pl.run_state``; ``pl.kernel``
  aliases ref arguments, which plgpu.kernel's batching wrapper does not take). Returns ``(dq,
  *outputs)``; under vmap, one call per element (run_state has no batching rule)."""

  @jax.custom_batching.custom_vmap
  def fused(*args):
    run = lambda refs: pl.kernel(entry, out_type=(), mesh=mesh, compiler_params=params)(
        *args[:-1], *refs)
    return pl.run_state(run)((args[-1], *(jnp.zeros(o.shape, o.dtype) for o in out_shapes)))

  @fused.def_vmap
  def _(size, batched, *args):
    args = [x if b else jnp.broadcast_to(x, (size, *x.shape)) for x, b in zip(args, batched)]
    outs = lax.map(lambda xs: fused(*xs), args)
    return outs, (True,) * len(outs)

  return fused(*args)
