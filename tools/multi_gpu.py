"""The several-GPU targets in one run (one call of the device tool), device clock:

1. decode against a cache sharded along its slots over all GPUs vs the whole cache on one
   (``bench.decode_sharded``: 1M-token caches);
2. the sequence-parallel strategies at 32k tokens per GPU, MHA 16/16 and GQA 32/8, against
   all-gather + cuDNN and one GPU doing the same work (``bench.ring``).

    PYTHONPATH=. python tools/multi_gpu.py [decode,ring,gqa,causal,local] [TOKENS_PER_GPU]

(``causal``: only the causal ring layouts, contiguous against zigzag, MHA 16/16; ``local``: the
ring with the local pair's backward whole or in two halves, ``RingVariants.whole_local_pair``,
GQA 32/8, dense and causal zigzag.)

Logs each row as it is measured; the table at the end.
"""

from __future__ import annotations

import sys

import jax

from pallas_ring import bench
from pallas_ring.config import RingVariants


def main(parts=("decode", "ring", "gqa"), tokens=32768):
  log = lambda s: print(s, flush=True)
  log(f"device: {jax.devices()[0].device_kind} x{jax.device_count()}, jax {jax.__version__}")
  rows = []
  with bench.clock("device"):
    if "decode" in parts:
      rows += bench.decode_sharded(log=log)
    if "ring" in parts:
      rows += bench.ring((tokens,), n=16, log=log)
    if "gqa" in parts:
      rows += bench.ring((tokens,), n=32, kv_heads=8, log=log,
                         cases=(("ring", "contiguous", False), ("ring", "zigzag", True)))
    if "causal" in parts:
      rows += bench.ring((tokens,), n=16, log=log,
                         cases=(("ring", "contiguous", True), ("ring", "zigzag", True)))
    if "local" in parts:
      whole = RingVariants(whole_local_pair=True)
      rows += bench.ring((tokens,), n=32, kv_heads=8, log=log, cases=(
          ("ring", "contiguous", False), ("ring", "contiguous", False, whole),
          ("ring", "zigzag", True), ("ring", "zigzag", True, whole)))
  print("\n| case | impl | pass | ms | TFLOP/s | ratio |\n|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r.case} | {r.impl} | {r.pass_} | {r.ms:.3f} | {r.tflops:.1f} | {r.ratio} |")


if __name__ == "__main__":
  main(tuple(sys.argv[1].split(",")) if len(sys.argv) > 1 else ("decode", "ring", "gqa"),
       int(sys.argv[2]) if len(sys.argv) > 2 else 32768)
