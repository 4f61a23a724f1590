"""GPU benchmarks against the baselines JAX users pick today (``python -m pallas_ring bench``).

Single device: ours vs cuDNN (``jax.nn.dot_product_attention(implementation="cudnn")``) and JAX's
Pallas Triton ``mha`` at its best swept block configuration; plus the sparse cases (causal sliding
window 1024; 16 causal documents of 1024). Ring (``--ring``): per-GPU throughput of the ring vs
all-gather K/V + cuDNN vs our kernel on one GPU doing the same per-device work.

Timing (``pallas_ring.timing``, re-exported here for the tools): jit, warm up, then batches of
calls on random inputs, timed by the host's clock or on the device (``bench --device-time``);
TFLOP/s on visible (query, key) pairs.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_ring import masks
from pallas_ring.attention import flash_attention
from pallas_ring.config import BlockSizes, SequenceParallelConfig
from pallas_ring.timing import (MIN_BATCH_S, Row, _peak_gib, _tflops, balanced_orders,  # noqa: F401
                                clock, device_spans, fwd_bwd, interleaved_samples, plot,
                                random_inputs, timeit, timeit_interleaved, trace_events,
                                visible_pairs)


def _mha(seg, causal, bq, bk, warps, stages):
  from jax.experimental.pallas.ops.gpu import attention as pmha
  bs = pmha.BlockSizes(block_q=bq, block_k=bk, block_q_dkv=64, block_kv_dkv=64, block_q_dq=64,
                       block_kv_dq=64)
  def f(q, k, v):
    return pmha.mha(q, k, v, seg, sm_scale=q.shape[-1] ** -0.5, causal=causal, block_sizes=bs,
                    num_warps=warps, num_stages=stages)
  return f


def tile_note(t, h, mask, segments=False, n=16, kv_heads=None, dtype=jnp.bfloat16,
              backend="pallas_triton") -> str:
  """Which tiles ``block_sizes=None`` resolves to for a shape, and where they came from."""
  from pallas_ring.kernels import tile_cache, tuning
  tiles = tuning.resolve(backend, None, t, t, h, dtype=dtype, group=n // (kv_heads or n),
                         mask_class=tile_cache.mask_class(masks.as_spec(mask), segments))
  return (f"tiles fwd ({tiles.block_q}, {tiles.block_kv}, warps {tiles.num_warps}, stages "
          f"{tiles.num_stages}) from {tiles.source_fwd}; bwd ({tiles.block_q_bwd}, "
          f"{tiles.block_kv_bwd}) from {tiles.source_bwd}")


def _sweep(make, args, grid, log):
  """Best (seconds, config) of ``make(*config)`` forward over ``grid``."""
  best = (float("inf"), None)
  for cfg in grid:
    try:
      secs = timeit(jax.jit(make(*cfg)), *args, iters=5, reps=3)
    except Exception as e:  # a configuration that does not compile (e.g. shared memory)
      log(f"    {cfg}: failed ({type(e).__name__})")
      continue
    log(f"    {cfg}: {secs * 1e3:.3f} ms")
    best = min(best, (secs, cfg), key=lambda x: x[0])
  return best


SWEEP = list(itertools.product([64, 128], [64, 128], [4, 8], [2, 3]))


def single_device(lengths=(16384, 4096), b=1, n=16, h=128, log=print):
  """Dense and causal, forward and forward+backward: cuDNN, JAX's Pallas ``mha`` and our Triton
  kernel at their best swept block configurations (swept at the longest T), and ``"auto"`` at
  default tiles (on Hopper: the Mosaic GPU kernels for both passes)."""
  from pallas_ring import kernels
  auto = kernels.native_backend()
  rows, best = [], {}
  for t, causal in itertools.product(lengths, (False, True)):
    case = f"T={t} {'causal' if causal else 'dense'}"
    pairs = visible_pairs(t, "causal" if causal else "full")
    q, k, v, do = random_inputs(b, t, n, h)
    mask = masks.Causal() if causal else None
    ours_make = lambda bq, bk, w, s, mask=mask: (lambda q_, k_, v_: flash_attention(
        q_, k_, v_, mask=mask, block_sizes=BlockSizes(bq, bk, None, None, w, s),
        backend="pallas_triton"))
    if causal not in best:
      log(f"[{case}] sweeping mha and ours (fwd)")
      best[causal] = (_sweep(lambda *c: _mha(None, causal, *c), (q, k, v), SWEEP, log)[1],
                      _sweep(ours_make, (q, k, v), SWEEP, log)[1])
    mha_cfg, ours_cfg = best[causal]
    cudnn = lambda q_, k_, v_, c=causal: jax.nn.dot_product_attention(
        q_, k_, v_, is_causal=c, implementation="cudnn")
    ours_name = f"ours {auto} (default tiles)"
    impls = {"cudnn": cudnn, f"mha{mha_cfg}": _mha(None, causal, *mha_cfg),
             f"ours triton{ours_cfg}": ours_make(*ours_cfg),
             ours_name: lambda q_, k_, v_, m=mask: flash_attention(q_, k_, v_, mask=m)}
    log(f"  {ours_name}: {tile_note(t, h, mask, n=n, backend=auto)}")
    for pass_ in ("fwd", "fwd+bwd"):
      args = (q, k, v) if pass_ == "fwd" else (q, k, v, do)
      res = timeit_interleaved({name: (jax.jit(f) if pass_ == "fwd" else fwd_bwd(f), args)
                                for name, f in impls.items()})
      for name, secs in res.items():
        ratio = "" if name.startswith("ours") else f"ours {secs / res[ours_name]:.2f}x faster"
        rows.append(Row(case, name, pass_, secs * 1e3, _tflops(pairs, b, n, h, secs, pass_), ratio))
        log(f"  {pass_:8s} {name:32s} {secs * 1e3:8.3f} ms {rows[-1].tflops:7.1f} TFLOP/s {ratio}")
  rows += sparse_cases(b=b, n=n, h=h, log=log)
  return rows


def sparse_cases(t=16384, b=1, n=16, h=128, log=print):
  """Causal sliding window 1024 and 16 causal documents of 1024: "auto", our Triton kernel and
  the baselines."""
  from pallas_ring import kernels
  rows = []
  q, k, v, do = random_inputs(b, t, n, h, seed=1)
  seg = jnp.repeat(jnp.arange(16, dtype=jnp.int32), t // 16)[None].repeat(b, 0)
  dense = (seg[:, None, :, None] == seg[:, None, None, :]) & jnp.tril(
      jnp.ones((t, t), bool))[None, None]
  cases = {
      "window 1024": ("window", {
          "cudnn local_window_size": lambda q_, k_, v_: jax.nn.dot_product_attention(
              q_, k_, v_, is_causal=True, local_window_size=(1024, 0), implementation="cudnn"),
          "ours": lambda q_, k_, v_: flash_attention(
              q_, k_, v_, mask=masks.Causal() & masks.SlidingWindow(1024)),
          "ours triton": lambda q_, k_, v_: flash_attention(
              q_, k_, v_, mask=masks.Causal() & masks.SlidingWindow(1024),
              backend="pallas_triton"),
      }),
      "16 documents of 1024": ("documents", {
          "cudnn dense mask": lambda q_, k_, v_: jax.nn.dot_product_attention(
              q_, k_, v_, mask=dense, implementation="cudnn"),
          "mha segment_ids (64,64,4,3)": _mha(seg, True, 64, 64, 4, 3),
          "ours": lambda q_, k_, v_: flash_attention(q_, k_, v_, mask=masks.Causal(),
                                                     segment_ids=seg),
          "ours triton": lambda q_, k_, v_: flash_attention(
              q_, k_, v_, mask=masks.Causal(), segment_ids=seg, backend="pallas_triton"),
      }),
  }
  for case, (kind, impls) in cases.items():
    pairs = visible_pairs(t, kind)
    log(f"  [{case}] ours: " + tile_note(t, h, masks.Causal() & masks.SlidingWindow(1024)
                                         if kind == "window" else masks.Causal(),
                                         segments=kind == "documents", n=n,
                                         backend=kernels.native_backend()))
    for pass_ in ("fwd", "fwd+bwd"):
      args = (q, k, v) if pass_ == "fwd" else (q, k, v, do)
      calls = {}
      for name, f in impls.items():
        fn = jax.jit(f) if pass_ == "fwd" else fwd_bwd(f)
        try:  # compile (and drop) what cannot run, e.g. a dense mask cuDNN refuses
          jax.block_until_ready(fn(*args))
          calls[name] = (fn, args)
        except Exception as e:
          log(f"  {case} {pass_} {name}: failed {type(e).__name__}: {str(e)[:200]}")
      res = timeit_interleaved(calls)
      for name, secs in res.items():
        ratio = "" if name == "ours" or "ours" not in res else \
            f"ours {secs / res['ours']:.2f}x faster"
        rows.append(Row(f"T={t} {case}", name, pass_, secs * 1e3,
                        _tflops(pairs, b, n, h, secs, pass_), ratio))
        log(f"  {case:22s} {pass_:8s} {name:30s} {secs * 1e3:8.3f} ms "
            f"{rows[-1].tflops:7.1f} TFLOP/s {ratio}")
  return rows


MODEL_SHAPES = {  # name: (B, T, N, K, H), causal
    "Llama GQA 32/8 T=8k": (1, 8192, 32, 8, 128),
    "H=256 T=8k": (1, 8192, 16, 16, 256),
    "H=64 B=8 T=2k": (8, 2048, 16, 16, 64),
}


def model_shapes(log=print):
  """Causal model shapes (GQA, H=256, H=64): cuDNN, ``"auto"`` and our Triton kernel."""
  from pallas_ring import kernels
  rows = []
  for case, (b, t, n, kh, h) in MODEL_SHAPES.items():
    q, k, v, do = random_inputs(b, t, n, h, kv_heads=kh, seed=5)
    impls = {
        "cudnn": lambda q_, k_, v_: jax.nn.dot_product_attention(q_, k_, v_, is_causal=True,
                                                                 implementation="cudnn"),
        f"ours {kernels.native_backend()}": lambda q_, k_, v_: flash_attention(
            q_, k_, v_, mask=masks.Causal()),
        "ours triton": lambda q_, k_, v_: flash_attention(q_, k_, v_, mask=masks.Causal(),
                                                          backend="pallas_triton"),
    }
    pairs = visible_pairs(t, "causal")
    for pass_ in ("fwd", "fwd+bwd"):
      args = (q, k, v) if pass_ == "fwd" else (q, k, v, do)
      res = timeit_interleaved({name: (jax.jit(f) if pass_ == "fwd" else fwd_bwd(f), args)
                                for name, f in impls.items()})
      for name, secs in res.items():
        ratio = "" if name == "cudnn" else f"{res['cudnn'] / secs:.3f}x cuDNN's speed"
        rows.append(Row(case, name, pass_, secs * 1e3, _tflops(pairs, b, n, h, secs, pass_),
                        ratio))
        log(f"  {case:20s} {pass_:8s} {name:24s} {secs * 1e3:8.3f} ms "
            f"{rows[-1].tflops:7.1f} TFLOP/s {ratio}")
  return rows


def extras_cost(t=16384, b=1, n=16, h=128, log=print):
  """Causal forward+backward with attention dropout 0.1 and with ALiBi, against the same call
  without them (BENCHMARKS.md, "Bias, ALiBi and dropout")."""
  q, k, v, do = random_inputs(b, t, n, h, seed=4)
  slopes = jnp.asarray(2.0 ** (-8.0 * (np.arange(n) + 1) / n), jnp.float32)
  key = jax.random.key(0)
  impls = {
      "ours": {},
      "ours + dropout 0.1": dict(dropout_rate=0.1, dropout_rng=key),
      "ours + ALiBi": dict(alibi_slopes=slopes),
  }
  pairs = visible_pairs(t, "causal")
  rows = []
  for pass_ in ("fwd", "fwd+bwd"):
    res = {}
    for name, kw in impls.items():
      f = lambda q_, k_, v_, kw=kw: flash_attention(q_, k_, v_, mask=masks.Causal(), **kw)
      fn = jax.jit(f) if pass_ == "fwd" else fwd_bwd(f)
      res[name] = timeit(fn, *((q, k, v) if pass_ == "fwd" else (q, k, v, do)))
    for name, secs in res.items():
      ratio = "" if name == "ours" else f"{secs / res['ours']:.3f}x the time of ours"
      rows.append(Row(f"T={t} causal", name, pass_, secs * 1e3,
                      _tflops(pairs, b, n, h, secs, pass_), ratio))
      log(f"  {pass_:8s} {name:22s} {secs * 1e3:8.3f} ms {rows[-1].tflops:7.1f} TFLOP/s {ratio}")
  return rows


DECODE_CACHES = {  # name: (B, S, N, K, H, T): T new tokens against a full cache of S slots
    "B=1 S=128k GQA 32/8": (1, 131072, 32, 8, 128, 1),
    "B=1 S=128k MQA 16/1": (1, 131072, 16, 1, 128, 1),
    "B=8 S=32k GQA 32/8": (8, 32768, 32, 8, 128, 1),
    "B=16 S=8k GQA 32/8": (16, 8192, 32, 8, 128, 1),
    "B=1 S=32k GQA 32/8": (1, 32768, 32, 8, 128, 1),  # (the T=1 base of the next two)
    "B=1 S=32k GQA 32/8 T=4": (1, 32768, 32, 8, 128, 4),
    "B=1 S=32k GQA 32/8 T=8": (1, 32768, 32, 8, 128, 8),
}

# HBM bandwidth by device kind (bytes/s, the vendors' figures), for "% of HBM".
HBM_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12}


def _hbm_peak() -> float:
  kind = jax.devices()[0].device_kind
  return next((bw for name, bw in HBM_BYTES_PER_S.items() if name in kind), float("nan"))


def decode(caches=None, extra_impls=None, log=print):
  """Decode against a full bf16 cache: cuDNN and XLA (``jax.nn.dot_product_attention``) beside
  ``decode_attention`` on ``"auto"`` and on Triton; K/V bytes per second and % of HBM.

  Args:
    caches: ``DECODE_CACHES``-style shapes (default: all of them).
    extra_impls: more ``name: decode_attention keyword dict`` to time beside (e.g. kv_splits).
  """
  from pallas_ring.decode import decode_attention
  from pallas_ring import kernels
  rows = []
  peak = _hbm_peak()
  for case, (b, s, n, kh, h, t) in (caches or DECODE_CACHES).items():
    keys = jax.random.split(jax.random.key(11), 3)
    q = jax.random.normal(keys[0], (b, t, n, h), jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, s, kh, h), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, s, kh, h), jnp.bfloat16)
    # The queries are the cache's last T tokens: each sees the slots up to its own.
    pos = s - t + jnp.arange(t)
    visible = pos[:, None] >= jnp.arange(s)[None]  # [T, S]
    # cuDNN reads the whole cache unmasked (its causal mask is aligned top-left); the same for
    # T = 1, the same bytes for T > 1.
    impls = {"cudnn": lambda q_, k_, v_: jax.nn.dot_product_attention(q_, k_, v_,
                                                                      implementation="cudnn"),
             "xla": lambda q_, k_, v_: jax.nn.dot_product_attention(
                 q_, k_, v_, mask=visible[None, None], implementation="xla"),
             "ours auto": lambda q_, k_, v_: decode_attention(q_, k_, v_)}
    trains = kernels.native_backend()  # (what "auto" trains with here, if it decodes otherwise)
    if trains != kernels.auto("gpu", kernels.Call(jnp.bfloat16, h, decode=True)):
      impls[f"ours {trains}"] = lambda q_, k_, v_: decode_attention(q_, k_, v_, backend=trains)
    for name, kw in (extra_impls or {}).items():
      impls[name] = lambda q_, k_, v_, kw=kw: decode_attention(q_, k_, v_, **kw)
    # As in generation: the lengths are data (a traced argument).
    impls["ours, kv_lengths"] = lambda q_, k_, v_, n_: decode_attention(q_, k_, v_,
                                                                       kv_lengths=n_)
    ref = jax.jit(impls["xla"])(q, k, v).astype(jnp.float32)
    full = jnp.full((b,), s, jnp.int32)
    calls = {name: (jax.jit(f), (q, k, v, full) if "kv_lengths" in name else (q, k, v))
             for name, f in impls.items()}
    for name, (fn, args) in calls.items():
      if name == "cudnn" and t > 1:
        continue
      err = jnp.linalg.norm(fn(*args).astype(jnp.float32) - ref) / jnp.linalg.norm(ref)
      if not err < 2e-2:
        log(f"  {case}: {name} differs from XLA: relative error {float(err):.3g}")
    kv_bytes = 2 * b * s * kh * h * 2

    def ratios(res, name, secs):
      note = f", {100 * kv_bytes / secs / peak:.0f}% of HBM"
      if name != "cudnn":
        note += f", {res['cudnn'] / secs:.2f}x cuDNN, {res['xla'] / secs:.2f}x XLA"
      return note
    rows += _decode_rows(case, calls, kv_bytes, ratios, log)
  return rows


def _decode_rows(case, calls, kv_bytes, ratios, log):
  """``Row``s of decode ``calls`` timed in back-to-back batches and as lone calls: K/V bytes
  read per second, then ``ratios(times, name, seconds)``."""
  rows = []
  for clock_name, kw in (("batch", {}), ("lone", dict(iters=1, min_batch_s=0.0))):
    res = timeit_interleaved(calls, reps=12, **kw)
    for name, secs in res.items():
      note = f"{kv_bytes / secs / 1e9:.0f} GB/s{ratios(res, name, secs)}"
      rows.append(Row(case, name, f"decode {clock_name}", secs * 1e3, 0.0, note))
      log(f"  {case:24s} {clock_name:5s} {name:28s} {secs * 1e3:8.3f} ms  {note}")
  return rows


# Sharded-cache decode cases: name -> (B, S, N, K, H); S over all local GPUs.
SHARDED_CACHES = {"GQA 32/8 1M": (1, 2**20, 32, 8, 128), "MQA 16/1 1M": (1, 2**20, 16, 1, 128),
                  "GQA 32/8 B=4 256k": (4, 2**18, 32, 8, 128)}


def decode_sharded(caches=None, log=print):
  """One new token against a bf16 cache sharded along its slots over all local GPUs
  (``decode_attention(mesh=...)``) against the whole cache on one GPU, interleaved; the sharded
  result is first checked against the one-GPU result."""
  from jax.sharding import NamedSharding, PartitionSpec as P, AxisType
  from pallas_ring.decode import decode_attention
  r = jax.device_count()
  mesh = jax.make_mesh((r,), ("sp",), axis_types=(AxisType.Auto,))
  cfg = SequenceParallelConfig(axis_name="sp", batch_axes=())
  rows = []
  for case, (b, s, n, kh, h) in (caches or SHARDED_CACHES).items():
    keys = jax.random.split(jax.random.key(12), 3)
    dev0 = jax.devices()[0]
    q = jax.device_put(jax.random.normal(keys[0], (b, 1, n, h), jnp.bfloat16), dev0)
    k, v = (jax.device_put(jax.random.normal(key, (b, s, kh, h), jnp.bfloat16), dev0)
            for key in keys[1:])
    cache = NamedSharding(mesh, P(None, "sp"))
    qr = jax.device_put(q, NamedSharding(mesh, P()))
    ks, vs = jax.device_put(k, cache), jax.device_put(v, cache)
    one = jax.jit(lambda q_, k_, v_: decode_attention(q_, k_, v_))
    many = jax.jit(lambda q_, k_, v_: decode_attention(q_, k_, v_, mesh=mesh, config=cfg))
    calls = {"one GPU": (one, (q, k, v)), f"{r} GPUs": (many, (qr, ks, vs))}
    ref = one(q, k, v).astype(jnp.float32)
    got = jax.device_put(many(qr, ks, vs), dev0).astype(jnp.float32)
    err = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
    ratios = lambda res, name, secs: (
        "" if name == "one GPU" else
        f", {res['one GPU'] / secs:.2f}x one GPU, rel. err. {err:.1e}")
    rows += _decode_rows(case, calls, 2 * b * s * kh * h * 2, ratios, log)
  return rows


# The sequence-parallel cases of ``ring``: (strategy, layout, causal). Dense runs contiguous (its
# work is balanced in any layout); causal compares the layouts and the strategies.
RING_CASES = (("ring", "contiguous", False), ("ring", "contiguous", True),
              ("ring", "zigzag", True), ("all_gather", "zigzag", True),
              ("ulysses", "zigzag", True))


def ring(tokens_per_device=(8192, 32768), b=1, n=16, h=128, kv_heads=None, cases=RING_CASES,
         log=print):
  """Per-GPU throughput of the sequence-parallel strategies on all local GPUs, timed interleaved
  with all-gather K/V + cuDNN (dense) and with our kernel on one GPU doing the same per-device
  work (T/R queries against T keys, dense).

  Args:
    tokens_per_device: T/R for each group of rows.
    kv_heads: K (default N).
    cases: ``(strategy, layout, causal)`` triples (``RING_CASES``), or with a fourth item, a
      ``RingVariants`` (its name tagged with the fields it changes).
  """
  from jax.sharding import NamedSharding, PartitionSpec as P, AxisType
  from pallas_ring.sharded import sharded_attention
  r = jax.device_count()
  mesh = jax.make_mesh((r,), ("sp",), axis_types=(AxisType.Auto,))
  heads = f"{n}/{kv_heads or n}"
  rows = []
  for tl in tokens_per_device:
    t = tl * r
    sh = NamedSharding(mesh, P(None, "sp"))
    q, k, v, do = (jax.device_put(x, sh)
                   for x in random_inputs(b, t, n, h, seed=2, kv_heads=kv_heads))
    dev0 = jax.devices()[0]
    q1, k1, v1, do1 = (jax.device_put(x, dev0) for x in (q[:, :tl], k, v, do[:, :tl]))

    def gather_cudnn(q_, k_, v_):
      def per(qs, ks, vs):
        kg = jax.lax.all_gather(ks, "sp", axis=1, tiled=True)
        vg = jax.lax.all_gather(vs, "sp", axis=1, tiled=True)
        return jax.nn.dot_product_attention(qs, kg, vg, implementation="cudnn")
      return jax.shard_map(per, mesh=mesh, in_specs=(P(None, "sp"),) * 3,
                           out_specs=P(None, "sp"), check_vma=False)(q_, k_, v_)

    impls = {"one GPU, same work": (lambda q_, k_, v_: flash_attention(q_, k_, v_),
                                    (q1, k1, v1), do1, tl * t),
             "all_gather+cudnn dense": (gather_cudnn, (q, k, v), do, tl * t)}
    for strategy, layout, causal, *variants in cases:
      rv = variants[0] if variants else None
      cfg = SequenceParallelConfig(axis_name="sp", layout=layout, strategy=strategy,
                                   ring_variants=rv)
      mask = masks.Causal() if causal else None
      f = lambda q_, k_, v_, cfg=cfg, mask=mask: sharded_attention(q_, k_, v_, mesh=mesh,
                                                                   config=cfg, mask=mask)
      tag = "".join(f"+{x.name}={getattr(rv, x.name)}"
                    for x in (dataclasses.fields(rv) if rv else ())
                    if getattr(rv, x.name) != x.default)
      name = f"{strategy}{tag} {layout} {'causal' if causal else 'dense'}"
      impls[name] = (f, (q, k, v), do, visible_pairs(t, "causal" if causal else "full") / r)
    for pass_ in ("fwd", "fwd+bwd"):
      calls = {}
      for name, (f, args, do_, _) in impls.items():
        calls[name] = ((jax.jit(f), args) if pass_ == "fwd" else (fwd_bwd(f), (*args, do_)))
      res = timeit_interleaved(calls, iters=3, reps=4)
      tf = {name: _tflops(impls[name][3], b, n, h, secs, pass_) for name, secs in res.items()}
      for name, secs in res.items():
        rel = ""
        strategy, _, rest = name.partition(" ")
        untagged = f"{strategy.split('+')[0]} {rest}"  # (the same case without its variants)
        if untagged != name and untagged in res:
          rel = f"{res[untagged] / secs:.2f}x {untagged}"
        elif name.endswith("dense") and name != "all_gather+cudnn dense":
          rel = f"{tf[name] / tf['all_gather+cudnn dense']:.2f}x all_gather+cudnn"
        elif name.startswith("ring zigzag") and "ring contiguous causal" in res:
          rel = f"{res['ring contiguous causal'] / secs:.2f}x contiguous"
        elif (name.endswith("causal") and "ring zigzag causal" in res and
              name != "ring zigzag causal"):
          rel = f"{res['ring zigzag causal'] / secs:.2f}x ring zigzag"
        rows.append(Row(f"{tl}/GPU x{r} {heads}", name, pass_, secs * 1e3, tf[name], rel))
        log(f"  {tl}/GPU x{r} {heads} {name:42s} {pass_:8s} {secs * 1e3:8.2f} ms "
            f"{tf[name]:7.1f} TFLOP/s/GPU {rel}")
  peak = _peak_gib()
  log(f"peak memory per device (GiB): {[round(p, 2) for p in peak]}")
  return rows


def long_context(total_tokens=2**20, b=1, n=16, h=128, log=print):
  """Causal zigzag forward+backward over ``total_tokens`` split across all local GPUs."""
  from jax.sharding import NamedSharding, PartitionSpec as P, AxisType
  from pallas_ring.sharded import sharded_attention
  r = jax.device_count()
  mesh = jax.make_mesh((r,), ("sp",), axis_types=(AxisType.Auto,))
  sh = NamedSharding(mesh, P(None, "sp"))
  q, k, v, do = jax.jit(lambda: random_inputs(b, total_tokens, n, h, seed=3),
                        out_shardings=(sh,) * 4)()
  cfg = SequenceParallelConfig(axis_name="sp", layout="zigzag")
  f = lambda q_, k_, v_: sharded_attention(q_, k_, v_, mesh=mesh, config=cfg, mask=masks.Causal())
  secs = timeit(fwd_bwd(f), q, k, v, do, iters=1, reps=3)
  tf = _tflops(visible_pairs(total_tokens, "causal") / r, b, n, h, secs, "fwd+bwd")
  peak = _peak_gib()
  log(f"causal zigzag fwd+bwd, {total_tokens} tokens over {r} GPUs: {secs:.2f} s, "
      f"{tf:.1f} TFLOP/s/GPU; peak memory per device (GiB): {[round(p, 1) for p in peak]}")
  return [Row(f"{total_tokens} tokens x{r} causal", "ring zigzag", "fwd+bwd", secs * 1e3, tf)]


def main(args) -> int:
  """``python -m pallas_ring bench``: its exit status (1 without a GPU, nothing timed)."""
  if jax.default_backend() != "gpu":
    print("bench needs a GPU (JAX default backend is "
          f"{jax.default_backend()!r}); nothing to time here.", file=sys.stderr)
    return 1
  out_dir = args.out
  os.makedirs(out_dir, exist_ok=True)
  kind = "device" if args.device_time else "wall"
  log = lambda s: print(s, flush=True)
  log(f"device: {jax.devices()[0].device_kind} x{jax.device_count()}, jax {jax.__version__}, "
      f"{kind} clock")
  with clock(kind):
    if args.long_context:
      rows, name = long_context(args.long_context, log=log), "long_context"
    elif args.ring:
      rows, name = ring(log=log), "ring"
    elif args.extras:
      rows, name = extras_cost(log=log), "extras"
    elif args.models:
      rows, name = model_shapes(log=log), "models"
    elif args.decode and jax.device_count() > 1:
      rows, name = decode(log=log) + decode_sharded(log=log), "decode"
    elif args.decode:
      rows, name = decode(log=log), "decode"
    else:
      rows, name = single_device(log=log), "single"
  with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
    json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "clock": kind,
               "rows": [dataclasses.asdict(r) for r in rows]}, f, indent=1)
  print("\n| case | impl | pass | ms | TFLOP/s | ratio |\n|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r.case} | {r.impl} | {r.pass_} | {r.ms:.3f} | {r.tflops:.1f} | {r.ratio} |")
  if not any(r.tflops for r in rows):  # (decode: bandwidth, no FLOP/s to plot)
    return 0
  try:
    plot(rows, os.path.join(out_dir, f"{name}.png"),
         f"{jax.devices()[0].device_kind}, JAX {jax.__version__}")
  except ImportError:
    log("matplotlib not installed: no plot")
  return 0
