"""pallas_ring: block-sparse flash attention and ring attention for JAX, Pallas-first."""

from pallas_ring import layouts, masks
from pallas_ring.attention import flash_attention
from pallas_ring.block_sparse import TokenInfo
from pallas_ring.config import BlockSizes, SequenceParallelConfig
from pallas_ring.ring import ring_attention
from pallas_ring.sharded import sharded_attention

__version__ = "0.1.0"


def __getattr__(name):
  # `pallas_ring.nn` imports Flax: load it on first use, not with the package.
  if name == "nn":
    import importlib
    return importlib.import_module("pallas_ring.nn")
  raise AttributeError(f"module 'pallas_ring' has no attribute {name!r}")


__all__ = ["nn", "flash_attention", "ring_attention", "sharded_attention", "masks", "layouts",
           "BlockSizes", "SequenceParallelConfig", "TokenInfo"]
