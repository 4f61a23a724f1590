"""The FP8 backward on one Hopper GPU: gradients' accuracy, and speed against our bfloat16
backward, the dequantized 16-bit kernels and cuDNN.

    PYTHONPATH=. python tools/fp8_backward_sweep.py [T ...] [--skip-check] [--skip-cudnn-check]
        [--gqa]

Accuracy first (T=2048, N=4, H=128 unless named): the gradients of ``flash_attention(q, k, v,
quantize=float8_e4m3fn)`` (the FP8 forward and backward, gradients straight through the
quantization) against those of the float32 ``xla`` backend on the same dequantized values, for a
random cotangent; beside them the same call with ``Variants(fp8_backward=False)`` (the backward on
dequantized values in the 16-bit kernels) and our bfloat16 call on the dequantized values rounded
to bfloat16; then ours and cuDNN's FP8 backward on the same FP8 values (``check_against_cudnn``:
cuDNN's errors up to one factor per gradient, its scale conventions being undocumented; beside
them the error of the exact gradients rounded to FP8). Then per T (default 8192 16384), N=16, H=128
(``--gqa``: 32/8), dense and causal: the backward alone (``jax.vjp``'s function of the saved
residuals) and forward+backward of ours in bfloat16, ours FP8 (``quantize=``), ours FP8 with the
dequantized backward, cuDNN bfloat16, and cuDNN FP8 (JAX's private ``use_fp8=True`` API; per-tensor
scales; its backward where it runs), interleaved on the device clock, batches and lone calls.
"""

from __future__ import annotations

import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_ring import BlockSizes, bench, masks, quantize_fp8
from pallas_ring.attention import flash_attention
from pallas_ring.kernels.pallas_mosaic_gpu import Variants
from fp8_sweep import _cudnn_fp8, rel  # (tools/: the FP8 forward's sweep)

F8 = jnp.float8_e4m3fn
DEQUANTIZED = BlockSizes(variants=Variants(fp8_backward=False))


def _inputs(b, t, n, kv, h, seed):
  ks = jax.random.split(jax.random.key(seed), 4)
  q, k, v = (jax.random.normal(key, (b, t, heads, h), jnp.float32)
             for key, heads in zip(ks, (n, kv, kv)))
  return q, k, v, jax.random.normal(ks[3], (b, t, n, h), jnp.float32)


def _grads(f, args, g):
  out, vjp = jax.vjp(f, *args)
  return vjp(g.astype(out.dtype))


def check(t=2048, n=4):
  cases = {"dense": dict(), "causal": dict(mask=masks.Causal()),
           "window 256": dict(mask=masks.SlidingWindow(256)),
           "softcap 30": dict(mask=masks.Causal(), softcap=30.0),
           "documents": dict(segment_ids=jnp.repeat(jnp.arange(4), t // 4)[None]),
           "alibi": dict(mask=masks.Causal(), alibi_slopes=jnp.linspace(0.1, 0.8, n))}
  shapes = {"H=128": (n, n, 128), "GQA 4/1 H=128": (n, 1, 128), "H=64": (n, n, 64)}
  for sname, (heads, kv, h) in shapes.items():
    q, k, v, g = _inputs(1, t, heads, kv, h, seed=1)
    deq = [x8.astype(jnp.float32) * d[:, None, :, None]
           for x8, d in (quantize_fp8(x, F8) for x in (q, k, v))]
    for cname, kw in cases.items():
      if sname != "H=128" and cname != "causal":
        continue
      ref = _grads(lambda *a: flash_attention(*a, backend="xla", **kw), deq, g)
      bf = [x.astype(jnp.bfloat16) for x in deq]
      rows = {
          "fp8": jax.jit(lambda *a: _grads(lambda *x: flash_attention(*x, quantize=F8, **kw),
                                           a[:3], a[3]))(*bf, g),
          "fp8 dequantized bwd": jax.jit(lambda *a: _grads(
              lambda *x: flash_attention(*x, quantize=F8, block_sizes=DEQUANTIZED, **kw),
              a[:3], a[3]))(*bf, g),
          "bf16": jax.jit(lambda *a: _grads(lambda *x: flash_attention(*x, **kw),
                                            a[:3], a[3]))(*bf, g),
      }
      errs = "  ".join(f"{name} " + "/".join(f"{rel(x, r):.2e}" for x, r in zip(got, ref))
                       for name, got in rows.items())
      print(f"check {sname:14s} {cname:11s} dq/dk/dv: {errs}", flush=True)
      assert max(rel(x, r) for x, r in zip(rows["fp8"], ref)) < 0.15, (sname, cname)


def _exact_fp8(x):
  """``(x8, s)``: ``x`` quantized to e4m3 with one power-of-two scale ``s`` and one entry of
  every batch row and head set to the largest value, so that per-head and per-tensor
  quantization of ``x8 * s`` (exact in bfloat16) both give back ``x8``."""
  s = 2.0 ** np.ceil(np.log2(float(jnp.max(jnp.abs(x))) / 448.0))
  x8 = jnp.clip(x / s, -448.0, 448.0).astype(F8).at[:, 0, :, 0].set(448.0)
  return x8, s


def _fitted(x, r):
  """``x``'s relative error against ``r`` after the best scalar factor (least squares):
  ``sqrt(1 - cos^2)`` of their angle."""
  x, r = (np.asarray(a, np.float64).ravel() for a in (x, r))
  cos = x @ r / max(np.linalg.norm(x) * np.linalg.norm(r), 1e-300)
  return float(np.sqrt(max(1.0 - cos * cos, 0.0)))


def _fp8_floor(r):
  """The relative error of ``r`` rounded to e4m3 with one scale filling its range: about what a
  backward that returns FP8 gradients (as cuDNN's does) cannot go below."""
  s = 448.0 / float(jnp.max(jnp.abs(r)))
  return rel((r * s).astype(F8).astype(jnp.float32) / s, r)


def check_against_cudnn(t=2048, n=4, h=128):
  """Gradient errors of ours and of cuDNN's FP8 backward on the same FP8 values (per-tensor
  power-of-two scales, exact in both) against the float32 xla backend.

  cuDNN returns FP8 gradients whose scale conventions (``scale_dQ`` ... ``scale_dP``) are
  undocumented and did not follow its amaxes, so its errors are measured up to one factor per
  gradient (``_fitted``), with each gradient's output scale set to fill 3/4 of FP8's range
  (from the reference's amax and the factor a call shows) and ``scale_dP`` the best of five
  around ``448 / amax_dP``: cuDNN near the best scales a calibration could give. Beside them
  ``_fp8_floor``, about the least error of a gradient returned in FP8."""
  q, k, v, g = _inputs(1, t, n, n, h, seed=5)
  (q8, sq), (k8, sk), (v8, sv), (g8, sg) = map(_exact_fp8, (q, k, v, g))
  deq = [x8.astype(jnp.float32) * s for x8, s in ((q8, sq), (k8, sk), (v8, sv))]
  gd = g8.astype(jnp.float32) * sg
  for causal in (False, True):
    spec = masks.Causal() if causal else None
    out_ref, ref_vjp = jax.vjp(lambda *a: flash_attention(*a, backend="xla", mask=spec), *deq)
    ref = ref_vjp(gd)
    ours = jax.jit(lambda *a: _grads(lambda *x: flash_attention(*x, quantize=F8, mask=spec),
                                     a[:3], a[3]))(*[x.astype(jnp.bfloat16) for x in deq], gd)
    scale_o = 448.0 / float(jnp.max(jnp.abs(out_ref)))
    run, fp8_params = _cudnn_fp8(causal)
    bwd = jax.jit(lambda f, g: f(g))

    def cudnn(scale_d, scale_dp):
      """cuDNN's FP8 gradients (float32 values of its FP8 outputs) and amax_dP."""
      params = fp8_params(descale_q=sq, descale_k=sk, descale_v=sv, descale_dO=sg,
                          scale_s=256.0, descale_s=1 / 256.0, scale_o=scale_o,
                          descale_o=1 / scale_o, scale_dP=scale_dp, descale_dP=1 / scale_dp,
                          scale_dQ=scale_d[0], scale_dK=scale_d[1], scale_dV=scale_d[2])
      _, vjp = jax.vjp(run, q8, k8, v8, params)
      *grads, dparams = bwd(vjp, g8)
      return [x.astype(jnp.float32) for x in grads], float(jnp.max(dparams["amax_dP"]))

    def at_range(scale_dp):
      """Each gradient's fitted error with its output scale set to fill 3/4 of FP8's range
      (three calls, each reading the factor of the one before)."""
      scale_d = [1.0, 1.0, 1.0]
      for _ in range(3):
        grads, _ = cudnn(scale_d, scale_dp)
        for i, (x, r) in enumerate(zip(grads, ref)):
          top = float(jnp.max(jnp.abs(x)))
          if not top < 448.0:  # saturated (or not finite): no factor to read
            scale_d[i] /= 16.0
          else:  # x = c * scale * r
            c = float(jnp.vdot(x, r) / jnp.vdot(r, r)) / scale_d[i]
            scale_d[i] = 336.0 / (abs(c) * float(jnp.max(jnp.abs(r)))) if c else 1e3 * scale_d[i]
      grads, _ = cudnn(scale_d, scale_dp)
      errors = [_fitted(x, r) for x, r in zip(grads, ref)]
      return errors if all(np.isfinite(errors)) else [np.inf] * 3

    try:
      _, amax_dp = cudnn((1.0, 1.0, 1.0), 1.0)
      base = 448.0 / amax_dp if amax_dp > 0 else 1.0
      theirs = min((at_range(base * f) for f in (1 / 64, 1 / 8, 1, 8, 64)), key=sum)
      line = "cudnn fp8 (fitted) " + "/".join(f"{e:.2e}" for e in theirs)
    except Exception as e:  # (a private API: report and go on)
      line = f"cudnn fp8 unavailable: {type(e).__name__}: {str(e)[:300]}"
    print(f"check per-tensor H={h} {'causal' if causal else 'dense'} dq/dk/dv: ours fp8 "
          + "/".join(f"{rel(x, r):.2e}" for x, r in zip(ours, ref)) + f" (fitted "
          + "/".join(f"{_fitted(x, r):.2e}" for x, r in zip(ours, ref)) + f"), {line}, "
          + "FP8 rounding of the exact gradients " + "/".join(f"{_fp8_floor(r):.2e}" for r in ref),
          flush=True)


def time_shape(t, n=16, kv=16, h=128):
  q, k, v, g = _inputs(1, t, n, kv, h, seed=2)
  bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
  g16 = g.astype(jnp.bfloat16)
  for mask in ("dense", "causal"):
    causal = mask == "causal"
    spec = masks.Causal() if causal else None
    fns = {
        "ours bf16": lambda q, k, v: flash_attention(q, k, v, mask=spec),
        "ours fp8": lambda q, k, v: flash_attention(q, k, v, mask=spec, quantize=F8),
        "ours fp8, dequantized bwd": lambda q, k, v: flash_attention(
            q, k, v, mask=spec, quantize=F8, block_sizes=DEQUANTIZED),
        "cudnn bf16": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="cudnn"),
    }
    calls = {}
    for name, f in fns.items():
      _, vjp = jax.jit(lambda *a, f=f: jax.vjp(f, *a))(*bf)
      calls[f"{name} bwd"] = (jax.jit(lambda fn, g: fn(g)), (vjp, g16))
      if "dequantized" not in name:
        calls[f"{name} fwd+bwd"] = (jax.jit(lambda *a, f=f: _grads(f, a[:3], a[3])),
                                    (*bf, g16))
    scales = [jnp.max(jnp.abs(x)) / 448.0 for x in (q, k, v)]
    per_tensor = [(x / d).astype(F8) for x, d in zip((q, k, v), scales)]
    try:
      run, fp8_params = _cudnn_fp8(causal)
      params = fp8_params(descale_q=scales[0], descale_k=scales[1], descale_v=scales[2])
      fwd = lambda q8, k8, v8: run(q8, k8, v8, params)
      out, vjp = jax.jit(lambda *a: jax.vjp(fwd, *a))(*per_tensor)
      g8 = (g / jnp.max(jnp.abs(g)) * 448.0).astype(F8)
      jax.block_until_ready(jax.jit(lambda fn, g: fn(g))(vjp, g8))
      calls["cudnn fp8 bwd"] = (jax.jit(lambda fn, g: fn(g)), (vjp, g8))
      calls["cudnn fp8 fwd+bwd"] = (jax.jit(lambda *a: jax.vjp(fwd, *a[:3])[1](a[3])),
                                    (*per_tensor, g8))
    except Exception as e:  # (a private API: report and go on)
      print(f"cudnn fp8 backward unavailable: {type(e).__name__}: {str(e)[:300]}", flush=True)
    flops = 2.5 * 4 * bench.visible_pairs(t, "causal" if causal else "full") * n * h
    for mode, kw in (("batch", {}), ("lone", dict(iters=1, min_batch_s=0.0))):
      with bench.clock("device"):
        samples = bench.interleaved_samples(calls, reps=8, **kw)
      med = {name: statistics.median(s) for name, s in samples.items()}
      for name, secs in med.items():
        part = name.rsplit(" ", 1)[1]
        base = med[f"ours bf16 {part}"]
        cudnn = med[f"cudnn bf16 {part}"]
        tflops = f"{flops / secs / 1e12:7.1f} TFLOP/s" if part == "bwd" else " " * 15
        print(f"T={t:6d} N={n}/{kv} {mask:6s} {mode:5s} {name:34s} {secs * 1e3:8.3f} ms "
              f"{tflops}  {base / secs:.3f}x ours bf16  {cudnn / secs:.3f}x cudnn bf16",
              flush=True)


def main(argv):
  print(jax.__version__, jax.devices()[0].device_kind, flush=True)
  if "--skip-check" not in argv:
    check()
  if "--skip-cudnn-check" not in argv:
    check_against_cudnn()
  heads = (32, 8) if "--gqa" in argv else (16, 16)
  for t in [int(a) for a in argv if not a.startswith("--")] or [8192, 16384]:
    time_shape(t, *heads)


if __name__ == "__main__":
  main(sys.argv[1:])
