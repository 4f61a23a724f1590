"""dQ's error of each Mosaic GPU backward mode at long sequences, on one GPU: the fused kernel's
float32 adds and int32 fixed-point adds (``Variants.dq_accumulator``), and the reproducible pair,
against the float32 ``xla`` backend; also whether two runs give the same bits.

    PYTHONPATH=. python tools/dq_precision.py [T ...]   # default 4096 16384

B=1, N=4, H=128, causal, bf16 inputs (random normal, seeded), a random float32 cotangent;
relative error ||got - ref|| / ||ref|| of the (bf16) gradients. Measured: BENCHMARKS.md.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_ring import BlockSizes, flash_attention, masks
from pallas_ring.kernels.pallas_mosaic_gpu import Variants

MODES = {"fused float32": Variants(deterministic=False),
         "fused int32": Variants(deterministic=False, dq_accumulator="int32"),
         "pair": Variants(deterministic=True)}


def _grads(backend, variants=None):
  bs = BlockSizes(variants=variants) if variants else None
  loss = lambda q, k, v, do: jnp.sum(flash_attention(
      q, k, v, mask=masks.Causal(), backend=backend, block_sizes=bs).astype(jnp.float32) * do)
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def main(lengths):
  print(jax.__version__, jax.devices()[0].device_kind)
  rel = lambda a, b: float(jnp.linalg.norm((a.astype(jnp.float32) - b).ravel()) /
                           jnp.linalg.norm(b.ravel()))
  fns = {name: _grads("pallas_mosaic_gpu", v) for name, v in MODES.items()}
  ref_fn = _grads("xla")
  print("| T | mode | dq | dk | dv | same bits twice |")
  print("|---|---|---|---|---|---|")
  for t in lengths:
    rng = np.random.default_rng(t)
    q, k, v = (jnp.asarray(rng.standard_normal((1, t, 4, 128)), jnp.bfloat16) for _ in range(3))
    do = jnp.asarray(rng.standard_normal((1, t, 4, 128)), jnp.float32)
    ref = ref_fn(*(x.astype(jnp.float32) for x in (q, k, v)), do)
    for name, fn in fns.items():
      got, again = fn(q, k, v, do), fn(q, k, v, do)
      same = all(bool(jnp.array_equal(a, b)) for a, b in zip(got, again))
      errs = " | ".join(f"{rel(g, r):.2e}" for g, r in zip(got, ref))
      print(f"| {t} | {name} | {errs} | {same} |", flush=True)


if __name__ == "__main__":
  main([int(a) for a in sys.argv[1:]] or [4096, 16384])
