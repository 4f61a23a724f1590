"""Attention-probability dropout that every backend, layout, tile size and ring size agree on.

Each keep decision is a counter-based hash of ``(key, global batch index, global query head,
q position, k position)`` (``kernels.common.row_keys`` / ``col_keys`` / ``dropout_keep``): nothing
is stored, the backward regenerates it, and ``dropout_keep_mask`` returns exactly the mask the
kernels apply.
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from pallas_ring.kernels import common


def check_dropout(rate, rng) -> float:
  """Validates ``dropout_rate`` / ``dropout_rng`` and returns the rate as a float."""
  try:
    rate = float(rate)
  except TypeError:
    raise TypeError(f"`dropout_rate` must be a Python number, got {type(rate).__name__}.") from None
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"`dropout_rate`={rate!r} is invalid: it must be in [0, 1) (the probability "
                     "of dropping an attention probability); use 0.0 for no dropout.")
  if rate > 0.0 and rng is None:
    raise ValueError(f"`dropout_rate`={rate} needs `dropout_rng`, a JAX PRNG key (e.g. "
                     "jax.random.key(0)); pass one, or dropout_rate=0.0 for no dropout.")
  return rate


def seeds(rng):
  """Two int32 words derived from a PRNG key (typed or raw ``uint32[2]``)."""
  if not (jnp.issubdtype(jnp.result_type(rng), jax.dtypes.prng_key)
          or (np.shape(rng) == (2,) and jnp.result_type(rng) == jnp.uint32)):
    raise TypeError(f"`dropout_rng` must be a JAX PRNG key (jax.random.key(seed) or "
                    f"jax.random.PRNGKey(seed)), got {type(rng).__name__} of shape "
                    f"{np.shape(rng)}.")
  return lax.bitcast_convert_type(jax.random.bits(rng, (2,), jnp.uint32), jnp.int32)


def _positions(x, name):
  x = jnp.asarray(x, jnp.int32)
  if x.ndim not in (1, 2):
    raise ValueError(f"`{name}` has shape {x.shape}; expected [L] or [batch, L].")
  return x[None] if x.ndim == 1 else x


def keys(words, batch: int, heads: int, q_positions, kv_positions, *, batch_offset=0,
         head_offset=0, broadcast: bool = False) -> common.DropoutKeys:
  """The row / column keys the kernels hash (``kernels.common.DropoutKeys``).

  Args:
    words: int32 ``[2]`` from ``seeds(rng)``.
    batch, heads: local batch size and query heads.
    q_positions: ``[Bp, T]``; kv_positions: ``[Bp, S]`` int global positions.
    batch_offset, head_offset: global index of the first local batch row / query head.
    broadcast: one mask for every batch row and head (Flax's ``broadcast_dropout=True``).
  """
  s = words
  qp = _positions(q_positions, "q_positions")
  kp = _positions(kv_positions, "kv_positions")
  if broadcast:
    b_idx = n_idx = jnp.zeros((1, 1, 1), jnp.int32)
  else:
    b_idx = (jnp.arange(batch, dtype=jnp.int32) + batch_offset)[:, None, None]
    n_idx = (jnp.arange(heads, dtype=jnp.int32) + head_offset)[None, :, None]
  return common.DropoutKeys(common.row_keys(s[0], b_idx, n_idx, qp[:, None, :]),
                            common.col_keys(s[1], kp))


def dropout_keep_mask(dropout_rng, dropout_rate: float, batch: int, heads: int, q_positions,
                      kv_positions, *, broadcast: bool = False):
  """Exactly the keep mask the kernels apply: bool ``[batch, heads, T, S]``.

  Args:
    dropout_rng: the PRNG key passed to the attention call.
    dropout_rate: the rate in ``[0, 1)``.
    batch, heads: the *global* batch size and number of query heads.
    q_positions, kv_positions: ``[T]`` / ``[S]`` (or ``[batch, .]``) global positions (default
      ``arange`` in ``flash_attention``; ``layouts.positions`` order for the ring).
    broadcast: as ``flash_attention(dropout_broadcast=...)``.

  Kept probabilities are scaled by ``1 / (1 - rate)`` in the attention output.
  """
  rate = check_dropout(dropout_rate, dropout_rng)
  k = keys(seeds(dropout_rng), batch, heads, q_positions, kv_positions, broadcast=broadcast)
  keep = common.dropout_keep(rate, k.rows[..., None], k.cols[:, None, None, :])
  t, s = keep.shape[-2], keep.shape[-1]
  return jnp.broadcast_to(keep, (batch, heads, t, s))


__all__ = ["dropout_keep_mask"]
