"""extra_q_slot (branch exp/q-slots): gradients against the xla backend and the two-slot kernel; dK/dV
bitwise equal to theirs. One H100: PYTHONPATH=. python tools/q_slots_check.py"""
import os, traceback
import jax, jax.numpy as jnp, numpy as np
OURS = os.environ.get("OURS", "pallas_mosaic_gpu")
from pallas_ring import BlockSizes, flash_attention, masks
from pallas_ring.kernels.pallas_mosaic_gpu import Variants

def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))

for name, mask, t, n, kh in (("full", masks.Full(), 2000, 4, 4), ("causal_gqa", masks.Causal(), 2048, 8, 2),
                             ("window", masks.Causal() & masks.SlidingWindow(300), 1536, 4, 1)):
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((2, t, n, 128)), jnp.bfloat16)
  k, v = (jnp.asarray(rng.standard_normal((2, t, kh, 128)), jnp.bfloat16) for _ in range(2))
  do = jnp.asarray(rng.standard_normal((2, t, n, 128)), jnp.float32)
  def grads(backend, **var):
    kw = dict(block_sizes=BlockSizes(variants=Variants(deterministic=False, **var))) if var else {}
    f = lambda q, k, v: flash_attention(q, k, v, mask=mask, backend=backend, **kw).astype(jnp.float32)
    out, vjp = jax.vjp(f, q, k, v)
    return vjp(do)
  try:
    ref = grads("xla")
    off = grads(OURS, extra_q_slot=False)
    on = grads(OURS, extra_q_slot=True)
    on2 = grads(OURS, extra_q_slot=True)
    print(name, "rel vs xla on:", [f"{rel(a, r):.2e}" for a, r in zip(on, ref)],
        "off:", [f"{rel(a, r):.2e}" for a, r in zip(off, ref)],
          "dK,dV bitwise on==off:", all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(on[1:], off[1:])),
          "dK,dV on==on:", all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(on[1:], on2[1:])))
  except Exception:
    traceback.print_exc()
