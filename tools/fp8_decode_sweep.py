"""An FP8 KV cache in decode on one GPU: ours reading the cache in FP8 against our bfloat16 cache
and cuDNN's, device clock.

    PYTHONPATH=. python tools/fp8_decode_sweep.py [ROW ...]

For each of ``bench.DECODE_CACHES`` (T=1 rows): the error of the FP8 cache's output against the
bfloat16 cache's and the float32 reference of the dequantized cache, then ``decode_attention``
on the bfloat16 cache, on the FP8 cache (``quantize_fp8``, per batch row and kv head) and cuDNN
(``jax.nn.dot_product_attention``) on the bfloat16 cache, timed interleaved as sustained batches
and as lone calls. Prints milliseconds, GB/s of the cache bytes read and the ratio to cuDNN.
Each ``ROW`` (``FIELD=VALUE,...`` of ``BlockSizes`` fields, and ``per_sm=N``: the ``kv_splits``
that fill N programs per SM, as ``decode.num_splits`` picks them for the row's ``block_kv``,
default 128) adds a row of ours on the FP8 cache.
"""

from __future__ import annotations

import ast
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_ring import BlockSizes, bench, decode, decode_attention, quantize_fp8


def rel(got, ref):
  got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def block_sizes(row: str, b: int, s: int, kh: int) -> BlockSizes:
  """``row``'s ``BlockSizes``, its ``per_sm`` turned into ``kv_splits`` for this cache."""
  fields = {f: ast.literal_eval(x) for f, x in (a.split("=") for a in row.split(","))}
  per_sm = fields.pop("per_sm", None)
  if per_sm is not None:
    sms = int(getattr(jax.devices()[0], "core_count", 0) or 132)
    fields["kv_splits"] = decode.num_splits(per_sm * sms, b * kh, s, fields.get("block_kv", 128))
  return BlockSizes(**fields)


def main(rows):
  print(jax.__version__, jax.devices()[0].device_kind, flush=True)
  for case, (b, s, n, kh, h, t) in bench.DECODE_CACHES.items():
    if t != 1:
      continue
    keys = jax.random.split(jax.random.key(5), 3)
    # (drawn in float32: bfloat16 draws have truncated tails and a mean of -0.01, whose
    # rounding bias in FP8 dominates an output averaged over 128k random values)
    q, k, v = (jax.random.normal(key, shape).astype(jnp.bfloat16) for key, shape in zip(
        keys, ((b, t, n, h), (b, s, kh, h), (b, s, kh, h))))
    (k8, kd), (v8, vd) = quantize_fp8(k), quantize_fp8(v)
    ours16 = jax.jit(lambda q_, k_, v_: decode_attention(q_, k_, v_))
    ours8 = jax.jit(lambda q_, k_, v_, kd_, vd_: decode_attention(q_, k_, v_, k_descale=kd_,
                                                                  v_descale=vd_))
    cudnn = jax.jit(lambda q_, k_, v_: jax.nn.dot_product_attention(q_, k_, v_,
                                                                    implementation="cudnn"))
    deq = [x.astype(jnp.float32) * d[:, None, :, None] for x, d in ((k8, kd), (v8, vd))]
    ref8 = decode_attention(q.astype(jnp.float32), *deq, backend="xla")
    ref16 = decode_attention(q.astype(jnp.float32), k.astype(jnp.float32),
                             v.astype(jnp.float32), backend="xla")
    got8, got16 = ours8(q, k8, v8, kd, vd), ours16(q, k, v)
    print(f"{case}: fp8 cache vs its dequantized reference {rel(got8, ref8):.2e}, bf16 cache vs "
          f"its reference {rel(got16, ref16):.2e}, the two references {rel(ref8, ref16):.2e} "
          f"(quantized k {rel(deq[0], k):.2e}, v {rel(deq[1], v):.2e})", flush=True)
    calls = {"cudnn bf16 cache": (cudnn, (q, k, v)), "ours bf16 cache": (ours16, (q, k, v)),
             "ours fp8 cache": (ours8, (q, k8, v8, kd, vd))}
    for row in rows:
      calls[f"ours fp8 cache {row}"] = (jax.jit(
          lambda q_, k_, v_, kd_, vd_, bs=block_sizes(row, b, s, kh): decode_attention(
              q_, k_, v_, k_descale=kd_, v_descale=vd_, block_sizes=bs)), (q, k8, v8, kd, vd))
    for mode, kw in (("batch", {}), ("lone", dict(iters=1, min_batch_s=0.0))):
      with bench.clock("device"):
        samples = bench.interleaved_samples(calls, reps=8, **kw)
      med = {name: statistics.median(x) for name, x in samples.items()}
      for name, secs in med.items():
        nbytes = 2 * b * s * kh * h * (1 if "fp8" in name else 2)
        print(f"  {mode:5s} {name:18s} {secs * 1e6:9.1f} us {nbytes / secs / 1e9:7.0f} GB/s "
              f"{med['cudnn bf16 cache'] / secs:.2f}x cuDNN", flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
