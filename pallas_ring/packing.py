"""Packed sequences described by cumulative lengths (``cu_seqlens``), as segment ids."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_ring import validation

# Segment ids of padding past ``cu_seqlens[-1]``: distinct on the query and key side, so a
# padding token sees nothing and nothing sees it.
Q_PAD, KV_PAD = -1, -2


def check_cu_seqlens(name: str, cu_seqlens, length: int, batch: int, segment_ids=None) -> None:
  """Shape, dtype and (when concrete) values of ``cu_seqlens``; no ``segment_ids`` beside it."""
  if segment_ids is not None:
    raise ValueError(f"pass either `{name}` or `segment_ids`, not both: {name} is converted to "
                     "segment ids (pallas_ring.segment_ids_from_cu_seqlens).")
  shape = tuple(np.shape(cu_seqlens))
  if batch != 1:
    raise ValueError(f"`{name}` packs sequences along one row and needs batch size 1, got B="
                     f"{batch}. Flatten the batch into the sequence (q.reshape(1, -1, N, H)) or "
                     "pass [B, T] `segment_ids` instead.")
  if len(shape) != 1 or shape[0] < 2:
    raise ValueError(f"`{name}` has shape {shape}; expected [D + 1] (D >= 1 sequences): the "
                     "cumulative lengths 0, len_0, len_0 + len_1, ...")
  dtype = validation.dtype_of(cu_seqlens)
  if not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(f"`{name}` has dtype {dtype}; it must be an integer array (cast with "
                    "`.astype(jnp.int32)`).")
  try:
    values = np.asarray(cu_seqlens)
  except jax.errors.TracerArrayConversionError:
    return  # traced: the values cannot be checked here
  if values[0] != 0 or np.any(np.diff(values) < 0) or values[-1] > length:
    raise ValueError(f"`{name}`={values.tolist()} is invalid: it must start at 0, never decrease "
                     f"and end at most at the sequence length {length} (tokens past its last "
                     "entry are padding).")


def misuse(cu_seqlens, length: int):
  """A traced bool scalar, True when a traced ``cu_seqlens`` (under ``jit``, where
  ``check_cu_seqlens`` cannot read it) does not start at 0, decreases or ends past ``length``
  (for ``validation.poison``: the output is NaN rather than silently wrong); None when there is
  nothing to check."""
  if not isinstance(cu_seqlens, jax.core.Tracer):
    return None
  return ((cu_seqlens[0] != 0) | jnp.any(jnp.diff(cu_seqlens) < 0)
          | (cu_seqlens[-1] > length))


def check_positions(cu_seqlens, positions, placed: bool, fix: str) -> None:
  """``cu_seqlens`` pack the natural order; a sequence-parallel call finds each token's index
  in it from the layout, or from ``positions`` only where they are a ``Placement``'s (the
  tokens' original indices): other positions beside ``cu_seqlens`` raise."""
  if cu_seqlens is not None and positions is not None and not placed:
    raise ValueError(
        "`cu_seqlens` and `positions` together: `cu_seqlens` pack the naturally ordered "
        "sequence, and positions of your own do not say where each token stands in it. Pass "
        f"{fix}, or segment ids in layout order instead of `cu_seqlens` (e.g. "
        "layouts.permute(pallas_ring.segment_ids_from_cu_seqlens(cu_seqlens, T), ...)).")


def segment_ids_from_cu_seqlens(cu_seqlens, length: int):
  """``[1, length]`` int32 segment ids of packed sequences: token t gets the index of the
  sequence ``cu_seqlens[d] <= t < cu_seqlens[d + 1]``; tokens at or past ``cu_seqlens[-1]`` get
  ``D = len(cu_seqlens) - 1`` (``flash_attention(cu_seqlens=...)`` makes them padding instead).
  """
  return _sequence_of(cu_seqlens, jnp.arange(length, dtype=jnp.int32))[None]


def _sequence_of(cu_seqlens, token_index):
  cu = jnp.asarray(cu_seqlens, jnp.int32)
  return jnp.searchsorted(cu[1:], token_index, side="right").astype(jnp.int32)


def packed_segment_ids(cu_seqlens, token_index, pad_id: int):
  """``[1, L]`` segment ids of the tokens at ``token_index [L]`` (their index in the packed
  row), with ``pad_id`` on tokens at or past ``cu_seqlens[-1]``."""
  cu = jnp.asarray(cu_seqlens, jnp.int32)
  token_index = jnp.asarray(token_index, jnp.int32)
  seg = jnp.where(token_index < cu[-1], _sequence_of(cu, token_index), jnp.int32(pad_id))
  return seg[None]


__all__ = ["segment_ids_from_cu_seqlens"]
