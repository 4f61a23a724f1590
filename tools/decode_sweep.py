"""Decode on one GPU: ``bench.decode``'s caches with the cache split into other numbers of chunks
(``BlockSizes.kv_splits``) beside the automatic choice, device clock.

    PYTHONPATH=. python tools/decode_sweep.py [CASE_SUBSTRING]
    PYTHONPATH=.:tools python tools/decode_sweep.py profile TRACE_DIR

Prints one line per (cache, implementation, clock): milliseconds, GB/s of K/V read, % of HBM,
and the ratio to cuDNN and XLA. ``profile``: the GPU ops of one decode call (lengths traced, as
in generation) and their time, for a GQA cache and a Flax-sized MHA cache.
"""

from __future__ import annotations

import sys

import jax

from pallas_ring import bench, decode, kernels
from pallas_ring.config import BlockSizes


def main(only: str = "") -> None:
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
  impl = kernels.get("pallas_triton")  # (what "auto" decodes with on a GPU)
  # (and the cache of tools/generate_bench.py's LM: 16 heads of 128, a 32k prompt)
  caches = {**bench.DECODE_CACHES, "B=1 S=33k MHA 16": (1, 33024, 16, 16, 128, 1)}
  for case, (b, s, n, kh, h, t) in caches.items():
    if only not in case:
      continue
    block_kv = impl.default_block_sizes(h, "").block_kv
    auto = decode.num_splits(impl.decode_programs(False), b * kh, s, block_kv)
    print(f"{case}: automatic kv_splits={auto}", flush=True)
    extra = {f"ours kv_splits={p}": dict(block_sizes=BlockSizes(kv_splits=p))
             for p in (auto // 2, auto * 2) if p >= 1 and s % p == 0}
    for bk, warps, stages in ((128, 4, 3), (64, 4, 4), (128, 8, 3), (64, 4, 2), (32, 4, 4)):
      extra[f"ours triton kv={bk} w={warps} s={stages}"] = dict(
          backend="pallas_triton",
          block_sizes=BlockSizes(block_kv=bk, num_warps=warps, num_stages=stages))
    with bench.clock("device"):
      bench.decode({case: (b, s, n, kh, h, t)}, extra, log=lambda x: print(x, flush=True))


def profile(trace_dir: str) -> None:
  """``mosaic_gpu_sweep.profile`` of decode calls with traced lengths."""
  import jax.numpy as jnp
  from mosaic_gpu_sweep import profile as gpu_profile
  for name, (b, s, n, kh, h) in {"GQA 32/8 S=128k": (1, 131072, 32, 8, 128),
                                 "MHA 16 S=33k": (1, 33024, 16, 16, 128)}.items():
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (b, 1, n, h), jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, s, kh, h), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, s, kh, h), jnp.bfloat16)
    lengths = jnp.full((b,), s - 100, jnp.int32)
    f = jax.jit(lambda q, k, v, n_: decode.decode_attention(q, k, v, kv_lengths=n_))
    gpu_profile(name, f, (q, k, v, lengths), f"{trace_dir}/{name.replace(' ', '_')}")


if __name__ == "__main__":
  if sys.argv[1:2] == ["profile"]:
    profile(*sys.argv[2:])
  else:
    main(*sys.argv[1:])
