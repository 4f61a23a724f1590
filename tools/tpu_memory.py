"""TPU memory of pallas_ring's kernels against JAX's splash attention, compiled through libtpu.

No TPU is needed: both are compiled for one chip of a TPU topology from this host, and the
compiler's memory analysis is read. Usage::

    python tools/tpu_memory.py --topology v5e:2x2 --seq-len 32768 131072
"""

from __future__ import annotations

import argparse

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


def ours(topology, t, heads=8, kv_heads=8, head_dim=128, backward=False, block_sizes=None):
  """Compiled ``flash_attention`` (causal, bf16, B=1) for one chip: the XLA executable."""
  from pallas_ring import flash_attention, masks
  sharding, _ = _one_chip(topology)
  q = jax.ShapeDtypeStruct((1, t, heads, head_dim), jnp.bfloat16, sharding=sharding)
  kv = jax.ShapeDtypeStruct((1, t, kv_heads, head_dim), jnp.bfloat16, sharding=sharding)
  fwd = lambda q, k, v: flash_attention(q, k, v, mask=masks.Causal(), block_sizes=block_sizes)
  return _compile(_grad_of(fwd) if backward else fwd, q, kv, kv)


def splash(topology, t, heads=8, head_dim=128, backward=False, block=512):
  """Compiled splash attention (causal, bf16, B=1, 512 blocks everywhere) for one chip."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
  sharding, _ = _one_chip(topology)
  mask = sm.MultiHeadMask([sm.CausalMask((t, t)) for _ in range(heads)])
  bs = sk.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                     block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block,
                     block_kv_dq=block)
  kernel = sk.make_splash_mha_single_device(mask=mask, block_sizes=bs)
  s = jax.ShapeDtypeStruct((1, heads, t, head_dim), jnp.bfloat16, sharding=sharding)
  fwd = lambda q, k, v: jax.vmap(kernel)(q * head_dim ** -0.5, k, v)
  return _compile(_grad_of(fwd) if backward else fwd, s, s, s)


def temp_bytes(compiled) -> int:
  return compiled.memory_analysis().temp_size_in_bytes


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--topology", default="v5e:2x2")
  p.add_argument("--seq-len", type=int, nargs="+", default=[32768])
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--head-dim", type=int, default=128)
  args = p.parse_args()
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
