"""Memory and collective schedule of a sequence-parallel forward+backward on R GPUs, read on one
GPU (a diagnostic).

    python tools/ring_memory.py R TOKENS [intermediate] [STRATEGY] [U]

XLA's mock GPU topology (``jax_mock_gpu_topology="1xRx1"``: R hosts of one GPU, this process the
first) lets one GPU compile the program each of R GPUs would run; nothing executes. For the causal
zigzag forward+backward of ``bench.long_context`` (B=1, N=16, H=128, bf16, Mosaic GPU kernels),
prints the compiler's memory analysis per device (arguments, outputs, temporaries), the
collectives in the compiled program and whether each kind overlaps a kernel (an async ``-start``
... kernel ... ``-done`` sequence), and the bytes each device sends on paper
(``aot.bytes_moved``). STRATEGY is ``ring`` (default), ``all_gather``, ``ulysses`` or
``ulysses_ring`` (a ``(R / U, U)`` mesh, U = 2 by default). With the word ``intermediate``, k and
v are computed inside the program (``1.5 * k``, as a model's projections make them), so nothing
but the attention needs them after the forward.
"""

from __future__ import annotations

import os
import re
import sys
import time

STRATEGIES = ("ring", "all_gather", "ulysses", "ulysses_ring")
COLLECTIVES = ("collective-permute", "all-gather", "all-to-all", "reduce-scatter", "all-reduce")


def main(r, tokens, *words):
  # Sharded autotuning would wait for the mock topology's other processes.
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_shard_autotuning=false"
  import jax
  r, tokens = int(r), int(tokens)
  jax.config.update("jax_mock_gpu_topology", f"1x{r}x1")
  import jax.numpy as jnp
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
  from pallas_ring import SequenceParallelConfig, masks
  from pallas_ring.aot import bytes_moved, overlaps_kernels
  from pallas_ring.bench import fwd_bwd
  from pallas_ring.sharded import sharded_attention

  strategy = next((w for w in words if w in STRATEGIES), "ring")
  u = int(next((w for w in words if w.isdigit()), 2))
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}: {jax.device_count()} devices, "
        f"{jax.local_device_count()} local", flush=True)
  if strategy == "ulysses_ring":
    mesh = jax.make_mesh((r // u, u), ("sp", "u"), axis_types=(AxisType.Auto,) * 2)
    cfg = SequenceParallelConfig(axis_name="sp", ulysses_axis="u", layout="zigzag",
                                 strategy=strategy)
    tok, ring, uly = ("sp", "u"), r // u, u
  else:
    mesh = jax.make_mesh((r,), ("sp",), axis_types=(AxisType.Auto,))
    cfg = SequenceParallelConfig(axis_name="sp", layout="zigzag", strategy=strategy)
    tok, ring, uly = "sp", r, 1
  x = jax.ShapeDtypeStruct((1, tokens, 16, 128), jnp.bfloat16,
                           sharding=NamedSharding(mesh, P(None, tok)))
  inner = "intermediate" in words
  scaled = (lambda x: 1.5 * x) if inner else (lambda x: x)
  f = lambda q, k, v: sharded_attention(q, scaled(k), scaled(v), mesh=mesh, config=cfg,
                                        mask=masks.Causal())
  start = time.perf_counter()
  compiled = fwd_bwd(f).trace(x, x, x, x).lower().compile()
  mem = compiled.memory_analysis()
  sizes = (mem.argument_size_in_bytes, mem.output_size_in_bytes, mem.temp_size_in_bytes,
           mem.alias_size_in_bytes)
  arg, out, temp, alias = (n / 2**30 for n in sizes)
  what = f"{strategy} R={r}{f' U={u}' if uly > 1 else ''} {tokens} tokens"
  what += ", k, v intermediate" if inner else ""
  print(f"{what}, GiB per device: arguments {arg:.2f}, outputs {out:.2f}, temporaries "
        f"{temp:.2f}, aliased {alias:.2f}, in all {arg + out + temp - alias:.2f} "
        f"({time.perf_counter() - start:.0f} s)", flush=True)
  text = compiled.as_text()
  for kind in COLLECTIVES:
    n = len(re.findall(rf" {kind}(?:-start)?\(", text))
    if n:
      print(f"  {kind}: {n} in the program, overlapping a kernel: "
            f"{'yes' if overlaps_kernels(text, kind) else 'no'}", flush=True)
  sent = bytes_moved(strategy, seq_len=tokens, ring=ring, ulysses=uly, heads=16, kv_heads=16,
                     head_dim=128)
  print(f"  bytes each device sends (on paper): forward {sent[0] / 2**20:.1f} MiB, "
        f"forward+backward {sent[1] / 2**20:.1f} MiB", flush=True)


if __name__ == "__main__":
  main(*sys.argv[1:])
