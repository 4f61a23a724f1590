"""Tune the bench shapes on this GPU, and time heuristic vs tuned tiles in the same run.

Writes the tile cache to $PALLAS_RING_CACHE_DIR (default ./tune_out) and prints, per shape, the
forward and forward+backward time of ``flash_attention`` with ``block_sizes=None`` before the
tune (heuristic tiles) and after it (cached tiles). Usage on a GPU machine::

    PYTHONPATH=. python tools/tune_gpu.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

SHAPES = [  # (name, T, N, K, H, B, mask)
    ("dense T=16k", 16384, 16, 16, 128, 1, "full"),
    ("causal T=16k", 16384, 16, 16, 128, 1, "causal"),
    ("16 docs of 1024", 16384, 16, 16, 128, 1, "docs:1024"),
    ("Llama GQA 32/8 T=8k", 8192, 32, 8, 128, 1, "causal"),
    ("H=256 T=8k", 8192, 16, 16, 256, 1, "causal"),
    ("dense T=4k", 4096, 16, 16, 128, 1, "full"),
    ("causal T=4k", 4096, 16, 16, 128, 1, "causal"),
    ("causal window 1024 T=16k", 16384, 16, 16, 128, 1, "window:1024"),
]


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--quick", action="store_true", help="two shapes, fewer repeats")
  p.add_argument("--shapes", default=None,
                 help="comma-separated shape names to run (default: all), e.g. 'dense T=4k'")
  p.add_argument("--out", default=os.environ.get("OUT", "tune_out"))
  args = p.parse_args()
  os.environ.setdefault("PALLAS_RING_CACHE_DIR", args.out)
  import jax
  import jax.numpy as jnp
  from pallas_ring import bench, tune
  from pallas_ring.attention import flash_attention
  from pallas_ring.kernels import tile_cache

  kind = jax.devices()[0].device_kind
  print(f"device {kind}, jax {jax.__version__}, cache {tile_cache.tuning_cache_path()}",
        flush=True)
  rows = []
  shapes = SHAPES[:2] if args.quick else SHAPES
  if args.shapes:
    wanted = [w.strip() for w in args.shapes.split(",")]
    unknown = set(wanted) - {s[0] for s in SHAPES}
    if unknown:
      sys.exit(f"--shapes: unknown {sorted(unknown)}; known: {[s[0] for s in SHAPES]}")
    shapes = [s for s in SHAPES if s[0] in wanted]
  for name, t, n, kh, h, b, mask_spec in shapes:
    t0 = time.time()
    mask, seg = tune.parse_mask(mask_spec, t)
    seg = None if seg is None else jnp.broadcast_to(seg, (b, t))
    q, k, v, do = bench.random_inputs(b, t, n, h, kv_heads=kh)

    def timed():
      f = lambda q_, k_, v_: flash_attention(q_, k_, v_, mask=mask, segment_ids=seg)
      fwd = bench.timeit(jax.jit(f), q, k, v)
      both = bench.timeit(bench.fwd_bwd(f), q, k, v, do)
      return fwd, both, bench.tile_note(t, h, mask, seg is not None, n=n, kv_heads=kh)

    before = timed()
    problem = tune.Problem("pallas_triton", t, n, kh, h, "bfloat16", mask_spec, batch=b)
    results = tune.tune(problem, iters=5, reps=3)
    tune.report(results, top=3)
    tile_cache.store(tune.winners(problem, results))
    after = timed()
    row = dict(shape=name, heuristic_fwd_ms=before[0] * 1e3, tuned_fwd_ms=after[0] * 1e3,
               heuristic_fwdbwd_ms=before[1] * 1e3, tuned_fwdbwd_ms=after[1] * 1e3,
               heuristic_tiles=before[2], tuned_tiles=after[2], tune_seconds=time.time() - t0)
    rows.append(row)
    print(json.dumps(row), flush=True)
  print(f"\n{'shape':22s} {'fwd heur':>9s} {'fwd tuned':>9s} {'x':>5s} {'f+b heur':>9s} "
        f"{'f+b tuned':>9s} {'x':>5s} {'tune s':>6s}")
  for r in rows:
    print(f"{r['shape']:22s} {r['heuristic_fwd_ms']:9.3f} {r['tuned_fwd_ms']:9.3f} "
          f"{r['heuristic_fwd_ms'] / r['tuned_fwd_ms']:5.2f} {r['heuristic_fwdbwd_ms']:9.3f} "
          f"{r['tuned_fwdbwd_ms']:9.3f} {r['heuristic_fwdbwd_ms'] / r['tuned_fwdbwd_ms']:5.2f} "
          f"{r['tune_seconds']:6.0f}")
  with open(os.path.join(args.out, "tune_rows.json"), "w") as f:
    json.dump(rows, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
