"""The FP8 forward on one Hopper GPU: accuracy, and speed against our bfloat16 forward and cuDNN.

    PYTHONPATH=. python tools/fp8_sweep.py [T ...] [--fp8=BK[,FIELD=VALUE...] ...] [--skip-check]

Accuracy first (T=2048, N=4): ours on ``quantize_fp8``'s q, k, v (float8_e4m3fn, descales per
batch row and kv head) against the float32 ``xla`` backend on the same dequantized inputs, for
each mask class and feature the kernel's FP8 mode touches, beside our bfloat16 forward's error
on bfloat16 inputs. Then, per T (default 16384), N=16, H=128, dense and causal: our bfloat16
forward, ours in FP8 (a row per ``--fp8``: its key tile and ``pallas_mosaic_gpu.Variants``
fields; default the tuned tiles), cuDNN bfloat16 and
cuDNN FP8 (JAX's private ``fused_attention_stablehlo.dot_product_attention(use_fp8=True)``,
per-tensor scales, FP8 output), timed interleaved on the device clock as sustained batches and
as lone calls. TFLOP/s count the visible pairs' ``4 N H`` flops.
"""

from __future__ import annotations

import ast
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_ring import BlockSizes, bench, masks, quantize_fp8
from pallas_ring.attention import flash_attention
from pallas_ring.kernels.pallas_mosaic_gpu import Variants

F8 = jnp.float8_e4m3fn


def rel(got, ref):
  got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def _inputs(b, t, n, kv, h, seed):
  ks = jax.random.split(jax.random.key(seed), 3)
  return [jax.random.normal(key, (b, t, heads, h), jnp.float32)
          for key, heads in zip(ks, (n, kv, kv))]


def check(t=2048, n=4):
  cases = {
      "dense": dict(), "causal": dict(mask=masks.Causal()),
      "window 256": dict(mask=masks.SlidingWindow(256)),
      "softcap 30": dict(mask=masks.Causal(), softcap=30.0),
      "documents": dict(segment_ids=jnp.repeat(jnp.arange(4), t // 4)[None]),
  }
  shapes = {"H=128": (n, n, 128), "GQA 4/1 H=128": (n, 1, 128), "H=64": (n, n, 64),
            "H=256": (n, n, 256)}
  for sname, (heads, kv, h) in shapes.items():
    q, k, v = _inputs(1, t, heads, kv, h, seed=1)
    (q8, qd), (k8, kd), (v8, vd) = (quantize_fp8(x, F8) for x in (q, k, v))
    deq = [x8.astype(jnp.float32) * d[:, None, :, None] for x8, d in
           ((q8, qd), (k8, kd), (v8, vd))]
    for cname, kw in cases.items():
      if sname != "H=128" and cname not in ("causal",):
        continue
      ref = flash_attention(*deq, backend="xla", **kw)
      got = jax.jit(lambda *a: flash_attention(*a[:3], q_descale=a[3], k_descale=a[4],
                                               v_descale=a[5], **kw))(q8, k8, v8, qd, kd, vd)
      bf = [x.astype(jnp.bfloat16) for x in deq]
      ours16 = jax.jit(lambda *a: flash_attention(*a, **kw))(*bf)
      err, err16 = rel(got, ref), rel(ours16, ref)
      print(f"check {sname:14s} {cname:11s} fp8 {err:.2e}  bf16 {err16:.2e}  "
            f"({got.dtype})", flush=True)
      assert err < 5e-2, (sname, cname, err)


def check_against_cudnn(t=2048, n=4, h=128):
  """Errors of ours and cuDNN's FP8 forward on the same per-tensor quantized inputs (cuDNN's
  output is FP8 too, scaled by 448 / the reference's amax and descaled here)."""
  q, k, v = _inputs(1, t, n, n, h, seed=3)
  scales = [jnp.max(jnp.abs(x)) / 448.0 for x in (q, k, v)]
  x8 = [(x / d).astype(F8) for x, d in zip((q, k, v), scales)]
  deq = [x.astype(jnp.float32) * d for x, d in zip(x8, scales)]
  for causal in (False, True):
    spec = masks.Causal() if causal else None
    ref = flash_attention(*deq, backend="xla", mask=spec)
    ours = flash_attention(*x8, q_descale=scales[0], k_descale=scales[1], v_descale=scales[2],
                           mask=spec)
    line = (f"check per-tensor H={h} {'causal' if causal else 'dense'}: "
            f"ours fp8 {rel(ours, ref):.2e}")
    try:
      run, fp8_params = _cudnn_fp8(causal)
      scale_o = 448.0 / jnp.max(jnp.abs(ref))
      params = fp8_params(descale_q=scales[0], descale_k=scales[1], descale_v=scales[2],
                          scale_o=scale_o, scale_s=256.0, descale_s=1 / 256.0)
      out = jax.jit(run)(*x8, params).astype(jnp.float32) / scale_o
      line += f", cudnn fp8 {rel(out, ref):.2e}"
    except Exception as e:  # (a private API: report and go on)
      line += f", cudnn fp8 unavailable: {type(e).__name__}: {str(e)[:200]}"
    print(line, flush=True)


def _cudnn_fp8(causal):
  """``(run, params)``: ``run(q8, k8, v8, params)``, cuDNN's FP8 attention through JAX's private
  API, and ``params(**scales)``, its ``fp8_params`` (each a float32 ``[1, 1, 1, 1]``; 1 unless
  given)."""
  from jax._src.cudnn import fused_attention_stablehlo as fa

  def run(q8, k8, v8, params):
    out = fa.dot_product_attention(
        q8, k8, v8, fp8_params=params, scale=q8.shape[-1] ** -0.5,
        mask_type=fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK, use_fp8=True)
    return out[0]

  def params(**scales):
    return {key: jnp.asarray(scales.get(key, 1.0), jnp.float32).reshape(1, 1, 1, 1)
            for key in fa.fp8_params_keys}

  return run, params


def _fp8_row(spec):
  """``(name, BlockSizes)`` of a ``--fp8=BK[,FIELD=VALUE...]`` row."""
  bk, *fields = spec.split(",")
  variants = {f: ast.literal_eval(x) for f, x in (a.split("=", 1) for a in fields)}
  return (f"ours fp8 {spec}",
          BlockSizes(block_kv=int(bk), variants=Variants(**variants) if variants else None))


def check_rows(rows, t=2048, n=4, h=128):
  """Each ``--fp8`` row's error against the dequantized inputs (causal)."""
  q, k, v = _inputs(1, t, n, n, h, seed=4)
  (q8, qd), (k8, kd), (v8, vd) = (quantize_fp8(x, F8) for x in (q, k, v))
  deq = [x8.astype(jnp.float32) * d[:, None, :, None] for x8, d in
         ((q8, qd), (k8, kd), (v8, vd))]
  ref = flash_attention(*deq, backend="xla", mask=masks.Causal())
  for name, block_sizes in rows:
    got = jax.jit(lambda *a: flash_attention(
        *a[:3], q_descale=a[3], k_descale=a[4], v_descale=a[5], mask=masks.Causal(),
        block_sizes=block_sizes))(q8, k8, v8, qd, kd, vd)
    print(f"check {name}: {rel(got, ref):.2e}", flush=True)


def time_shape(t, rows, n=16, h=128):
  q, k, v = _inputs(1, t, n, n, h, seed=2)
  (q8, qd), (k8, kd), (v8, vd) = (quantize_fp8(x, F8) for x in (q, k, v))
  bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
  for mask in ("dense", "causal"):
    causal = mask == "causal"
    spec = masks.Causal() if causal else None
    calls = {
        "ours bf16": (jax.jit(lambda q, k, v: flash_attention(q, k, v, mask=spec)), bf),
        "cudnn bf16": (jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="cudnn")), bf),
    }
    for name, block_sizes in rows:
      def fp8_call(q8, k8, v8, qd, kd, vd, block_sizes=block_sizes):
        return flash_attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                               mask=spec, block_sizes=block_sizes)
      calls[name] = (jax.jit(fp8_call), (q8, k8, v8, qd, kd, vd))
    try:
      run, fp8_params = _cudnn_fp8(causal)
      params = fp8_params(descale_q=qd.max(), descale_k=kd.max(), descale_v=vd.max())
      per_tensor = [jnp.clip(x / d.max(), -448, 448).astype(F8)
                    for x, d in ((q, qd), (k, kd), (v, vd))]
      f = jax.jit(run)
      f(*per_tensor, params).block_until_ready()
      calls["cudnn fp8"] = (f, (*per_tensor, params))
    except Exception as e:  # (a private API: report and go on)
      print(f"cudnn fp8 unavailable: {type(e).__name__}: {str(e)[:200]}", flush=True)
    flops = 4 * bench.visible_pairs(t, "causal" if causal else "full") * n * h
    for mode, kw in (("batch", {}), ("lone", dict(iters=1, min_batch_s=0.0))):
      with bench.clock("device"):
        samples = bench.interleaved_samples(calls, reps=8, **kw)
      med = {name: statistics.median(s) for name, s in samples.items()}
      for name, secs in med.items():
        print(f"T={t:6d} {mask:6s} {mode:5s} {name:34s} {secs * 1e3:8.3f} ms "
              f"{flops / secs / 1e12:7.1f} TFLOP/s  {med['ours bf16'] / secs:.3f}x ours bf16  "
              f"{med['cudnn bf16'] / secs:.3f}x cudnn bf16", flush=True)


def main(argv):
  print(jax.__version__, jax.devices()[0].device_kind, flush=True)
  rows = [_fp8_row(a[len("--fp8="):]) for a in argv if a.startswith("--fp8=")]
  rows = rows or [("ours fp8", None)]
  if "--skip-check" not in argv:
    check()
    check_against_cudnn()
  if rows[0][1] is not None:
    check_rows(rows)
  for t in [int(a) for a in argv if not a.startswith("--")] or [16384]:
    time_shape(t, rows)


if __name__ == "__main__":
  main(sys.argv[1:])
