"""pallas_ring: block-sparse flash attention and ring attention for JAX, Pallas-first.

The public names load lazily, so ``python -m pallas_ring --help`` answers before JAX is imported.
"""

import importlib

from pallas_ring import _quiet

_quiet.quiet_libtpu()

__version__ = "0.1.0"

# public name -> (module, attribute or None for the module itself)
_PUBLIC = {
    "flash_attention": ("pallas_ring.attention", "flash_attention"),
    "ring_attention": ("pallas_ring.ring", "ring_attention"),
    "sharded_attention": ("pallas_ring.sharded", "sharded_attention"),
    "decode_attention": ("pallas_ring.decode", "decode_attention"),
    "BlockSizes": ("pallas_ring.config", "BlockSizes"),
    "SequenceParallelConfig": ("pallas_ring.config", "SequenceParallelConfig"),
    "RingVariants": ("pallas_ring.config", "RingVariants"),
    "TokenInfo": ("pallas_ring.block_sparse", "TokenInfo"),
    "tuning_cache_path": ("pallas_ring.kernels.tile_cache", "tuning_cache_path"),
    "dropout_keep_mask": ("pallas_ring.dropout", "dropout_keep_mask"),
    "segment_ids_from_cu_seqlens": ("pallas_ring.packing", "segment_ids_from_cu_seqlens"),
    "quantize_fp8": ("pallas_ring.fp8", "quantize_fp8"),
    "masks": ("pallas_ring.masks", None),
    "layouts": ("pallas_ring.layouts", None),
    "reference": ("pallas_ring.reference", None),
    "nn": ("pallas_ring.nn", None),  # imports Flax
}


def __getattr__(name):
  if name not in _PUBLIC:
    raise AttributeError(f"module 'pallas_ring' has no attribute {name!r}")
  module, attr = _PUBLIC[name]
  value = importlib.import_module(module)
  if attr is not None:
    value = getattr(value, attr)
  globals()[name] = value
  return value


def __dir__():
  return sorted(set(globals()) | set(_PUBLIC))


__all__ = ["nn", "flash_attention", "ring_attention", "sharded_attention", "decode_attention",
           "masks", "layouts", "BlockSizes", "SequenceParallelConfig", "RingVariants", "TokenInfo",
           "tuning_cache_path", "dropout_keep_mask", "segment_ids_from_cu_seqlens",
           "quantize_fp8"]
