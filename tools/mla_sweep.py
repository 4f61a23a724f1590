"""MLA head dims (q/k 192, v 128) on one GPU: ours against what JAX users run today.

    PYTHONPATH=. python tools/mla_sweep.py [T ...] [FIELD=VALUE ...] [--hv=HV]
    PYTHONPATH=. python tools/mla_sweep.py --parts [T ...]  # device time per kernel

``jax.nn.dot_product_attention`` refuses a v head dim other than q's, so users zero-pad v to 192,
run cuDNN and slice the output: that is the baseline ("cudnn v padded"). Beside it: ours at
192 / 128, and ours and cuDNN at H = Hv = 128 (the rate the MLA call is judged against). Each
shape: correctness of ours against the float32 xla backend, then forward and forward+backward
timed interleaved on the device clock (``bench.clock("device")``), as sustained batches and as
lone synchronized calls. TFLOP/s count the visible pairs' matmul work: forward
``2 pairs N (H + Hv)``, forward+backward 3.5 times that. ``FIELD=VALUE`` arguments (Python
literals) add a row of ours at 192 / 128 with those ``pallas_mosaic_gpu.Variants`` fields;
``--hv=HV`` runs v at HV instead of 128 (192: plain H=192). ``--parts``: the device time of
each kernel (forward, dQ, dK/dV) of one forward+backward at 192/128 and at 128/128, from a
profiler trace (``mosaic_gpu_sweep.profile``).
"""

from __future__ import annotations

import ast
import functools
import os
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_ring import BlockSizes, bench, masks
from pallas_ring.attention import flash_attention
from pallas_ring.kernels.pallas_mosaic_gpu import Variants


def rel(got, ref):
  got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def _inputs(t, n, h, hv, seed):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (1, t, n, h), jnp.bfloat16)
  k = jax.random.normal(ks[1], (1, t, n, h), jnp.bfloat16)
  v = jax.random.normal(ks[2], (1, t, n, hv), jnp.bfloat16)
  do = jax.random.normal(ks[3], (1, t, n, hv), jnp.bfloat16)
  return q, k, v, do


def ours(q, k, v, variants=None):
  if variants is None:
    return flash_attention(q, k, v, mask=masks.Causal())
  return flash_attention(q, k, v, mask=masks.Causal(), backend="pallas_mosaic_gpu",
                         block_sizes=BlockSizes(variants=variants))


def cudnn_padded(q, k, v):
  hv = v.shape[-1]
  vp = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, q.shape[-1] - hv)))
  out = jax.nn.dot_product_attention(q, k, vp, is_causal=True, implementation="cudnn")
  return out[..., :hv]


def cudnn(q, k, v):
  return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


def check(variants, hv, t=2048, n=4):
  q, k, v, do = _inputs(t, n, 192, hv, seed=1)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  ref = lambda *a: flash_attention(*a, mask=masks.Causal(), backend="xla")
  out, g = bench.fwd_bwd(functools.partial(ours, variants=variants))(q, k, v, do)
  r_out, r_g = bench.fwd_bwd(ref)(*f32, do.astype(jnp.float32))
  errs = [rel(out, r_out)] + [rel(a, b) for a, b in zip(g, r_g)]
  print(f"check T={t} 192/{hv}: out {errs[0]:.2e} dq {errs[1]:.2e} dk {errs[2]:.2e} "
        f"dv {errs[3]:.2e}", flush=True)
  assert all(e < 2e-2 for e in errs), errs


def time_shape(t, variants, hv, n=16):
  pairs = bench.visible_pairs(t, "causal")
  mla = _inputs(t, n, 192, hv, seed=2)
  std = _inputs(t, n, 128, 128, seed=3)
  impls = {f"ours 192/{hv}": (ours, mla), f"cudnn v padded 192/{hv}": (cudnn_padded, mla),
           "ours 128/128": (ours, std), "cudnn 128/128": (cudnn, std)}
  if variants is not None:
    impls[f"ours 192/{hv} variants"] = (functools.partial(ours, variants=variants), mla)
  flops = {name: 2 * pairs * n * (a[0].shape[-1] + a[2].shape[-1]) for name, (_, a) in
           impls.items()}
  for pass_ in ("fwd", "fwd+bwd"):
    calls = {}
    for name, (f, a) in impls.items():
      calls[name] = (jax.jit(f), a[:3]) if pass_ == "fwd" else (bench.fwd_bwd(f), a)
    for mode, kw in (("batch", {}), ("lone", dict(iters=1, min_batch_s=0.0))):
      with bench.clock("device"):
        samples = bench.interleaved_samples(calls, reps=8, **kw)
      med = {name: statistics.median(s) for name, s in samples.items()}
      for name, secs in med.items():
        mult = 1.0 if pass_ == "fwd" else 3.5
        base = med[f"cudnn v padded 192/{hv}" if "192" in name else "cudnn 128/128"]
        print(f"T={t:6d} {pass_:7s} {mode:5s} {name:24s} {secs * 1e3:8.3f} ms "
              f"{mult * flops[name] / secs / 1e12:6.1f} TFLOP/s  {base / secs:.3f}x its cudnn",
              flush=True)


def parts(lengths):
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import mosaic_gpu_sweep  # pylint: disable=import-outside-toplevel
  for t in lengths:
    for h, hv in ((192, 128), (128, 128)):
      q, k, v, do = _inputs(t, 16, h, hv, seed=2)
      mosaic_gpu_sweep.profile(f"T={t} {h}/{hv}", bench.fwd_bwd(ours), (q, k, v, do),
                               f"/tmp/mla_parts/{t}_{h}")


def main(argv):
  print(jax.__version__, jax.devices()[0].device_kind, flush=True)
  if "--parts" in argv:
    return parts([int(a) for a in argv if a != "--parts"] or (8192, 16384))
  hv = int(dict(a.split("=") for a in argv if a.startswith("--hv=")).get("--hv", 128))
  argv = [a for a in argv if not a.startswith("--hv=")]
  fields = dict(a.split("=", 1) for a in argv if "=" in a)
  variants = (Variants(**{f: ast.literal_eval(x) for f, x in fields.items()}) if fields
              else None)
  if variants is not None:
    print("variants:", variants, flush=True)
  check(variants, hv)
  lengths = [int(a) for a in argv if "=" not in a]
  for t in lengths or (8192, 16384):
    time_shape(t, variants, hv)


if __name__ == "__main__":
  main(sys.argv[1:])
