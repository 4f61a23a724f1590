"""Tile sizes of a call, and the rules each backend's tiles obey.

Every field resolves, in order: the user's ``BlockSizes``, the tuning cache or the shipped table
(``tile_cache``: per device kind and shape class, forward and backward separately), then the
heuristic (``Backend.default_block_sizes``: per backend, head dim and device). ``Tiles`` records
where each pass's tiles came from, which ``bench`` prints.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional

from pallas_ring import kernels
from pallas_ring.block_sizes import BlockSizes
from pallas_ring.kernels import backend as backend_lib
from pallas_ring.kernels import tile_cache


@dataclasses.dataclass(frozen=True)
class Tiles:
  """Resolved tile sizes for one call."""

  block_q: int  # forward query tile
  block_kv: int  # forward key tile
  block_q_bwd: int  # backward query tile
  block_kv_bwd: int  # backward key tile
  num_warps: int | None  # Triton warps (forward)
  num_stages: int | None  # Triton stages (forward); Mosaic GPU: K/V shared-memory slots
  source_fwd: str = "heuristic"  # where the forward tiles came from: user|cache|table|heuristic
  source_bwd: str = "heuristic"  # the same for the backward tiles
  variants: Any = None  # the backend's kernel-variant config (``Backend.variants``)


def as_block_sizes(block_sizes: Any) -> BlockSizes:
  """``block_sizes`` as given by a user: None, a BlockSizes, or a mapping of its fields."""
  if block_sizes is None:
    return BlockSizes()
  if isinstance(block_sizes, Mapping):
    return BlockSizes.from_dict(block_sizes)
  if not isinstance(block_sizes, BlockSizes):
    raise TypeError(f"`block_sizes` must be a pallas_ring.BlockSizes, a mapping of its fields "
                    f"(e.g. {{'block_q': 128}}) or None, got {type(block_sizes).__name__}: "
                    f"{block_sizes!r}.")
  return block_sizes


def device_kind(backend: str) -> str:
  """The kind of device ``backend`` runs on (``kernels.target_device``), marked
  ``":interpret"`` when that device runs the backend's kernels in interpret mode."""
  dev = kernels.target_device()
  if dev is None:  # pragma: no cover
    return ""
  interpreted = kernels.interprets(backend, dev.platform)
  return f"{dev.device_kind}:interpret" if interpreted else dev.device_kind


def _tuned(impl: backend_lib.Backend, bs: BlockSizes, kind: str, shape: dict
           ) -> tuple[BlockSizes, str, str]:
  """Fills the unset fields of ``bs`` from the cache / shipped table, per pass."""
  sources = []
  for pass_, fields in tile_cache.PASS_FIELDS.items():
    if all(getattr(bs, f) is not None for f in fields if f.startswith("block_")):
      sources.append("user")
      continue
    if not kind:
      sources.append("heuristic")
      continue
    k = tile_cache.key(kind, impl.name, pass_=pass_, **shape)
    entry, source = tile_cache.lookup(k)
    if entry is not None:
      try:
        cand = BlockSizes.from_dict({f: entry.get(f) for f in fields})
        impl.check_block_sizes(cand)
      except (ValueError, TypeError) as e:
        tile_cache.reject(k, source, str(e))
        entry, source = None, "heuristic"
      else:
        bs = bs.replace(**{f: getattr(bs, f) if getattr(bs, f) is not None else
                           getattr(cand, f) for f in fields})
    sources.append(source)
  return bs, sources[0], sources[1]


def resolve(backend: str, block_sizes: BlockSizes | Mapping | None, q_len: int, kv_len: int,
            head_dim: int, *, dtype=None, group: int = 1, mask_class: str = "other",
            value_dim: Optional[int] = None) -> Tiles:
  """Tile sizes for a call: user overrides, the tuning cache or shipped table, the heuristic;
  clamped to the sequence lengths.

  Args:
    backend: a resolved backend name.
    block_sizes: the user's overrides (None fields are resolved), checked once by the entry
      point (``call.check``: ``kernels.check_explicit`` of the backend).
    q_len, kv_len, head_dim: the call's (unpadded) shape.
    dtype, group, mask_class: the rest of the shape class the cache is keyed by (``dtype=None``
      skips the cache and table).
    value_dim: v's head dim where it differs (MLA): part of the cache key, and the heuristic's.
  """
  impl = kernels.get(backend)
  bs = kernels.for_backend(backend, as_block_sizes(block_sizes))  # (another's variants: dropped)
  kind = device_kind(backend) if dtype is not None else ""
  shape = dict(dtype=dtype, head_dim=head_dim, group=group, mask_cls=mask_class,
               length=max(q_len, kv_len), value_dim=value_dim)
  bs, src_fwd, src_bwd = _tuned(impl, bs, kind, shape)
  d = impl.default_block_sizes(head_dim, kind, dtype, value_dim)
  pick = lambda f: getattr(bs, f) if getattr(bs, f) is not None else getattr(d, f)
  tiles = impl.clamp(tuple(pick(f) for f in backend_lib.TILE_FIELDS), q_len, kv_len)
  return Tiles(*tiles, pick("num_warps"), pick("num_stages"), src_fwd, src_bwd,
               impl.variants(bs))


def padded_len(length: int, *blocks: int) -> int:
  """Smallest multiple of every block size that is >= length."""
  m = 1
  for b in blocks:
    m = m * b // math.gcd(m, b)
  return backend_lib.round_up(length, m)


def padded_head_dim(backend: str, head_dim: int) -> int:
  """The head dim a backend's kernels see (zero-padded; ``Backend.padded_head_dim``)."""
  return kernels.get(backend).padded_head_dim(head_dim)
