"""Times the reach-limited ring and the balanced packed-document placement on the present GPUs.

Forward+backward of ``sharded_attention`` (bf16, MHA 16/16, H=128, ``--tokens`` per GPU), median
wall clock, for SlidingWindow(1024), ChunkedCausal(8192) and Causal in the contiguous and zigzag
layouts, one GPU's own tokens' local work for the local masks (the issue-59 target: within
1.3x), and a long-tail pack of 12 documents in zigzag order against ``layouts.balance``.

  python tools/reach_timing.py --tokens 32768
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_ring import SequenceParallelConfig, flash_attention, layouts, masks, sharded_attention
from pallas_ring.auto import choose

LONG_TAIL = [700, 420, 260, 180, 130, 100, 80, 60, 40, 32, 28, 18]  # shares of the pack


def _median_ms(fn, *args, reps=10):
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return 1e3 * float(np.median(times))


def _fwd_bwd(f):
  return jax.jit(lambda q, k, v: jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)),
                                          argnums=(0, 1, 2))(q, k, v))


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--tokens", type=int, default=32768, help="tokens per GPU")
  args = p.parse_args()
  r = jax.device_count()
  mesh = jax.make_mesh((r,), ("sp",))
  t, n, h = args.tokens * r, 16, 128
  key = jax.random.key(0)
  q, k, v = (jax.random.normal(kk, (1, t, n, h), jnp.bfloat16) for kk in jax.random.split(key, 3))
  ql = q[:, :args.tokens]
  print(f"{jax.devices()[0].device_kind} x{r}, {args.tokens} tokens per GPU, fwd+bwd ms")
  for mask in (masks.SlidingWindow(1024), masks.ChunkedCausal(8192), masks.Causal()):
    local = _median_ms(_fwd_bwd(lambda *a: flash_attention(*a, mask=mask)), ql, ql, ql)
    for layout in ("contiguous", "zigzag"):
      cfg = SequenceParallelConfig(axis_name="sp", layout=layout)
      f = _fwd_bwd(lambda *a: sharded_attention(*a, mesh=mesh, config=cfg, mask=mask))
      with jax.set_mesh(mesh):
        ms = _median_ms(f, q, k, v)
      auto = choose(mask, seq_len=t, heads=n, kv_heads=n, head_dim=h, ring_size=r,
                    layout=layout, itemsize=2)
      print(f"{mask!s:40s} {layout:10s} ring {ms:8.2f}  local {local:7.2f}  ratio "
            f"{ms / local:5.2f}  reach {auto.reach}  auto -> {auto.strategy}")
  lengths = np.round(np.asarray(LONG_TAIL) * t / sum(LONG_TAIL)).astype(int)
  lengths[0] += t - lengths.sum()
  seg = np.repeat(np.arange(len(lengths)), lengths)[None].astype(np.int32)
  placement = layouts.balance(seg, r)
  for name, cfg, args_ in (
      ("zigzag", SequenceParallelConfig(axis_name="sp", layout="zigzag"),
       dict(segment_ids=layouts.permute(seg, "zigzag", r))),
      ("balanced", SequenceParallelConfig(axis_name="sp"),
       dict(segment_ids=placement.permute(seg), positions=jnp.asarray(placement.positions)))):
    f = _fwd_bwd(lambda *a: sharded_attention(*a, mesh=mesh, config=cfg, mask=masks.Causal(),
                                              **args_))
    with jax.set_mesh(mesh):
      print(f"long-tail pack, {name:9s} {_median_ms(f, q, k, v):8.2f}")
  print(f"balance imbalance {placement.imbalance[0]:.3f}")


if __name__ == "__main__":
  main()
