"""Block plans built once and held: the ``Planner`` of one call.

``block_sparse`` builds a plan from positions; this module decides when a plan can be built
ahead of the call and holds it, as splash attention's ``make_splash_mha`` builds its mask info
once from (mask, shapes, tiles). An entry point (``flash_attention``, one ring call) makes one
``Planner`` from its static sizes; the forward and the backward pass ask it for their plans.

* Positions known while tracing (``flash_attention``'s default token indices, or a ring whose
  positions follow its layout) and no segment ids or dense mask: the planner builds every plan
  in numpy, once (at the first pass that asks for it), and they enter the program as constants;
  a ring selects its (rank, source) pair's plan from a table.
* Otherwise the plan is built on device from the call's ``TokenInfo`` (with known positions as
  numpy constants, so only the segment part runs).

A planner is hashable by its static fields and immutable: it travels as a jit static argument,
and the plans it builds ahead are kept in a module-level cache keyed by it (equal planners share
them); a new configuration builds new plans.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Optional, Tuple, Union

import jax.numpy as jnp

from pallas_ring import block_sparse, layouts
from pallas_ring import masks as masks_lib


@dataclasses.dataclass(frozen=True)
class Limits:
  """How much a planner builds ahead; past these sizes plans are built on device."""

  # The most tiles (q blocks x kv blocks) of one plan built ahead: larger ones would put
  # megabytes of constants into the program, and their device ops cost little next to the
  # kernels of such lengths.
  max_tiles: int = 1 << 16
  # The most (rank, source) pairs of a ring whose plans are built ahead: tracing's numpy work
  # grows with pairs x tiles.
  max_pairs: int = 64


class Indexed(NamedTuple):
  """Positions are the token indices ``0 .. len - 1`` (``flash_attention``'s default)."""


class RingLayout(NamedTuple):
  """A ring's positions follow its layout (``layouts.positions``) over the whole sequence."""

  seq_len: int  # T, tokens of the whole sequence
  layout: str  # "contiguous" | "zigzag" | "striped"
  ring_size: int  # R
  gathered: bool  # K/V are gathered whole (all_gather): one kv column instead of R


Tiles = Tuple[int, int]  # (block_q, block_kv)
_indexed = block_sparse.indexed_positions  # (length, padded) -> [1, padded] int32 numpy


@dataclasses.dataclass(frozen=True)
class Planner:
  """The block plans of one call's (q, kv) pairs, forward and backward.

  Attributes:
    mask: the mask spec, in global positions.
    q_len, kv_len: real tokens of one pair's q and kv (a ring: of one shard; gathered K/V: all).
    q_padded, kv_padded: their padded lengths (Tp, Sp).
    forward_tiles, backward_tiles: ``(block_q, block_kv)`` of each pass.
    positions: how positions are known while tracing (``Indexed``, ``RingLayout``), or None
      when they are data (every plan is built on device).
    limits: the sizes past which plans are built on device.
  """

  mask: masks_lib.MaskSpec
  q_len: int
  kv_len: int
  q_padded: int
  kv_padded: int
  forward_tiles: Tiles
  backward_tiles: Tiles
  positions: Optional[Union[Indexed, RingLayout]] = None
  limits: Limits = Limits()

  def plan(self, ops, backward: bool = False, rank=0, src=0) -> block_sparse.BlockPlan:
    """The plan of pair (q shard ``rank``, kv shard ``src``; traced or static, 0 on one device
    or with gathered K/V) for the forward or the backward tiles.

    Args:
      ops: the pair's ``kernels.common.Operands`` (its TokenInfo and dense mask).
      backward: the backward pass's tiles.
      rank, src: the pair's q and kv shard indices.
    """
    bq, bk = self.backward_tiles if backward else self.forward_tiles
    q_info, kv_info = ops.q_info, ops.kv_info
    known = self.positions is not None and self._tiles_ahead(bq, bk) <= self.limits.max_tiles
    if known and ops.dense is None and q_info.segment_ids is None and kv_info.segment_ids is None:
      ahead = self._ahead(bq, bk)
      if ahead is not None:
        return block_sparse.select_plan(*ahead, rank, src)
    if known and isinstance(self.positions, Indexed):  # only the segment part runs on device
      q_info = q_info._replace(positions=_indexed(self.q_len, self.q_padded))
      kv_info = kv_info._replace(positions=_indexed(self.kv_len, self.kv_padded))
    plan = block_sparse.make_plan(self.mask, q_info, kv_info, block_q=bq, block_kv=bk,
                                  q_len=self.q_len, kv_len=self.kv_len, dense_mask=ops.dense)
    return block_sparse.BlockPlan(*map(jnp.asarray, plan))  # (numpy positions: constants)

  def _tiles_ahead(self, bq: int, bk: int) -> int:
    return (self.q_padded // bq) * (self.kv_padded // bk)

  def _ahead(self, bq: int, bk: int):
    """``(plans, table)`` of every pair, built in numpy at the first request (of any equal
    planner); None when the ring has more pairs than ``limits.max_pairs``."""
    return _built(self, bq, bk)

  def _build(self, bq: int, bk: int):
    info = lambda pos, padded: block_sparse.pad_token_info(block_sparse.TokenInfo(pos[None]),
                                                           padded)
    if isinstance(self.positions, Indexed):
      q_infos = [block_sparse.TokenInfo(_indexed(self.q_len, self.q_padded))]
      kv_infos = [block_sparse.TokenInfo(_indexed(self.kv_len, self.kv_padded))]
    else:
      seq_len, layout, r, gathered = self.positions
      if r * (1 if gathered else r) > self.limits.max_pairs:
        return None
      order = layouts.global_order(seq_len, layout, r)  # [T] int32, layout order
      shard = lambda i: order[i * self.q_len:(i + 1) * self.q_len]
      q_infos = [info(shard(i), self.q_padded) for i in range(r)]
      kv_infos = ([info(order, self.kv_padded)] if gathered else
                  [info(shard(j), self.kv_padded) for j in range(r)])
    plans, table = block_sparse.plan_table(self.mask, q_infos, kv_infos, block_q=bq,
                                           block_kv=bk, q_len=self.q_len, kv_len=self.kv_len)
    for x in (*plans, table):
      x.flags.writeable = False
    return plans, table


@functools.lru_cache(maxsize=64)
def _built(planner: Planner, bq: int, bk: int):
  """``planner._build(bq, bk)``, once per equal planner and tiles (a planner is a frozen jit
  static argument: its plans are cached here, not in the planner)."""
  return planner._build(bq, bk)  # pylint: disable=protected-access


def on_device(ops, cfg, backward: bool = False) -> block_sparse.BlockPlan:
  """The plan of ``ops``' positions, built on device (no planner: tests and tools that hand a
  kernel its plan). ``cfg``: the pair's ``kernels.common.KernelConfig``."""
  return for_config(cfg, ops.q_info.positions.shape[-1],
                    ops.kv_info.positions.shape[-1]).plan(ops, backward)


def for_config(cfg, q_padded: int, kv_padded: int, positions=None,
               limits: Limits = Limits()) -> Planner:
  """The planner of a pair of ``cfg`` (a ``kernels.common.KernelConfig``: mask, lengths,
  tiles) padded to ``(q_padded, kv_padded)``."""
  return Planner(cfg.mask, cfg.q_len, cfg.kv_len, q_padded, kv_padded,
                 (cfg.block_q, cfg.block_kv), (cfg.block_q_bwd, cfg.block_kv_bwd), positions,
                 limits)


__all__ = ["Planner", "Limits", "Indexed", "RingLayout", "for_config", "on_device"]
