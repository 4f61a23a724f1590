"""The ring's forward sending on the buffer each step received, against unpacking and packing
its K/V again (``RingVariants.forward_received``), on all local GPUs.

    NCCL_NVLS_ENABLE=0 PYTHONPATH=. python tools/ring_sends.py [TOKENS_PER_GPU,...]

``sharded_attention`` (ring, MHA 16/16, H=128, bf16) dense contiguous and causal zigzag at each
TOKENS_PER_GPU (default 8192,32768), inputs sharded beforehand, forward and forward+backward,
both settings interleaved on the device clock: median of sustained batches and of lone calls.
"""

from __future__ import annotations

import statistics
import sys

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from pallas_ring import SequenceParallelConfig, masks, sharded_attention, timing
from pallas_ring.halo import RingVariants


def main(tokens):
  r = jax.device_count()
  print(f"{jax.devices()[0].device_kind} x{r}, jax {jax.__version__}", flush=True)
  mesh = jax.make_mesh((r,), ("sp",), axis_types=(AxisType.Auto,))
  shard = NamedSharding(mesh, P(None, "sp"))
  for tl in tokens:
    args = [jax.device_put(x, shard) for x in timing.random_inputs(1, tl * r, 16, 128, seed=3)]
    for layout, mask in (("contiguous", None), ("zigzag", masks.Causal())):
      calls = {}
      for received in (True, False):
        cfg = SequenceParallelConfig(axis_name="sp", layout=layout,
                                     ring_variants=RingVariants(forward_received=received))
        f = lambda q, k, v, cfg=cfg: sharded_attention(q, k, v, mesh=mesh, config=cfg,
                                                       mask=mask)
        calls[f"fwd received={received}"] = (jax.jit(f), args[:3])
        calls[f"fwd+bwd received={received}"] = (timing.fwd_bwd(f), args)
      for mode, kw in (("batch", {}), ("lone", dict(iters=1, min_batch_s=0.0))):
        with timing.clock("device"):
          samples = timing.interleaved_samples(calls, reps=6, **kw)
        med = {name: statistics.median(s) * 1e3 for name, s in samples.items()}
        for name, ms in med.items():
          base = med[name.replace("True", "False")]
          print(f"{tl}/GPU x{r} {layout:10s} {mode:5s} {name:24s} {ms:8.3f} ms  "
                f"{base / ms:.3f}x received=False", flush=True)


if __name__ == "__main__":
  main(tuple(int(t) for t in (sys.argv[1] if len(sys.argv) > 1 else "8192,32768").split(",")))
