"""Memory of the ring's compiled forward+backward on R GPUs, read on one GPU (a diagnostic).

    python tools/ring_memory.py R TOKENS [VARIANT ...] [intermediate]

XLA's mock GPU topology (``jax_mock_gpu_topology="1xRx1"``: R hosts of one GPU, this process the
first) lets one GPU compile the program each of R GPUs would run; nothing executes. For the causal
zigzag forward+backward of ``bench.long_context`` (B=1, N=16, H=128, bf16, Mosaic GPU kernels),
prints the compiler's memory analysis per device: arguments, outputs, temporaries. With the word
``intermediate``, k and v are computed inside the program (``1.5 * k``, as a model's projections
make them), so nothing but the ring needs them after the forward. Variants:

    main          the shipped ring: the backward's residuals are k and v, stacked again for its
                  sends
    kv_stacked    the backward reuses the forward's stacked K/V as its residual (shipped from
                  the tenth to the twelfth session)
"""

from __future__ import annotations

import os
import sys
import time


def _stacked_residual_ring():
  """``ring._ring`` whose backward reuses the forward's stacked K/V (a residual in place of k and
  v) instead of stacking them again."""
  import jax
  from pallas_ring import attention, ring

  def fwd(q, k, v, sinks, q_info, kv_info, fixed, st):
    out, (q_, _, _, *rest) = ring._ring_fwd(q, k, v, sinks, q_info, kv_info, fixed, st)
    return out, (q_, ring._local_kv(st, k, v), *rest)

  def bwd(st, res, cts):
    q, kv, *rest = res
    return ring._ring_bwd(st, (q, kv[0], kv[1], *rest), cts)

  f = jax.custom_vjp(lambda *a: fwd(*a)[0], nondiff_argnums=(7,))
  attention.defvjp_symbolic(f, fwd, bwd)
  return f


def main(r, tokens, *variants):
  # Sharded autotuning would wait for the mock topology's other processes.
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_shard_autotuning=false"
  import jax
  r, tokens = int(r), int(tokens)
  jax.config.update("jax_mock_gpu_topology", f"1x{r}x1")
  import jax.numpy as jnp
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
  from pallas_ring import SequenceParallelConfig, masks, ring
  from pallas_ring.bench import _fwd_bwd
  from pallas_ring.sharded import sharded_attention

  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}: {jax.device_count()} devices, "
        f"{jax.local_device_count()} local", flush=True)
  mesh = jax.make_mesh((r,), ("sp",), axis_types=(AxisType.Auto,))
  x = jax.ShapeDtypeStruct((1, tokens, 16, 128), jnp.bfloat16,
                           sharding=NamedSharding(mesh, P(None, "sp")))
  cfg = SequenceParallelConfig(axis_name="sp", layout="zigzag")
  inner = "intermediate" in variants
  variants = [w for w in variants if w != "intermediate"] or ["main", "kv_stacked"]
  scaled = (lambda x: 1.5 * x) if inner else (lambda x: x)
  f = lambda q, k, v: sharded_attention(q, scaled(k), scaled(v), mesh=mesh, config=cfg,
                                        mask=masks.Causal())
  shipped = ring._ring
  for variant in variants:
    ring._ring = shipped if variant == "main" else _stacked_residual_ring()
    try:
      start = time.perf_counter()
      mem = _fwd_bwd(f).trace(x, x, x, x).lower().compile().memory_analysis()
    finally:
      ring._ring = shipped
    sizes = (mem.argument_size_in_bytes, mem.output_size_in_bytes, mem.temp_size_in_bytes,
             mem.alias_size_in_bytes)
    arg, out, temp, alias = (n / 2**30 for n in sizes)
    what = f"{variant:12s} R={r} {tokens} tokens{', k, v intermediate' if inner else ''}"
    print(f"{what}, GiB per device: arguments {arg:.2f}, outputs {out:.2f}, temporaries "
          f"{temp:.2f}, aliased {alias:.2f}, in all {arg + out + temp - alias:.2f} "
          f"({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
  main(*sys.argv[1:])
