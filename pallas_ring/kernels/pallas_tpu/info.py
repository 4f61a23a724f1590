"""Token info, dense mask, bias, ALiBi and dropout keys as the TPU kernels read them, and the
score terms and mask of one tile."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_ring.kernels import common

class _Info(NamedTuple):
  """Token info, dense mask, bias, ALiBi and dropout keys: arrays, BlockSpecs or kernel refs.

  Query-side vectors are ``[., Tp, 1]`` (blocks ``(bq, 1)``), key-side ones ``[., 1, Sp]``
  (blocks ``(1, bk)``); per-head arrays carry their head axis (1 or N) second, in blocks of the
  program's ``hb`` heads (``head(ref, h)`` reads head ``h``). None where absent.
  """

  qpos: Any
  kpos: Any
  qseg: Any
  kseg: Any
  dense: Any  # int8 [Bm, Nm, Tp, Sp]
  bias: Any  # [Bb, Nb, Tp, Sp]
  alibi: Any  # float32 [Ba, N, 1, 1]
  rows: Any  # int32 [Bd, Nd, Tp, 1] dropout row keys
  cols: Any  # int32 [Bp, 1, Sp] dropout column keys


def _head(ref, h: int, keys=slice(None)):
  """Head ``h`` of a per-head block (a broadcast head axis has one), its ``keys`` columns."""
  return None if ref is None else ref[h if ref.shape[0] > 1 else 0, :, keys]


def _info_arrays(ops) -> _Info:
  col = lambda x: None if x is None else x[:, :, None]
  row = lambda x: None if x is None else x[:, None, :]
  drop = ops.dropout
  return _Info(col(ops.q_info.positions), row(ops.kv_info.positions),
               col(ops.q_info.segment_ids), row(ops.kv_info.segment_ids),
               None if ops.dense is None else ops.dense.astype(jnp.int8), ops.bias,
               None if ops.alibi is None else ops.alibi[..., None],
               None if drop is None else drop.rows[..., None],
               None if drop is None else row(drop.cols))


def _info_specs(arrays: _Info, bq, bk, hb, q_block, k_block, head_block):
  """BlockSpecs for ``_info_arrays``; ``q_block`` / ``k_block`` / ``head_block`` map grid ids
  (and the prefetched lists) to the q block, kv block and query head block."""

  def qspec(x):
    if x is None:
      return None
    return pl.BlockSpec((None, bq, 1), lambda *a: (common.sel(x.shape[0], a[0]), q_block(*a), 0))

  def kspec(x):
    if x is None:
      return None
    return pl.BlockSpec((None, 1, bk), lambda *a: (common.sel(x.shape[0], a[0]), 0, k_block(*a)))

  def head_spec(x, rows, cols, row_block, col_block):
    if x is None:
      return None
    bm, nm = x.shape[:2]
    return pl.BlockSpec((None, hb if nm > 1 else 1, rows, cols), lambda *a: (
        common.sel(bm, a[0]), common.sel(nm, head_block(*a)), row_block(*a), col_block(*a)))

  zero = lambda *_: 0
  a = arrays
  return list(_Info(qspec(a.qpos), kspec(a.kpos), qspec(a.qseg), kspec(a.kseg),
                    head_spec(a.dense, bq, bk, q_block, k_block),
                    head_spec(a.bias, bq, bk, q_block, k_block),
                    head_spec(a.alibi, 1, 1, zero, zero),
                    head_spec(a.rows, bq, 1, q_block, zero), kspec(a.cols)))


def _tile(cfg, info: _Info, h, s, k0, keys, masked):
  """Adds head ``h``'s bias / ALiBi to logits ``s [bq, bk]`` of the tile's ``keys`` (a slice of
  its key block, whose first key is key ``k0`` of the shard), sets its invisible entries to
  ``NEG_INF`` when ``masked`` (traced: the tile is PARTIAL), and draws its dropout keep.

  The mask is one ``lax.cond`` inside the shared body rather than a second copy of the body
  for PARTIAL tiles: each copy of the body is most of a kernel's compile time.

  Returns:
    ``(s, keep)``; ``keep`` None without dropout.
  """
  cols = lambda r: None if r is None else r[:, keys]  # (1, bk) key-side vectors
  q_pos, k_pos = info.qpos[...], cols(info.kpos)
  s = common.score_terms(s, _head(info.bias, h, keys), _head(info.alibi, h), q_pos, k_pos)

  def mask(s):
    k_index = jax.lax.broadcasted_iota(jnp.int32, (1, s.shape[1]), 1) + k0
    vis = common.tile_visible(cfg, q_pos, k_pos, k_index,
                              None if info.qseg is None else info.qseg[...], cols(info.kseg),
                              _head(info.dense, h, keys))
    return jnp.where(vis, s, common.NEG_INF)

  s = lax.cond(masked, mask, lambda s: s, s)
  keep = None
  if cfg.dropout_rate:
    keep = common.dropout_keep(cfg.dropout_rate, _head(info.rows, h), cols(info.cols))
  return s, keep
