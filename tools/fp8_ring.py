"""The ring on FP8 q, k, v over every local GPU: accuracy, and forward time against bfloat16.

    PYTHONPATH=. python tools/fp8_ring.py [TOKENS_PER_GPU] [--train]

First ``sharded_attention`` (ring, zigzag, causal) on ``quantize_fp8``'s operands against the
float32 xla backend on the same dequantized values (4096 tokens, N=4), forward. Then, at
TOKENS_PER_GPU (default 32768) per GPU, N=16, H=128, inputs sharded beforehand: the forward of
the ring (contiguous dense and zigzag causal) on bfloat16 against the same on FP8 (each step's
kernel in FP8, K/V sent as FP8 bytes), device clock, batches. ``--train``: forward+backward
instead, of ``sharded_attention(quantize=float8_e4m3fn)`` on the bfloat16 inputs (FP8 forward
steps, K/V sent as FP8 bytes both ways) against plain bfloat16.
"""

from __future__ import annotations

import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from pallas_ring import (SequenceParallelConfig, bench, flash_attention, layouts, masks,
                         quantize_fp8, sharded_attention)


def rel(got, ref):
  got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def _inputs(t, n, h, seed):
  ks = jax.random.split(jax.random.key(seed), 3)
  return [jax.random.normal(key, (1, t, n, h), jnp.float32) for key in ks]


def main(tokens, train=False):
  r = jax.device_count()
  print(jax.__version__, jax.devices()[0].device_kind, f"x{r}", flush=True)
  mesh = jax.make_mesh((r,), ("sp",), axis_types=(AxisType.Auto,))
  q, k, v = _inputs(4096, 4, 128, seed=1)
  (q8, qd), (k8, kd), (v8, vd) = (quantize_fp8(x) for x in (q, k, v))
  deq = [x.astype(jnp.float32) * d[:, None, :, None] for x, d in ((q8, qd), (k8, kd), (v8, vd))]
  cfg = SequenceParallelConfig(axis_name="sp", layout="zigzag")
  perm = lambda x: layouts.permute(x, "zigzag", r)
  out = jax.jit(lambda *a: sharded_attention(
      *(perm(x) for x in a[:3]), q_descale=a[3], k_descale=a[4], v_descale=a[5], mesh=mesh,
      config=cfg, mask=masks.Causal()))(q8, k8, v8, qd, kd, vd)
  ref = flash_attention(*deq, mask=masks.Causal(), backend="xla")
  print(f"check ring fp8 zigzag causal: {rel(layouts.unpermute(out, 'zigzag', r), ref):.2e}",
        flush=True)

  t = tokens * r
  q, k, v = _inputs(t, 16, 128, seed=2)
  (q8, qd), (k8, kd), (v8, vd) = (quantize_fp8(x) for x in (q, k, v))
  bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
  # the inputs sharded over the ring beforehand, as in training (not resharded inside the call)
  shard = lambda x: jax.device_put(x, NamedSharding(mesh, P(None, "sp")))
  bf, (q8, k8, v8) = [shard(x) for x in bf], [shard(x) for x in (q8, k8, v8)]
  for layout, causal in (("contiguous", False), ("zigzag", True)):
    cfg = SequenceParallelConfig(axis_name="sp", layout=layout)
    spec = masks.Causal() if causal else None

    def ring16(q, k, v, cfg=cfg, spec=spec):
      return sharded_attention(q, k, v, mesh=mesh, config=cfg, mask=spec)

    def ring8(q, k, v, qd, kd, vd, cfg=cfg, spec=spec):
      return sharded_attention(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, mesh=mesh,
                               config=cfg, mask=spec)

    def quantized(q, k, v, cfg=cfg, spec=spec):
      return sharded_attention(q, k, v, mesh=mesh, config=cfg, mask=spec,
                               quantize=jnp.float8_e4m3fn)

    if train:
      do = shard(jax.random.normal(jax.random.key(3), bf[0].shape, jnp.bfloat16))
      calls = {"bf16": (bench.fwd_bwd(ring16), (*bf, do)),
               "fp8": (bench.fwd_bwd(quantized), (*bf, do))}
    else:
      calls = {"bf16": (jax.jit(ring16), bf), "fp8": (jax.jit(ring8), (q8, k8, v8, qd, kd, vd))}
    with bench.clock("device"):
      samples = bench.interleaved_samples(calls, reps=6)
    med = {name: statistics.median(s) for name, s in samples.items()}
    for name, secs in med.items():
      print(f"{tokens} tokens/GPU x{r} {layout:10s} {'causal' if causal else 'dense':6s} "
            f"{'fwd+bwd' if train else 'fwd'} {name:5s} {secs * 1e3:8.3f} ms  "
            f"{med['bf16'] / secs:.3f}x bf16", flush=True)


if __name__ == "__main__":
  args = [a for a in sys.argv[1:] if a != "--train"]
  main(int(args[0]) if args else 32768, train="--train" in sys.argv)
