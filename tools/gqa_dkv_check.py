"""GQA backward on the GPU: time and compiled temporary memory of flash_attention fwd+bwd for a
Llama-shaped GQA problem (the Triton dK/dV pass accumulates per kv head).

  PYTHONPATH=. python3 tools/gqa_dkv_check.py
"""

from __future__ import annotations

import jax

from pallas_ring import masks
from pallas_ring.attention import flash_attention
from pallas_ring.bench import _fwd_bwd, _inputs, timeit

SHAPES = [("Llama GQA 32/8 T=8k", 8192, 32, 8), ("GQA 16/2 T=16k", 16384, 16, 2),
          ("MHA 16/16 T=16k", 16384, 16, 16)]


def main():
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
  from pallas_ring.kernels import pallas_triton
  shipped = pallas_triton.UNROLL_GROUP
  for unroll in (0, shipped):  # the group loop as a fori_loop, then as shipped (unrolled)
    jax.clear_caches()
    pallas_triton.UNROLL_GROUP = unroll
    print(f"UNROLL_GROUP={unroll}")
    run_shapes()
  pallas_triton.UNROLL_GROUP = shipped


def run_shapes():
  for name, t, n, kh in SHAPES:
    q, k, v, do = _inputs(1, t, n, 128, kv_heads=kh)
    f = lambda q_, k_, v_: flash_attention(q_, k_, v_, mask=masks.Causal())
    fn = _fwd_bwd(f)
    temp = fn.lower(q, k, v, do).compile().memory_analysis().temp_size_in_bytes
    secs = timeit(fn, q, k, v, do)
    print(f"{name:22s} fwd+bwd {secs * 1e3:8.3f} ms  compiled temporaries "
          f"{temp / 2**20:8.1f} MiB", flush=True)


if __name__ == "__main__":
  main()
