"""The forward's epilogue: a consumer normalises its rows of a work item and writes them with
their lse (through its staging tile: ``FwdGeometry.o_staging``), or merges them
into the ring's running result (``common.Partial``, in global memory); either way the next
item's q rows load meanwhile."""

from __future__ import annotations

from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_ring.kernels import common
from pallas_ring.kernels.pallas_mosaic_gpu.fwd_mainloop import Consumer, ItemRows, load_q
from pallas_ring.kernels.pallas_mosaic_gpu.pipeline import ROWS, load_ref


def epilogue(c: Consumer, rows: ItemRows, i, acc, m, l) -> None:
  """Writes this consumer's rows of item ``i`` from its walk's ``(acc, m, l)`` (``walk``) and
  issues the loads of its next item's q rows."""
  g, cfg, r = c.g, c.cfg, c.r
  nxt = i + g.ctas
  if g.merge:  # (the q tile is free: the next item's q loads while these rows merge)
    pl.when(nxt < g.items)(lambda: load_q(c, nxt))
  if g.terms.separable:
    m = m - rows.q_term  # (the row's lse in the logits with the whole position term)
  empty = l == 0.0
  inv = cfg.keep_scale / jnp.where(empty, 1.0, l)  # (dropout: kept terms' 1 / (1 - rate))
  if rows.out_descale is not None:  # (FP8: v's descale)
    inv = inv * rows.out_descale
  lse = jnp.where(empty, -jnp.inf, m * common.LN2 + jnp.log(jnp.where(empty, 1.0, l)))
  by_row = lambda x: lax.broadcast_in_dim(x, acc.shape, [0])
  seq = pl.ds(rows.q0, g.bq)
  own_o, own_lse = r.o.at[rows.batch, seq, rows.head], r.lse.at[rows.batch, rows.head, seq]
  if g.merge:  # the earlier passes' rows, read from and written to global memory in float32
    acc_o, acc_lse = r.acc
    lse, c_acc, c_own = common.merge_weights(
        load_ref(acc_lse.at[rows.batch, rows.head, seq], ROWS, optimized=False), lse)
    earlier = load_ref(acc_o.at[rows.batch, seq, rows.head], plgpu.Layout.WGMMA,
                       optimized=False)
    own_o[...] = earlier * by_row(c_acc) + acc * by_row(inv * c_own)
    own_lse[...] = lse
  else:  # through the staging tile (the q tile, which the next item's q then overwrites, or
    # its own)
    c.o_smem[...] = (acc * by_row(inv)).astype(g.out_dtype)
    c.lse_smem[...] = lse
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(c.o_smem, own_o)
    plgpu.copy_smem_to_gmem(c.lse_smem, own_lse)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    pl.when(nxt < g.items)(lambda: load_q(c, nxt))
