"""Tile sizes of a call, and the rules each backend's tiles obey.

Every field resolves, in order: the user's ``BlockSizes``, the tuning cache or the shipped table
(``tile_cache``: per device kind and shape class, forward and backward separately), then the
heuristic below (per backend, head dim and device). ``Tiles`` records where each pass's tiles came
from, which ``bench`` prints.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax

from pallas_ring.config import BlockSizes
from pallas_ring.kernels import tile_cache


@dataclasses.dataclass(frozen=True)
class Tiles:
  """Resolved tile sizes for one call."""

  block_q: int  # forward query tile
  block_kv: int  # forward key tile
  block_q_bwd: int  # backward query tile
  block_kv_bwd: int  # backward key tile
  num_warps: int | None  # Triton warps (forward)
  num_stages: int | None  # Triton stages (forward)
  source_fwd: str = "heuristic"  # where the forward tiles came from: user|cache|table|heuristic
  source_bwd: str = "heuristic"  # the same for the backward tiles


def _next_pow2(x: int) -> int:
  return 1 << max(0, (x - 1).bit_length())


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _defaults(backend: str, head_dim: int, device_kind: str) -> BlockSizes:
  if backend == "pallas_triton":
    if head_dim <= 64:
      return BlockSizes(128, 128, 64, 64, 4, 3)
    if head_dim <= 128:
      return BlockSizes(128, 64, 64, 64, 4, 3)
    return BlockSizes(64, 32, 32, 32, 4, 2)
  if backend == "pallas_mosaic_gpu":  # 2 x 64 rows per CTA; the backward kernels take 128 x 128
    block_kv = 256 if head_dim <= 64 else 128 if head_dim <= 128 else 64
    return BlockSizes(128, block_kv, 128, 128, None, None)
  if backend == "pallas_tpu":
    kind = device_kind.lower()
    if any(f"v{g}" in kind for g in (2, 3, 4)):  # 16 MiB of VMEM: 8-head programs need less
      return BlockSizes(256, 512, 128, 256, None, None)
    big = "v6" in kind or "v5p" in kind
    return BlockSizes(512, 1024 if big else 512, 256, 512, None, None)
  return BlockSizes(128, 128, 128, 128, None, None)


_MOSAIC_MIN = {"block_q": 128, "block_kv": 64, "block_q_bwd": 16, "block_kv_bwd": 16}


def check_block_sizes(backend: str, bs: BlockSizes) -> None:
  """Raises ValueError when a user-given block size breaks a backend's rule."""
  for f in ("block_q", "block_kv", "block_q_bwd", "block_kv_bwd"):
    val = getattr(bs, f)
    if val is None:
      continue
    if backend == "pallas_mosaic_gpu" and (val < _MOSAIC_MIN[f] or val & (val - 1)):
      raise ValueError(
          f"block_sizes.{f}={val} cannot be used by backend 'pallas_mosaic_gpu': its tiles are "
          f"powers of two, block_q >= 128 (two warpgroups of >= 64 rows), block_kv >= 64, and "
          f"the backward's >= 16 (its own kernels take 128 x 128 backward tiles; other tiles run "
          f"the Triton backward). Use "
          f"{max(_MOSAIC_MIN[f], _next_pow2(val))}, or None for the tuned default.")
    if backend == "pallas_triton" and (val < 16 or val & (val - 1)):
      raise ValueError(
          f"block_sizes.{f}={val} cannot be used by backend 'pallas_triton': Triton tiles must be "
          f"powers of two >= 16 (tl.dot's minimum). Use {max(16, _next_pow2(val))}, or None for "
          "the tuned default.")
    if backend == "pallas_tpu":
      unit = 128 if "kv" in f else 8
      if val % unit:
        raise ValueError(
            f"block_sizes.{f}={val} cannot be used by backend 'pallas_tpu': TPU tiles must be "
            f"multiples of {unit} ({'lanes' if unit == 128 else 'sublanes'}; Mosaic's (8, 128) "
            f"rule). Use {_round_up(val, unit)}, or None for the default.")


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


def accepts(backend: str, bs: BlockSizes) -> bool:
  """Whether ``backend`` can run with the user-given block sizes ``bs``."""
  try:
    check_block_sizes(backend, bs)
  except ValueError:
    return False
  return True


def device_kind(backend: str) -> str:
  """The kind of device ``backend`` runs on here: the default device's kind, marked
  ``":interpret"`` when that device runs the backend's kernels in interpret mode."""
  from pallas_ring import kernels  # the package that holds this module
  try:
    dev = jax.devices()[0]
  except RuntimeError:  # pragma: no cover - no backend at all
    return ""
  native = kernels.BACKEND_PLATFORM[backend] in (None, kernels.family(dev.platform))
  return dev.device_kind if native else f"{dev.device_kind}:interpret"


def _tuned(backend, bs: BlockSizes, kind: str, shape: dict) -> tuple[BlockSizes, str, str]:
  """Fills the unset fields of ``bs`` from the cache / shipped table, per pass."""
  sources = []
  for pass_, fields in tile_cache.PASS_FIELDS.items():
    if all(getattr(bs, f) is not None for f in fields if f.startswith("block_")):
      sources.append("user")
      continue
    if not kind:
      sources.append("heuristic")
      continue
    k = tile_cache.key(kind, backend, pass_=pass_, **shape)
    entry, source = tile_cache.lookup(k)
    if entry is not None:
      try:
        cand = BlockSizes.from_dict({f: entry.get(f) for f in fields})
        check_block_sizes(backend, cand)
      except (ValueError, TypeError) as e:
        tile_cache.reject(k, source, str(e))
        entry, source = None, "heuristic"
      else:
        bs = bs.replace(**{f: getattr(bs, f) if getattr(bs, f) is not None else
                           getattr(cand, f) for f in fields})
    sources.append(source)
  return bs, sources[0], sources[1]


def resolve(backend: str, block_sizes: BlockSizes | Mapping | None, q_len: int, kv_len: int,
            head_dim: int, *, dtype=None, group: int = 1, mask_class: str = "other") -> Tiles:
  """Tile sizes for a call: user overrides, the tuning cache or shipped table, the heuristic;
  clamped to the sequence lengths.

  Args:
    backend: a resolved backend name.
    block_sizes: the user's overrides (None fields are resolved).
    q_len, kv_len, head_dim: the call's (unpadded) shape.
    dtype, group, mask_class: the rest of the shape class the cache is keyed by (``dtype=None``
      skips the cache and table).
  """
  bs = as_block_sizes(block_sizes)
  check_block_sizes(backend, bs)
  kind = device_kind(backend) if dtype is not None else ""
  shape = dict(dtype=dtype, head_dim=head_dim, group=group, mask_cls=mask_class,
               length=max(q_len, kv_len))
  bs, src_fwd, src_bwd = _tuned(backend, bs, kind, shape)
  d = _defaults(backend, head_dim, kind)
  pick = lambda f: getattr(bs, f) if getattr(bs, f) is not None else getattr(d, f)
  bq, bk, bqb, bkb = (pick(f) for f in ("block_q", "block_kv", "block_q_bwd", "block_kv_bwd"))
  if backend == "pallas_triton":
    cap_q, cap_k = max(16, _next_pow2(q_len)), max(16, _next_pow2(kv_len))
  elif backend == "pallas_mosaic_gpu":
    cap_q, cap_k = max(128, _next_pow2(q_len)), max(64, _next_pow2(kv_len))
  elif backend == "pallas_tpu":
    cap_q, cap_k = _round_up(q_len, 8), _round_up(kv_len, 128)
  else:
    cap_q, cap_k = q_len, kv_len
  cap_kb = cap_k
  if backend == "pallas_mosaic_gpu":
    cap_kb = max(128, cap_k)  # its backward kernels own 128 keys per CTA
  bq, bqb = min(bq, cap_q), min(bqb, cap_q)
  bk, bkb = min(bk, cap_k), min(bkb, cap_kb)
  if backend == "pallas_tpu":  # the query tile must also tile by 8 after clamping
    bq, bqb = _round_up(bq, 8), _round_up(bqb, 8)
  return Tiles(bq, bk, bqb, bkb, pick("num_warps"), pick("num_stages"), src_fwd, src_bwd)


def padded_len(length: int, *blocks: int) -> int:
  """Smallest multiple of every block size that is >= length."""
  m = 1
  for b in blocks:
    m = m * b // math.gcd(m, b)
  return _round_up(length, m)


def padded_head_dim(backend: str, head_dim: int) -> int:
  """The head dim a backend's kernels see (zero-padded): Triton arrays need powers of two >= 16
  (Mosaic GPU: wgmma tiles of 64, and powers of two: 64, 128, 256);
  the TPU kernels slice heads out of lane blocks where heads are not a multiple of 8, so H is a
  multiple of 128 lanes there (no padding for H = 128, 256)."""
  if backend == "pallas_triton":
    return max(16, _next_pow2(head_dim))
  if backend == "pallas_mosaic_gpu":
    return max(64, _next_pow2(head_dim))
  if backend == "pallas_tpu":
    return _round_up(head_dim, 128)
  return head_dim
