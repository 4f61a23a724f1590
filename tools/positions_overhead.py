"""What explicit positions cost flash_attention on one device: the same call with default
positions (token indices: plans built ahead), the same values passed as ``q_positions`` /
``kv_positions`` (plans built on device), and offset positions (a ring shard's), forward+backward,
median ms (``bench.timeit``), bf16, N=K=16, H=128.

  PYTHONPATH=. python tools/positions_overhead.py --tokens 32768
"""

import argparse

import jax
import jax.numpy as jnp

from pallas_ring import flash_attention, masks
from pallas_ring.bench import fwd_bwd, timeit_interleaved


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--tokens", type=int, default=32768)
  t = p.parse_args().tokens
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v, do = (jax.random.normal(kk, (1, t, 16, 128), jnp.float32).astype(jnp.bfloat16)
                 for kk in keys)
  idx = jnp.arange(t, dtype=jnp.int32)
  for mask in (masks.SlidingWindow(1024), masks.ChunkedCausal(8192), masks.Causal()):
    calls = {}
    for name, pos in (("default", None), ("explicit", idx), ("offset", idx + t)):
      f = lambda q_, k_, v_, pos=pos: flash_attention(q_, k_, v_, mask=mask, q_positions=pos,
                                                      kv_positions=pos)
      calls[name] = (fwd_bwd(f), (q, k, v, do))
    res = timeit_interleaved(calls)
    print(f"{mask!s:34s} " + "  ".join(f"{n} {s * 1e3:7.3f} ms" for n, s in res.items()))


if __name__ == "__main__":
  main()
