"""TPU memory and compile time of pallas_ring's kernels against JAX's splash attention, compiled
through libtpu.

No TPU is needed: both are compiled for one chip of a TPU topology from this host, and the
compiler's memory analysis and the wall time of each compile are read. Usage::

    python tools/tpu_memory.py --topology v5e:2x2 --seq-len 32768 131072
    python tools/tpu_memory.py --compile-time   # the notebooks' and bench's shapes

Splash has no grouped-query form here: for K < N it is compiled with K = N (kv heads repeated,
as MaxText feeds it).
"""

from __future__ import annotations

import argparse
import time

import pallas_ring  # noqa: F401  (first: it quiets libtpu before JAX loads it)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


def _one_chip(topology: str):
  from jax.experimental import topologies
  topo = topologies.get_topology_desc(topology_name=topology, platform="tpu")
  mesh = jax.sharding.Mesh(np.array(topo.devices[:1]), ("x",))
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()), topo.devices[0]


def _compile(fn, *structs):
  return jax.jit(fn).trace(*structs).lower(lowering_platforms=("tpu",)).compile()


def _grad_of(fwd):
  return jax.grad(lambda *a: jnp.sum(fwd(*a).astype(jnp.float32)), argnums=(0, 1, 2))


def ours(topology, t, heads=8, kv_heads=8, head_dim=128, backward=False, block_sizes=None,
         batch=1, dtype=jnp.bfloat16):
  """Compiled ``flash_attention`` (causal) for one chip: the XLA executable. Tiles and VMEM
  limits follow the topology's chip (the mesh is set while tracing)."""
  from pallas_ring import flash_attention, masks
  sharding, _ = _one_chip(topology)
  q = jax.ShapeDtypeStruct((batch, t, heads, head_dim), dtype, sharding=sharding)
  kv = jax.ShapeDtypeStruct((batch, t, kv_heads, head_dim), dtype, sharding=sharding)
  fwd = lambda q, k, v: flash_attention(q, k, v, mask=masks.Causal(), block_sizes=block_sizes)
  with jax.set_mesh(sharding.mesh):
    return _compile(_grad_of(fwd) if backward else fwd, q, kv, kv)


def splash(topology, t, heads=8, head_dim=128, backward=False, block=512, batch=1,
           dtype=jnp.bfloat16):
  """Compiled splash attention (causal, 512 blocks everywhere) for one chip."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
  sharding, _ = _one_chip(topology)
  block = min(block, t)
  mask = sm.MultiHeadMask([sm.CausalMask((t, t)) for _ in range(heads)])
  bs = sk.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                     block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block,
                     block_kv_dq=block)
  kernel = sk.make_splash_mha_single_device(mask=mask, block_sizes=bs)
  s = jax.ShapeDtypeStruct((batch, heads, t, head_dim), dtype, sharding=sharding)
  fwd = lambda q, k, v: jax.vmap(kernel)(q * head_dim ** -0.5, k, v)
  return _compile(_grad_of(fwd) if backward else fwd, s, s, s)


# The shapes whose compile time issue 42 sets targets for: (B, T, N, K, H, dtype), causal.
COMPILE_SHAPES = {
    "notebook 01 (f32)": (1, 4096, 8, 2, 128, jnp.float32),
    "notebook 03 LM (f32)": (1, 1024, 4, 4, 64, jnp.float32),
    "v5e anchor N=K=8 T=8k": (1, 8192, 8, 8, 128, jnp.bfloat16),
    "bench Llama GQA 32/8 T=8k": (1, 8192, 32, 8, 128, jnp.bfloat16),
    "bench H=256 T=8k": (1, 8192, 16, 16, 256, jnp.bfloat16),
    "bench H=64 B=8 T=2k": (8, 2048, 16, 16, 64, jnp.bfloat16),
}


def timed(make):
  """``(seconds, temporaries in bytes)`` of one compile."""
  start = time.perf_counter()
  compiled = make()
  return time.perf_counter() - start, temp_bytes(compiled)


def compile_times(topology, rounds=3, shapes=None):
  """Prints compile seconds (median of ``rounds``, splash and ours interleaved) and
  temporaries of ours and splash per shape and pass (``shapes``: names of ``COMPILE_SHAPES``,
  default all)."""
  timed(lambda: splash(topology, 512, 1))  # (libtpu's first compile pays its start-up)
  print(f"{'shape':28s} {'pass':>8s} {'splash s':>8s} {'ours s':>7s} {'ratio':>6s} "
        f"{'splash MiB':>10s} {'ours MiB':>9s}")
  median = lambda runs: (float(np.median([r[0] for r in runs])), runs[0][1])
  for name, (b, t, n, k, h, dt) in COMPILE_SHAPES.items():
    if shapes and name not in shapes:
      continue
    for backward in (False, True):
      runs_s, runs_o = [], []
      for _ in range(rounds):
        runs_s.append(timed(lambda: splash(topology, t, n, h, backward, batch=b, dtype=dt)))
        runs_o.append(timed(lambda: ours(topology, t, n, k, h, backward, batch=b, dtype=dt)))
      (s_sec, s_mem), (o_sec, o_mem) = median(runs_s), median(runs_o)
      print(f"{name:28s} {'fwd+bwd' if backward else 'fwd':>8s} {s_sec:8.1f} {o_sec:7.1f} "
            f"{o_sec / s_sec:6.2f} {s_mem / 2**20:10.1f} {o_mem / 2**20:9.1f}", flush=True)


def temp_bytes(compiled) -> int:
  return compiled.memory_analysis().temp_size_in_bytes


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--topology", default="v5e:2x2")
  p.add_argument("--seq-len", type=int, nargs="+", default=[32768])
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--compile-time", action="store_true",
                 help="compile seconds, ours and splash, for the notebooks' and bench's shapes")
  p.add_argument("--shapes", nargs="+", choices=list(COMPILE_SHAPES),
                 help="with --compile-time: only these shapes")
  p.add_argument("--rounds", type=int, default=3, help="with --compile-time: compiles per median")
  args = p.parse_args()
  if args.compile_time:
    compile_times(args.topology, args.rounds, args.shapes)
    return
  mib = lambda x: f"{x / 2**20:9.1f}"
  print(f"{'T':>8s} {'pass':>9s} {'splash MiB':>10s} {'ours MiB':>9s} {'ratio':>6s}")
  for t in args.seq_len:
    for backward in (False, True):
      s = temp_bytes(splash(args.topology, t, args.heads, args.head_dim, backward))
      try:
        o = temp_bytes(ours(args.topology, t, args.heads, args.heads, args.head_dim, backward))
        ratio = f"{o / max(s, 1):6.2f}"
        o = mib(o)
      except Exception as e:  # noqa: BLE001 - report, e.g. SMEM exhaustion
        o, ratio = "fails", str(e).splitlines()[0][:60]
      print(f"{t:8d} {'fwd+bwd' if backward else 'fwd':>9s} {mib(s):>10s} {o:>9s} {ratio}")


if __name__ == "__main__":
  main()
