"""Times the ring's GPU schedule on all local GPUs (a diagnostic, not a benchmark), against one
GPU doing the same work, in the same run:

  shipped   the default schedule
  unroll    fully unrolled ring scan (``SequenceParallelConfig.scan_unroll``)

Usage (on a GPU machine): ``PYTHONPATH=. python tools/ring_diag.py shipped,unroll``
Environment: DIAG_SIZES (tokens per GPU, default 8192), DIAG_CASES (dense,zigzag,contig).

``python tools/ring_diag.py profile [DIR]`` instead prints the first GPU's device time per op of
each case's ring forward and forward+backward, and of one GPU doing the same work
(``mosaic_gpu_sweep.profile``).
"""

import os
import sys

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from pallas_ring import bench, masks
from pallas_ring.attention import flash_attention
from pallas_ring.config import SequenceParallelConfig
from pallas_ring.sharded import sharded_attention

CASES = {  # name: (layout, causal)
    "dense": ("contiguous", False), "zigzag": ("zigzag", True), "contig": ("contiguous", True)}


def _setup(tl):
  """``(mesh, (q, k, v, do) sharded along the sequence, one-GPU (q, k, v, do) of one device's
  dense work)`` at ``tl`` tokens per GPU."""
  r = jax.device_count()
  mesh = jax.make_mesh((r,), ("sp",), axis_types=(AxisType.Auto,))
  sh = NamedSharding(mesh, P(None, "sp"))
  q, k, v, do = (jax.device_put(x, sh) for x in bench.random_inputs(1, tl * r, 16, 128, seed=2))
  one = [jax.device_put(x, jax.devices()[0]) for x in (q[:, :tl], k, v, do[:, :tl])]
  return mesh, (q, k, v, do), one


def _sharded(mesh, case, unroll=1):
  layout, causal = CASES[case]
  cfg = SequenceParallelConfig(axis_name="sp", layout=layout, scan_unroll=unroll)
  mask = masks.Causal() if causal else None
  return lambda q_, k_, v_: sharded_attention(q_, k_, v_, mesh=mesh, config=cfg, mask=mask)


def profile(out_dir="/tmp/ring_trace"):
  """Device time per op of one GPU doing one device's dense work and of each DIAG_CASES ring,
  forward and forward+backward (profiler traces under ``out_dir``)."""
  from mosaic_gpu_sweep import profile as trace_ops  # (tools/ is on the path of a script here)
  cases = os.environ.get("DIAG_CASES", "dense").split(",")
  for tl in (int(x) for x in os.environ.get("DIAG_SIZES", "8192").split(",")):
    mesh, (q, k, v, do), one = _setup(tl)
    trace_ops(f"{tl}/GPU one GPU fwd", jax.jit(flash_attention), one[:3], f"{out_dir}/one_f")
    trace_ops(f"{tl}/GPU one GPU fwd+bwd", bench.fwd_bwd(flash_attention), one,
              f"{out_dir}/one_fb")
    for case in cases:
      f = _sharded(mesh, case)
      trace_ops(f"{tl}/GPU ring {case} fwd", jax.jit(f), (q, k, v), f"{out_dir}/{case}_f")
      trace_ops(f"{tl}/GPU ring {case} fwd+bwd", bench.fwd_bwd(f), (q, k, v, do),
                f"{out_dir}/{case}_fb")


def main(variants):
  r = jax.device_count()
  cases = os.environ.get("DIAG_CASES", "dense,zigzag,contig").split(",")
  for tl in (int(x) for x in os.environ.get("DIAG_SIZES", "8192").split(",")):
    mesh, (q, k, v, do), one_args = _setup(tl)
    one = bench.timeit(jax.jit(flash_attention), *one_args[:3], iters=5, reps=3)
    one_both = bench.timeit(bench.fwd_bwd(flash_attention), *one_args, iters=3, reps=3)
    print(f"{tl} tokens/GPU x {r}: one GPU, same work: fwd {one * 1e3:.3f} ms, fwd+bwd "
          f"{one_both * 1e3:.3f} ms", flush=True)
    for name in variants:
      for case in cases:
        f = _sharded(mesh, case, r if name == "unroll" else 1)
        fwd = bench.timeit(jax.jit(f), q, k, v, iters=5, reps=3)
        both = bench.timeit(bench.fwd_bwd(f), q, k, v, do, iters=3, reps=3)
        print(f"  {name:8s} {case:7s} fwd {fwd * 1e3:8.3f} ms  fwd+bwd {both * 1e3:8.3f} ms",
              flush=True)


if __name__ == "__main__":
  print(jax.__version__, jax.device_count(), jax.devices()[0].device_kind, flush=True)
  if sys.argv[1:2] == ["profile"]:
    profile(*sys.argv[2:])
  else:
    main(sys.argv[1].split(",") if len(sys.argv) > 1 else ["shipped"])
