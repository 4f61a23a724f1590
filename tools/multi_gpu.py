"""The several-GPU targets in one run (one call of the device tool), device clock:

0. ``check``: the ring's output and gradients on all GPUs against the float32 xla backend on
   one (dense and zigzag causal, GQA 8/2 and MHA, 4k tokens per GPU, the local pair whole and
   in halves): relative errors, and a line saying whether all are below 2e-2;
1. decode against a cache sharded along its slots over all GPUs vs the whole cache on one
   (``bench.decode_sharded``: 1M-token caches);
2. the sequence-parallel strategies at 32k tokens per GPU, MHA 16/16 and GQA 32/8, against
   all-gather + cuDNN and one GPU doing the same work (``bench.ring``).

    PYTHONPATH=. python tools/multi_gpu.py [check,decode,ring,gqa,causal,local] [TOKENS_PER_GPU]

(``causal``: only the causal ring layouts, contiguous against zigzag, MHA 16/16; ``local``: the
ring with the local pair's backward whole (the rule on Hopper) or in two halves
(``RingVariants(whole_local_pair=False)``), GQA 32/8, dense and causal zigzag.)

Logs each row as it is measured; the table at the end.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from pallas_ring import bench, layouts, masks
from pallas_ring.attention import flash_attention
from pallas_ring.config import RingVariants, SequenceParallelConfig
from pallas_ring.sharded import sharded_attention


def check(log, tokens=4096, tol=2e-2) -> bool:
  """``check`` (above): logs one line per case; whether every error is below ``tol``."""
  r = jax.device_count()
  mesh = jax.make_mesh((r,), ("sp",), axis_types=(AxisType.Auto,))
  shard = NamedSharding(mesh, P(None, "sp"))
  rel = lambda a, b: float(jnp.linalg.norm((a - b).astype(jnp.float32))
                           / jnp.linalg.norm(b.astype(jnp.float32)))
  ok = True
  for kv_heads, layout, mask in ((2, "contiguous", None), (2, "zigzag", masks.Causal()),
                                 (8, "contiguous", None)):
    q, k, v, do = bench.random_inputs(1, tokens * r, 8, 128, seed=5, kv_heads=kv_heads)
    ref = bench.fwd_bwd(lambda a, b, c: flash_attention(a, b, c, mask=mask, backend="xla"))(
        *(x.astype(jnp.float32) for x in (q, k, v, do)))
    for whole in (None, False):
      cfg = SequenceParallelConfig(axis_name="sp", layout=layout,
                                   ring_variants=RingVariants(whole_local_pair=whole))
      f = bench.fwd_bwd(lambda a, b, c: sharded_attention(a, b, c, mesh=mesh, config=cfg,
                                                           mask=mask))
      got = f(*(jax.device_put(layouts.permute(x, layout, r), shard) for x in (q, k, v, do)))
      out, grads = jax.tree.map(lambda x: layouts.unpermute(x, layout, r), got)
      errs = [rel(out, ref[0])] + [rel(g, w) for g, w in zip(grads, ref[1])]
      ok &= max(errs) < tol
      log(f"check 8/{kv_heads} {layout} {'dense' if mask is None else 'causal'}"
          f"{' halves' if whole is False else ''}: relative error out, dq, dk, dv "
          + " ".join(f"{e:.1e}" for e in errs))
  log(f"check: {'all below' if ok else 'NOT all below'} {tol}")
  return ok


def main(parts=("check", "decode", "ring", "gqa"), tokens=32768):
  log = lambda s: print(s, flush=True)
  log(f"device: {jax.devices()[0].device_kind} x{jax.device_count()}, jax {jax.__version__}")
  if "check" in parts and not check(log):
    sys.exit(1)
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
      halves = RingVariants(whole_local_pair=False)
      rows += bench.ring((tokens,), n=32, kv_heads=8, log=log, cases=(
          ("ring", "contiguous", False), ("ring", "contiguous", False, halves),
          ("ring", "zigzag", True), ("ring", "zigzag", True, halves)))
  print("\n| case | impl | pass | ms | TFLOP/s | ratio |\n|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r.case} | {r.impl} | {r.pass_} | {r.ms:.3f} | {r.tflops:.1f} | {r.ratio} |")


if __name__ == "__main__":
  main(tuple(sys.argv[1].split(",")) if len(sys.argv) > 1 else ("check", "decode", "ring", "gqa"),
       int(sys.argv[2]) if len(sys.argv) > 2 else 32768)
