"""One checked call: the public entry points normalize and check their arguments once.

``check`` validates every argument of an attention call and normalizes it into a ``Checked``:
the arrays (``Arrays``, a pytree), the static settings (``Settings``, hashable) and the backend
variant of each lowering platform. ``flash_attention``, ``ring_attention`` and
``sharded_attention`` each build one and hand it down (``sharded_attention`` hands each shard's
slice of it to the ring); nothing below them checks again. Each error names the argument, its
value or shape, the rule and the fix (``validation``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import jax.numpy as jnp

from pallas_ring import dropout, kernels, pair, validation
from pallas_ring import operands as operands_lib
from pallas_ring import masks as masks_lib
from pallas_ring.config import BlockSizes
from pallas_ring.kernels import tuning

Array = Any


@dataclasses.dataclass(frozen=True)
class Settings:
  """The static settings of a checked call (hashable)."""

  mask: masks_lib.MaskSpec  # visibility in global positions
  scale: float  # logit scale (default H ** -0.5)
  softcap: Optional[float]  # logit soft-cap, None for none
  dropout_rate: float  # attention-probability dropout rate in [0, 1)
  dropout_broadcast: bool  # one dropout mask for every batch row and head
  block_sizes: BlockSizes  # the user's tile overrides (and kernel variants)
  return_lse: bool  # also return the lse
  # ``quantize=``'s FP8 dtype: 16/32-bit q, k, v quantized inside the custom VJPs by the ``fp8``
  # operand's descales, their gradients straight through (``fp8.straight_through``); or None.
  quantize: Optional[Any] = None


class Arrays(NamedTuple):
  """The arrays of a checked call (None when absent); sequences as the caller holds them.

  Attributes:
    segment_ids: int ``[B, T]`` of the queries.
    kv_segment_ids: int ``[B, S]`` of the keys.
    q_positions: int ``[T]`` or ``[B, T]``.
    kv_positions: int ``[S]`` or ``[B, S]``.
    terms: ``{name: array}`` of the optional operands given, normalized (``operands``).
    seeds: int32 ``[2]`` dropout words (``dropout.seeds``) or None (no dropout).
    offsets: int32 ``[2]``: global index of the first local batch row and query head (dropout
      hashes global indices), or None.
  """

  segment_ids: Optional[Array] = None
  kv_segment_ids: Optional[Array] = None
  q_positions: Optional[Array] = None
  kv_positions: Optional[Array] = None
  terms: dict = {}
  seeds: Optional[Array] = None
  offsets: Optional[Array] = None


class Checked(NamedTuple):
  """A checked call: ``Settings``, ``Arrays`` and ``{platform: (backend, interpret)}``."""

  settings: Settings
  arrays: Arrays
  per_platform: dict


def backend_variants(backend: str, interpret, q, block_sizes, decode: bool = False,
                     head_dim: Optional[int] = None, dtype=None):
  """Validated ``(BlockSizes, {platform: (backend, interpret)})`` of a call (see ``kernels``).

  ``decode``: the call is ``decode_attention``'s. ``head_dim``: the head dim the kernels run at
  (``pair.kernel_head_dim``; default q's). ``dtype``: the dtype they compute in (default q's).
  """
  block_sizes = tuning.as_block_sizes(block_sizes)
  head_dim = q.shape[-1] if head_dim is None else head_dim
  dtype = jnp.result_type(q) if dtype is None else dtype
  call = kernels.Call(dtype, head_dim, decode=decode, block_sizes=block_sizes)
  if backend != "auto":
    kernels.check_explicit(backend, call)
  return block_sizes, kernels.variants(backend, interpret, call)


def check(q, k, v, *, kv_shards: int = 1, mask=None, segment_ids=None, kv_segment_ids=None,
          q_positions=None, kv_positions=None, operands: Optional[dict] = None, softcap=None,
          scale=None, dropout_rate: float = 0.0, dropout_rng=None,
          dropout_offsets=(0, 0), dropout_broadcast: bool = False, block_sizes=None,
          backend: str = "auto", interpret=None, return_lse: bool = False,
          names=("q_positions", "kv_positions"), decode: bool = False,
          dtype=None, quantize=None) -> Checked:
  """Checks and normalizes the arguments of an attention call once.

  Args:
    q: ``[B, T, N, H]``; k: ``[B, S, K, H]``; v: ``[B, S, K, Hv]`` (this device's, for a ring
      shard).
    kv_shards: the K/V shards the operands that span the keys cover (a ring shard's: the ring
      size R; their key axis is then ``R * S`` long).
    operands: ``{keyword: value}`` of the optional operands (``operands.DECLARED``; None:
      absent).
    names: how the caller names its two position arguments (for errors).
    decode: the call is ``decode_attention``'s (``auto`` may pick another kernel).
    dtype: the dtype the kernels compute in (default q's; FP8 q, k, v: ``fp8.prepare``'s).
    quantize: ``Settings.quantize``.
    The rest: as ``flash_attention`` (``kv_segment_ids`` default to ``segment_ids`` when
    ``T == S``); ``dropout_offsets`` are its ``dropout_batch_offset`` and
    ``dropout_head_offset``.
  """
  mask = masks_lib.as_spec(mask)
  validation.check_qkv(q, k, v)
  b, t, n, h = q.shape
  s = k.shape[1]
  mask_len = s * kv_shards
  scale = validation.check_positive("scale", scale, h ** -0.5)
  softcap = validation.check_positive("softcap", softcap, None)
  rate = dropout.check_dropout(dropout_rate, dropout_rng)
  on = rate > 0
  wide = jnp.dtype(dtype or q.dtype) == jnp.float64  # (x64: the xla backend's float64)
  terms = operands_lib.normalize(operands or {}, operands_lib.Dims(
      b, n, t, mask_len, jnp.float64 if wide else jnp.float32))
  if kv_segment_ids is None and segment_ids is not None:
    if t != s:
      raise ValueError(f"`kv_segment_ids` is required when T != S (T={t}, S={s}): pass the [B, S] "
                       "segment ids of the keys.")
    kv_segment_ids = segment_ids
  validation.check_token_array("segment_ids", segment_ids, b, t)
  validation.check_token_array("kv_segment_ids", kv_segment_ids, b, s)
  validation.check_token_array(names[0], q_positions, b, t, allow_1d=True)
  validation.check_token_array(names[1], kv_positions, b, s, allow_1d=True)
  if (segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("`segment_ids` and `kv_segment_ids` must be given together (or neither).")
  block_sizes, per_platform = backend_variants(backend, interpret, q, block_sizes, decode,
                                               pair.kernel_head_dim(q, v), dtype)
  settings = Settings(mask, scale, softcap, rate,
                      validation.check_flag("dropout_broadcast", dropout_broadcast), block_sizes,
                      validation.check_flag("return_lse", return_lse),
                      None if quantize is None else jnp.dtype(quantize))
  arrays = Arrays(segment_ids, kv_segment_ids, q_positions, kv_positions, terms,
                  dropout.seeds(dropout_rng) if on else None,
                  jnp.asarray(dropout_offsets, jnp.int32) if on else None)
  return Checked(settings, arrays, per_platform)


__all__ = ["Checked", "Settings", "Arrays", "check", "backend_variants"]
