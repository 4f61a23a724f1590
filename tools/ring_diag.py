"""Times variants of the ring's GPU schedule on all local GPUs (a diagnostic, not a benchmark).

Each variant rebuilds the ring's private static config with one switch flipped, so its effect is
measured on the same machine in the same run:

  shipped   the default schedule
  cond      skip empty steps with lax.cond (as on TPU)
  nopack    one ppermute per array instead of one packed buffer per step
  unroll    fully unrolled ring scan

Usage (on a GPU machine): ``PYTHONPATH=. python tools/ring_diag.py shipped,cond,nopack``
Environment: DIAG_SIZES (tokens per GPU, default 8192), DIAG_CASES (dense,zigzag,contig).
"""

import os
import sys

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from pallas_ring import bench, masks, ring as ring_mod
from pallas_ring.attention import flash_attention
from pallas_ring.config import SequenceParallelConfig
from pallas_ring.sharded import sharded_attention

CASES = {  # name: (layout, causal)
    "dense": ("contiguous", False), "zigzag": ("zigzag", True), "contig": ("contiguous", True)}


def main(variants):
  r = jax.device_count()
  mesh = jax.make_mesh((r,), ("sp",), axis_types=(AxisType.Auto,))
  shipped = ring_mod._RingStatic
  cases = os.environ.get("DIAG_CASES", "dense,zigzag,contig").split(",")
  for tl in (int(x) for x in os.environ.get("DIAG_SIZES", "8192").split(",")):
    b, n, h = 1, 16, 128
    sh = NamedSharding(mesh, P(None, "sp"))
    q, k, v, do = (jax.device_put(x, sh) for x in bench._inputs(b, tl * r, n, h, seed=2))
    one_args = [jax.device_put(x, jax.devices()[0]) for x in (q[:, :tl], k, v)]
    one = bench.timeit(jax.jit(flash_attention), *one_args, iters=5, reps=3)
    print(f"{tl} tokens/GPU x {r}: one GPU, same work {one * 1e3:.3f} ms", flush=True)
    for name in variants:
      def variant(*a, name=name, **kw):
        kw.update({"cond": {"use_cond": True}, "nopack": {"pack_sends": False}}.get(name, {}))
        return shipped(*a, **kw)
      ring_mod._RingStatic = variant
      for case in cases:
        layout, causal = CASES[case]
        cfg = SequenceParallelConfig(axis_name="sp", layout=layout,
                                     scan_unroll=r if name == "unroll" else 1)
        mask = masks.Causal() if causal else None
        f = lambda q_, k_, v_, cfg=cfg, mask=mask: sharded_attention(
            q_, k_, v_, mesh=mesh, config=cfg, mask=mask)
        fwd = bench.timeit(jax.jit(f), q, k, v, iters=5, reps=3)
        both = bench.timeit(bench._fwd_bwd(f), q, k, v, do, iters=3, reps=3)
        print(f"  {name:8s} {case:7s} fwd {fwd * 1e3:8.3f} ms  fwd+bwd {both * 1e3:8.3f} ms",
              flush=True)
    ring_mod._RingStatic = shipped


if __name__ == "__main__":
  main(sys.argv[1].split(",") if len(sys.argv) > 1 else ["shipped", "cond", "nopack"])
