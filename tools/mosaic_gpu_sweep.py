"""Checks and times the Mosaic GPU forward on a Hopper GPU (one call of the device tool).

    python tools/mosaic_gpu_sweep.py correct   # forward: every configuration vs the xla backend
    python tools/mosaic_gpu_sweep.py variants  # forward: ours (Mosaic GPU, Triton) vs cuDNN and
                                               # upstream attention_mgpu, timed interleaved
                                               # ([shape words])
    python tools/mosaic_gpu_sweep.py tiles     # forward tile / slot candidates at T=16k
    python tools/mosaic_gpu_sweep.py sparse_tiles  # the same for a window and documents
    python tools/mosaic_gpu_sweep.py grads     # backward: every configuration's gradients vs
                                               # the xla backend, run-to-run bitwise equality,
                                               # the float32 outputs the ring accumulates
    python tools/mosaic_gpu_sweep.py bwd       # forward+backward vs cuDNN and Triton, interleaved
    python tools/mosaic_gpu_sweep.py parts DIR # forward+backward ("fwd": forward): device time
                                               # per kernel and span per call (profiler trace),
                                               # each XLA op with its HLO instruction
    python tools/mosaic_gpu_sweep.py calls     # two forward+backward calls, to run under ncu
    python tools/mosaic_gpu_sweep.py step      # a ring step's forward at 8k: alone, merging
    python tools/mosaic_gpu_sweep.py spans     # ours vs cuDNN timed on the device: batches
                                               # and single calls ([fwd] [bwd] [shape words])
    python tools/mosaic_gpu_sweep.py features  # ALiBi, dropout, bias, dense masks against the
                                               # plain kernel, as spans ([fwd] [bwd] [features]
                                               # [shape words] [field=v1,v2])

Correctness: relative error ||got - ref|| / ||ref|| of the output and the lse against the ``xla``
backend in float32 on fresh random inputs, and fully masked rows (zeros, never NaN). Timing: as
``bench`` (jit, warm-up, ``block_until_ready`` around batches of calls, median), same run for
every implementation, bf16, random inputs; ``variants`` interleaves the implementations'
repetitions (``bench.interleaved_samples``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import statistics
import sys
import traceback
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from pallas_ring import bench, masks
from pallas_ring.attention import flash_attention
from pallas_ring.bench import random_inputs, timeit, visible_pairs
from pallas_ring.config import BlockSizes
from pallas_ring.kernels.pallas_mosaic_gpu import Variants


def rel(got, ref):
  got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


CASES = [  # name, T, S, N, K, H, mask, segments, softcap, dtype
    ("causal", 1024, 1024, 4, 4, 128, masks.Causal(), False, None, jnp.bfloat16),
    ("full", 1024, 1024, 4, 4, 128, masks.Full(), False, None, jnp.bfloat16),
    ("full-odd", 1000, 777, 4, 2, 128, masks.Full(), False, None, jnp.bfloat16),
    ("causal-odd-fp16", 999, 999, 4, 4, 128, masks.Causal(), False, None, jnp.float16),
    ("gqa-causal", 2048, 2048, 8, 2, 128, masks.Causal(), False, None, jnp.bfloat16),
    ("mqa-full", 512, 512, 4, 1, 128, masks.Full(), False, None, jnp.bfloat16),
    ("window", 2048, 2048, 4, 4, 128, masks.Causal() & masks.SlidingWindow(300), False, None,
     jnp.bfloat16),
    ("chunked", 1024, 1024, 4, 4, 128, masks.ChunkedCausal(256), False, None, jnp.bfloat16),
    ("prefix", 1024, 1024, 4, 4, 128, masks.PrefixLM(200), False, None, jnp.bfloat16),
    ("docs", 2048, 2048, 4, 4, 128, masks.Causal(), True, None, jnp.bfloat16),
    # many consecutive PARTIAL tiles: a slot's key info must be read before the slot is reused
    ("docs-long", 8192, 8192, 4, 2, 64, masks.Full(), True, None, jnp.bfloat16),
    ("softcap", 1024, 1024, 4, 4, 128, masks.Causal(), False, 20.0, jnp.bfloat16),
    ("h64", 1024, 1024, 4, 4, 64, masks.Causal(), False, None, jnp.bfloat16),
    ("h256", 1024, 1024, 4, 4, 256, masks.Causal(), False, None, jnp.bfloat16),
    ("h96-odd", 700, 700, 4, 2, 96, masks.Full(), True, None, jnp.float16),
    # wide backward kernels (H > 128): masked tiles, GQA, soft-cap; H=192 unpadded
    ("h256-docs-gqa", 2048, 2048, 4, 2, 256, masks.Causal(), True, 20.0, jnp.bfloat16),
    ("h192-odd-fp16", 700, 700, 4, 4, 192, masks.Full(), False, None, jnp.float16),
    ("one-token", 1, 1, 2, 2, 128, masks.Causal(), False, None, jnp.bfloat16),
]


def _segments(key, t, s, segs):
  """Documents of random lengths (a fully masked query row can start batch 1), or None."""
  if not segs:
    return {}
  seg = jnp.cumsum(jax.random.bernoulli(key, 0.01, (2, t)), 1).astype(jnp.int32)
  kv = seg if t == s else jnp.cumsum(jax.random.bernoulli(key, 0.01, (2, s)), 1).astype(jnp.int32)
  return dict(segment_ids=seg, kv_segment_ids=kv)


def _each_case(check, names=()) -> int:
  """Runs ``check(q, k, v, kw, key) -> (ok, message)`` on fresh random inputs of every CASE (or
  those named) and prints one line each; returns the number of failures."""
  fails = 0
  for name, t, s, n, kh, h, mask, segs, cap, dt in CASES:
    if names and name not in names:
      continue
    key = jax.random.split(jax.random.key(zlib.crc32(name.encode()) % 2**31), 5)
    q = jax.random.normal(key[0], (2, t, n, h), dt)
    k = jax.random.normal(key[1], (2, s, kh, h), dt)
    v = jax.random.normal(key[2], (2, s, kh, h), dt)
    kw = dict(mask=mask, softcap=cap, **_segments(key[3], t, s, segs))
    try:
      ok, msg = check(q, k, v, kw, key[4])
    except Exception:
      ok, msg = False, "raised"
      traceback.print_exc()
    fails += not ok
    print(f"{'ok ' if ok else 'BAD'} {name:18s} {msg}", flush=True)
  return fails


def _forward_ok(q, k, v, kw, key):
  del key
  kw = dict(kw, return_lse=True)
  o, lse = jax.jit(lambda q, k, v: flash_attention(q, k, v, backend="pallas_mosaic_gpu",
                                                   **kw))(q, k, v)
  f32 = lambda x: x.astype(jnp.float32)
  ro, rlse = flash_attention(f32(q), f32(k), f32(v), backend="xla", **kw)
  fin = np.isfinite(np.asarray(rlse))
  eo, el = rel(o, ro), rel(np.where(fin, lse, 0), np.where(fin, rlse, 0))
  same_inf = bool(np.all(np.isfinite(np.asarray(lse)) == fin))
  nan = bool(np.isnan(np.asarray(o, np.float32)).any())
  return (eo < 2e-2 and el < 1e-3 and same_inf and not nan,
          f"out {eo:.2e} lse {el:.2e} inf-rows-match {same_inf} nan {nan}")


def correct(*names):
  print("FAILURES", _each_case(_forward_ok, names))


def tiles():
  for h in (128, 256, 64):
    t = 16384 if h != 256 else 8192
    q, k, v, _ = random_inputs(1, t, 16, h)
    for mask in (None, masks.Causal()):
      for bk in (64, 128, 256):
        for stages in (None, 2, 3, 4):
          bs = BlockSizes(block_q=128, block_kv=bk, num_stages=stages)
          f = jax.jit(lambda q, k, v, bs=bs: flash_attention(
              q, k, v, mask=mask, block_sizes=bs, backend="pallas_mosaic_gpu"))
          try:
            secs = timeit(f, q, k, v, iters=5, reps=3)
            pairs = visible_pairs(t, "full" if mask is None else "causal")
            print(f"H={h} {'dense' if mask is None else 'causal'} bk={bk} stages={stages}: "
                  f"{secs * 1e3:.3f} ms {4 * 16 * pairs * h / secs / 1e12:.1f} TFLOP/s",
                  flush=True)
          except Exception as e:
            print(f"H={h} bk={bk} stages={stages}: failed {type(e).__name__} {str(e)[:120]}",
                  flush=True)


def sparse_tiles():
  """Forward tile / slot candidates for short rows (causal window 1024; 16 causal documents of
  1024), H=128, T=16k, timed interleaved (with cuDNN's window where it has one)."""
  t, n, h = 16384, 16, 128
  q, k, v, _ = random_inputs(1, t, n, h)
  for kind, mask, seg in (
      ("window", masks.Causal() & masks.SlidingWindow(1024), None),
      ("documents", masks.Causal(), (jnp.arange(t, dtype=jnp.int32) // 1024)[None])):
    fns = {}
    for bk in (64, 128):
      for stages in (None, 2, 3, 4):
        bs = BlockSizes(block_q=128, block_kv=bk, num_stages=stages)
        try:  # (slots that do not fit in shared memory are refused)
          fns[f"bk={bk} stages={stages}"] = jax.jit(lambda q, k, v, bs=bs: flash_attention(
              q, k, v, mask=mask, segment_ids=seg, block_sizes=bs,
              backend="pallas_mosaic_gpu")).lower(q, k, v).compile()
        except ValueError as e:
          print(f"{kind} bk={bk} stages={stages}: {str(e)[:100]}", flush=True)
    if kind == "window":
      fns["cudnn"] = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=True, local_window_size=(1024, 0), implementation="cudnn"))
    _time_against_cudnn(kind, fns, (q, k, v), 4 * n * visible_pairs(t, kind) * h)


def _compiled(f, *args):
  """``f`` (jitted) compiled now for ``args``: switches read at trace time stay in effect."""
  return f.lower(*args).compile()


def _value(word: str):
  """A variant's value from its word: an int, ``True``/``False``/``None``, or the string."""
  return int(word) if word.lstrip("-").isdigit() else {
      "True": True, "False": False, "None": None}.get(word, word)


def _is_variant(word: str) -> bool:
  """``field=v1,v2`` naming a field of ``pallas_mosaic_gpu.Variants``."""
  return word.partition("=")[0] in {f.name for f in dataclasses.fields(Variants)}


def _variants(opts):
  """``(labels, [Variants])`` from words ``field=v1,v2`` (``_is_variant``): the kernel variants
  to compare in one run (``dkv_walk_rows=128`` sets the rows for every head dim)."""
  settings = [{}]
  for name, values in (o.split("=") for o in opts if _is_variant(o)):
    settings = [{**s, name: v} for s in settings for v in values.split(",")]
  value = lambda k, v: (tuple((h, _value(v)) for h in (64, 128, 256)) if k == "dkv_walk_rows"
                        else _value(v))
  return ([" ".join(f"{k}={v}" for k, v in s.items()) for s in settings],
          [Variants(**{k: value(k, v) for k, v in s.items()}) for s in settings])


def _ours_each(settings, compile_fn):
  """``{label: compile_fn(block_sizes)}`` for each kernel variant of ``_variants``."""
  return {f"ours pallas_mosaic_gpu {label}".strip(): compile_fn(BlockSizes(variants=v))
          for label, v in zip(*settings)}


def _time_against_cudnn(name, fns, args, flops):
  """Times ``fns`` (name -> compiled function of ``args``) interleaved, 8 batches each, and
  prints each one's median (min-max), TFLOP/s and ratio to cuDNN's time where it ran."""
  samples = bench.interleaved_samples({impl: (f, args) for impl, f in fns.items()}, reps=8)
  res = {impl: (statistics.median(ts), min(ts), max(ts)) for impl, ts in samples.items()}
  for impl, (med, lo, hi) in res.items():
    vs = f"vs cudnn {res['cudnn'][0] / med:.3f}x" if "cudnn" in res else ""
    print(f"{name:18s} {impl:24s} {med * 1e3:.3f} ms ({lo * 1e3:.3f}-{hi * 1e3:.3f}) "
          f"{flops / med / 1e12:6.1f} TFLOP/s  {vs}", flush=True)


_FWD_SHAPES = [  # name, T, N, K, H, mask, kind (for bench.visible_pairs), dtype
    ("dense T=16k", 16384, 16, 16, 128, None, "full", jnp.bfloat16),
    ("causal T=16k", 16384, 16, 16, 128, masks.Causal(), "causal", jnp.bfloat16),
    ("dense T=16k fp16", 16384, 16, 16, 128, None, "full", jnp.float16),
    ("causal T=16k fp16", 16384, 16, 16, 128, masks.Causal(), "causal", jnp.float16),
    *((f"window {w}", 16384, 16, 16, 128, masks.Causal() & masks.SlidingWindow(w), "window",
       jnp.bfloat16) for w in (1024, 2048, 4096)),
    ("gqa 32/8 T=8k", 8192, 32, 8, 128, masks.Causal(), "causal", jnp.bfloat16),
    ("h64 T=16k", 16384, 16, 16, 64, masks.Causal(), "causal", jnp.bfloat16),
    ("h256 T=8k", 8192, 16, 16, 256, masks.Causal(), "causal", jnp.bfloat16),
    ("docs 16x1024", 16384, 16, 16, 128, masks.Causal(), "documents", jnp.bfloat16),
    ("dense4k T=4k", 4096, 16, 16, 128, None, "full", jnp.bfloat16),
    ("dense32k T=32k", 32768, 16, 16, 128, None, "full", jnp.bfloat16),
    ("causal32k T=32k", 32768, 16, 16, 128, masks.Causal(), "causal", jnp.bfloat16),
    ("dense64k T=64k", 65536, 16, 16, 128, None, "full", jnp.bfloat16),
    ("causal64k T=64k", 65536, 16, 16, 128, masks.Causal(), "causal", jnp.bfloat16),
    ("causal4k T=4k", 4096, 16, 16, 128, masks.Causal(), "causal", jnp.bfloat16),
    ("mqa 16/1 T=16k", 16384, 16, 1, 128, masks.Causal(), "causal", jnp.bfloat16),
    ("gqa32k 32/8 T=32k", 32768, 32, 8, 128, masks.Causal(), "causal", jnp.bfloat16),
    # short H=64 rows, batched (``_BATCH``): bench --models's, the pair/fused crossover
    # (``Variants.pair_up_to_keys``), GPT-2's and BERT's shapes
    ("h64b8 B=8 T=2k", 2048, 16, 16, 64, masks.Causal(), "causal", jnp.bfloat16),
    ("h64b4 B=4 T=4k", 4096, 16, 16, 64, masks.Causal(), "causal", jnp.bfloat16),
    ("h64b2 B=2 T=8k", 8192, 16, 16, 64, masks.Causal(), "causal", jnp.bfloat16),
    ("gpt2 B=8 N=12 T=1k", 1024, 12, 12, 64, masks.Causal(), "causal", jnp.bfloat16),
    ("bert B=16 N=12 T=512", 512, 12, 12, 64, None, "full", jnp.bfloat16)]
# B of the batched rows (others: 1)
_BATCH = {"h64b8": 8, "h64b4": 4, "h64b2": 2, "gpt2": 8, "bert": 16}


def _shape_inputs(name, t, n, h, kh, dt):
  """``(B, (q, k, v, do))``: a ``_FWD_SHAPES`` row's batch and random inputs."""
  b = _BATCH.get(name.split()[0], 1)
  return b, random_inputs(b, t, n, h, kv_heads=kh, dtype=dt)


def variants(*opts):
  """Ours against cuDNN (and upstream's Mosaic GPU FA3 in fp16), interleaved timing; words
  select shapes by their first word (e.g. ``docs window``), and ``field=v1,v2`` compiles our
  kernel once per value of the ``pallas_mosaic_gpu.Variants`` field and times every variant in
  the same run."""
  switches = _variants(opts)
  only = [o for o in opts if "=" not in o]
  from jax.experimental.pallas.ops.gpu import attention_mgpu as up
  for name, t, n, kh, h, mask, kind, dt in _FWD_SHAPES:
    if only and name.split()[0] not in only:
      continue
    b, (q, k, v, _) = _shape_inputs(name, t, n, h, kh, dt)
    seg = (jnp.arange(t, dtype=jnp.int32) // 1024)[None] if kind == "documents" else None
    window = masks.window_width(mask) if kind == "window" else None
    pairs = b * visible_pairs(t, kind, window=window or 0)
    comp = lambda f: _compiled(jax.jit(f), q, k, v)
    ours = lambda q, k, v, be="pallas_mosaic_gpu", bs=None: flash_attention(
        q, k, v, mask=mask, segment_ids=seg, backend=be, block_sizes=bs)
    fns = _ours_each(switches, lambda bs: comp(functools.partial(ours, bs=bs)))
    fns["ours pallas_triton"] = comp(functools.partial(ours, be="pallas_triton"))
    if kind != "documents":  # (cuDNN takes documents only as a dense mask: 30x slower)
      fns["cudnn"] = comp(lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=kind != "full", local_window_size=window and (window, 0),
          implementation="cudnn"))
    if dt == jnp.float16:
      cfg = up.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2,
                            causal=kind == "causal")
      try:
        fns["upstream attention_mgpu"] = comp(lambda q, k, v: up.attention(q, k, v, cfg))
      except Exception as e:
        print(f"{name}: upstream failed {type(e).__name__}: {str(e)[:200]}")
    _time_against_cudnn(name, fns, (q, k, v), 4 * n * pairs * h)


def step(*opts):
  """A ring step's forward at 8k tokens per GPU (N=16, H=128, bf16, dense, float32 outputs, as
  the ring runs it): the kernel alone and merging into a running (o, lse), against the forward
  of one GPU doing the step's work as one call (``flash_attention``); ``field=v1,v2`` compiles
  our kernel once per ``Variants`` value; all timed interleaved."""
  from pallas_ring import block_sparse, pair, plans
  from pallas_ring.kernels import common, pallas_mosaic_gpu, tuning
  b, t, n, h = 1, 8192, 16, 128
  q, k, v, _ = random_inputs(b, t, n, h)
  info = block_sparse.make_token_info(t, b)
  ops = common.Operands(info, info)

  def compile_step(bs, merge):
    tiles = tuning.resolve("pallas_mosaic_gpu", bs, t, t, h)
    cfg = pair.kernel_config(tiles, mask=masks.Full(), scale=h ** -0.5, softcap=None,
                             q_len=t, kv_len=t, out_dtype=jnp.float32, interpret=False)
    plan = plans.on_device(ops, cfg)
    acc = common.Partial(*pallas_mosaic_gpu.forward(q, k, v, ops, plan, cfg)) if merge else None
    return _compiled(jax.jit(lambda q, k, v: pallas_mosaic_gpu.forward(q, k, v, ops, plan, cfg,
                                                                        acc)), q, k, v)

  fns = {}
  for name, merge in (("alone", False), ("merging", True)):
    for label, fn in _ours_each(_variants(opts), lambda bs: compile_step(bs, merge)).items():
      fns[f"{name} {label.removeprefix('ours pallas_mosaic_gpu')}".strip()] = fn
  fns["flash_attention 8k x 8k"] = _compiled(jax.jit(flash_attention), q, k, v)
  _time_against_cudnn("ring step 8k", fns, (q, k, v), 4 * n * t * t * h)


def _gradients_ok(q, k, v, kw, key):
  do = jax.random.normal(key, q.shape, jnp.float32)

  def grad_of(backend, *args, bs=None):
    loss = lambda q, k, v: jnp.sum(flash_attention(q, k, v, backend=backend, block_sizes=bs,
                                                   **kw).astype(jnp.float32) * do)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)

  pair = BlockSizes(variants=Variants(deterministic=True))  # (bitwise reproducible)
  default, reproducible, again = (grad_of("pallas_mosaic_gpu", q, k, v, bs=bs)
                                  for bs in (None, pair, pair))
  ref = grad_of("xla", *(x.astype(jnp.float32) for x in (q, k, v)))
  # ||got - ref|| / max(||ref||, 1): with one key the softmax has no logit gradient, so
  # dq = dk = 0 and their error is absolute.
  norm = lambda x: float(np.linalg.norm(np.asarray(x, np.float64)))
  errs = [norm(np.asarray(a, np.float64) - np.asarray(b, np.float64)) / max(norm(b), 1.0)
          for got in (default, reproducible) for a, b in zip(got, ref)]
  same = all(bool(jnp.array_equal(a, b)) for a, b in zip(reproducible, again))
  nan = any(bool(jnp.isnan(g.astype(jnp.float32)).any()) for g in (*default, *reproducible))
  return (max(errs) < 2e-2 and same and not nan,
          f"dq dk dv (default, then reproducible) {' '.join('%.2e' % e for e in errs)} "
          f"reproducible {same} nan {nan}")


def grads(*names):
  """Gradients of every CASE (or those named; "f32": the float32 outputs) through the Mosaic GPU
  backward (its default and its reproducible pair) against the xla backend, and the pair's
  run-to-run bitwise equality."""
  fails = _each_case(_gradients_ok, names)
  if not names or "f32" in names:
    fails += _float32_outputs()
  if not names or "rowterm" in names:
    fails += _row_terms()
  print("FAILURES", fails)


def _contract_call(h, out_dtype, seg=None, variants=None):
  """A direct call of the Mosaic GPU lowering's contract (B=2, T=1024, N=4, K=2, causal, segment
  ids ``seg`` or none, kernel ``variants``): ``(q, k, v, do, ops, cfg, o, lse, plan)``, o and
  lse from its forward and ``plan`` for the backward."""
  from pallas_ring import block_sparse, pair, plans
  from pallas_ring.kernels import common, pallas_mosaic_gpu, tuning
  b, t, n, kh = 2, 1024, 4, 2
  q, k, v, do = random_inputs(b, t, n, h, kv_heads=kh)
  tiles = tuning.resolve("pallas_mosaic_gpu", BlockSizes(variants=variants), t, t, h)
  cfg = pair.kernel_config(tiles, mask=masks.Causal(), scale=h ** -0.5, softcap=None,
                           q_len=t, kv_len=t, out_dtype=out_dtype, interpret=False)
  info = block_sparse.make_token_info(t, b, segment_ids=seg)
  ops = common.Operands(info, info)
  o, lse = pallas_mosaic_gpu.forward(q, k, v, ops, plans.on_device(ops, cfg), cfg)
  return q, k, v, do, ops, cfg, o, lse, plans.on_device(ops, cfg, backward=True)


def _row_terms():
  """The backward given ``delta`` as a ``RowTerm`` (the dQ kernel computes it from o, minus
  dlse when given) against the same call given the array ``row_delta``: causal, documents with
  GQA (masked tiles), H=256 (the wide kernels); gradients and bitwise equality of each (the
  reproducible pair: the fused kernel has no dQ kernel)."""
  from pallas_ring.kernels import common, pallas_mosaic_gpu
  fails = 0
  for h, segs in ((128, False), (128, True), (256, False)):
    key = jax.random.key(h + segs)
    seg = _segments(key, 1024, 1024, segs).get("segment_ids")
    q, k, v, do, ops, cfg, o, lse, plan = _contract_call(h, jnp.bfloat16, seg,
                                                         Variants(deterministic=True))
    dlse = jax.random.normal(key, lse.shape, jnp.float32)
    bwd = lambda d: pallas_mosaic_gpu.backward(q, k, v, do, lse, d, ops, plan, cfg)
    for what, d in (("no dlse", None), ("dlse", dlse)):
      ref = bwd(common.row_delta(o, do, d))
      got, again = bwd(common.RowTerm(o, d)), bwd(common.RowTerm(o, d))
      errs = [rel(a.astype(jnp.float32), r.astype(jnp.float32)) for a, r in zip(got, ref)]
      same = all(bool(jnp.array_equal(a, b)) for a, b in zip(got, again))
      print(f"RowTerm H={h} documents={segs} {what}: dq dk dv rel err vs array delta "
            f"{' '.join('%.2e' % e for e in errs)} deterministic {same}", flush=True)
      fails += max(errs) > 1e-2 or not same
  return fails


def _float32_outputs():
  """The ring's backward passes write float32 dq/dk/dv (``out_dtype``): the kernels' float32
  output staging against the xla lowering on the same lse and delta (H=128; H=256: the wide
  kernels, whose staging aliases the walked slots)."""
  from pallas_ring.kernels import common, pallas_mosaic_gpu, xla
  fails = 0
  for h in (128, 256):
    q, k, v, do, ops, cfg, o, lse, plan = _contract_call(h, jnp.float32)
    delta = common.row_delta(o, do)
    got = pallas_mosaic_gpu.backward(q, k, v, do, lse, delta, ops, plan, cfg)
    f32 = lambda x: x.astype(jnp.float32)
    ref = xla.backward(f32(q), f32(k), f32(v), f32(do), lse, delta, ops, plan, cfg)
    errs = [rel(a, r) for a, r in zip(got, ref)]
    dtypes = {str(a.dtype) for a in got}
    print(f"float32 outputs H={h} {dtypes} dq dk dv rel err "
          f"{' '.join('%.2e' % e for e in errs)}", flush=True)
    fails += max(errs) > 1e-2 or dtypes != {"float32"}
  return fails


_BWD_SHAPES = [  # name, T, N, K, H, mask, kind (for bench.visible_pairs)
    ("dense T=16k", 16384, 16, 16, 128, None, "full"),
    ("causal T=16k", 16384, 16, 16, 128, masks.Causal(), "causal"),
    ("gqa 32/8 T=8k", 8192, 32, 8, 128, masks.Causal(), "causal"),
    ("h64 T=16k", 16384, 16, 16, 64, masks.Causal(), "causal"),
    ("h256 T=8k", 8192, 16, 16, 256, masks.Causal(), "causal"),
    ("docs 16x1024", 16384, 16, 16, 128, masks.Causal(), "documents"),
    ("dense4k T=4k", 4096, 16, 16, 128, None, "full"),
    ("causal4k T=4k", 4096, 16, 16, 128, masks.Causal(), "causal")]


def _bwd_cases(only):
  """``(name, (T, N, H, mask, kind), (q, k, v, do), segment_ids)`` of the timed shapes whose
  name's first word is in ``only`` (all when empty); B=1, bf16, random inputs."""
  for name, t, n, kh, h, mask, kind in _BWD_SHAPES:
    if not only or name.split()[0] in only:
      seg = (jnp.arange(t, dtype=jnp.int32) // 1024)[None] if kind == "documents" else None
      yield name, (t, n, h, mask, kind), random_inputs(1, t, n, h, kv_heads=kh), seg


def bwd(*opts):
  """Forward+backward: ours (Mosaic GPU both passes; Triton) against cuDNN, interleaved.

  ``field=v1,v2`` compares ``Variants`` in one run (e.g. ``dq_walk_rows=64,128``,
  ``wide_dkv_above=64``: the wide dK/dV kernel from H=128); other words select shapes by their
  first word (e.g. ``dense h64``).
  """
  switches = _variants(opts)
  only = [o for o in opts if "=" not in o]
  for name, (t, n, h, mask, kind), (q, k, v, do), seg in _bwd_cases(only):
    pairs = visible_pairs(t, kind)
    ours = lambda q, k, v, be="pallas_mosaic_gpu", bs=None: flash_attention(
        q, k, v, mask=mask, segment_ids=seg, backend=be, block_sizes=bs)
    fns = _ours_each(switches, lambda bs: _compiled(bench.fwd_bwd(functools.partial(ours, bs=bs)),
                                                    q, k, v, do))
    fns["ours pallas_triton"] = bench.fwd_bwd(functools.partial(ours, be="pallas_triton"))
    if kind != "documents":
      fns["cudnn"] = bench.fwd_bwd(lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=kind != "full", implementation="cudnn"))
    _time_against_cudnn(name, fns, (q, k, v, do), 4 * 3.5 * n * pairs * h)


def parts(out_dir="/tmp/trace", *only):
  """Device time per kernel of one forward+backward (Mosaic GPU; with the word ``fwd``: forward
  only), from a profiler trace: our kernels and the XLA ops around them (plan, delta, casts),
  over 10 calls, and the span from the first op's start to the last one's end per call; with
  the word ``fp8``: q, k, v quantized to float8_e4m3fn (``quantize=``), the FP8 kernels."""
  fwd_only = "fwd" in only
  quantize = jnp.float8_e4m3fn if "fp8" in only else None
  only = [o for o in only if o not in ("fwd", "fp8")]
  for name, (_, _, _, mask, _), (q, k, v, do), seg in _bwd_cases(only or ("dense", "causal",
                                                                          "docs")):
    attn = lambda q, k, v: flash_attention(q, k, v, mask=mask, segment_ids=seg,
                                           backend="pallas_mosaic_gpu", quantize=quantize)
    f, args = (jax.jit(attn), (q, k, v)) if fwd_only else (bench.fwd_bwd(attn), (q, k, v, do))
    tag = " fp8" if quantize else ""
    profile(name + tag, f, args, f"{out_dir}/{name.split()[0]}{tag.replace(' ', '_')}")


def profile(name, f, args, d, calls=10):
  """Prints the device time per kernel of ``f(*args)`` (jitted) on the first GPU, from a
  profiler trace of ``calls`` calls written under ``d``: each op's mean time per call with its
  HLO instruction, the Mosaic GPU kernels in launch order, and the span per call."""
  jax.block_until_ready(f(*args))
  with jax.profiler.trace(d):
    for _ in range(calls):
      r = f(*args)
    jax.block_until_ready(r)
  per, kernels = collections.Counter(), []
  events = bench.trace_events(d)[0]
  if not events:
    print(f"{name}: the trace holds no GPU events", flush=True)
    return
  for e in events:
    per[e["name"][:70]] += e.get("dur", 0) / calls
    if "mosaic" in e["name"]:
      kernels.append(e.get("dur", 0))
  total = sum(per.values())
  span = (max(e["ts"] + e.get("dur", 0) for e in events) - events[0]["ts"]) / calls
  nk = len(kernels) // calls  # Mosaic GPU kernels per call
  means = [statistics.mean(kernels[i::nk]) for i in range(nk)]
  print(f"{name}: {total / 1e3:.3f} ms of GPU time, {span / 1e3:.3f} ms span per call "
        f"(first GPU); Mosaic GPU kernels in launch order, mean of {calls} "
        f"calls: {' '.join('%.1f us' % d for d in means)}", flush=True)
  count = collections.Counter(e["name"][:70] for e in events)
  print(f"  {len(events) / calls:.0f} GPU ops per call", flush=True)
  hlo = _hlo_lines(f, args, f"{d}/optimized_hlo.txt")
  for kname, us in per.most_common(40):
    print(f"  {us:9.1f} us  {count[kname] / calls:4.0f}x  {kname}", flush=True)
    if "mosaic" not in kname and kname in hlo:
      print(f"      {hlo[kname][:150]}", flush=True)


def _picked(name, dtype, only) -> bool:
  """Whether words ``only`` select a ``_FWD_SHAPES`` row: its name's first word, and for a
  float16 twin (``dense T=16k fp16``) the word ``fp16`` too."""
  return name.split()[0] in only and (dtype != jnp.float16 or "fp16" in only)


def spans(*only):
  """Ours (Mosaic GPU) against cuDNN timed on the device (``bench.clock("device")``): each
  shape twice, in batches of at least 50 ms (sustained load, as ``bench``) and as calls
  synchronized one at a time (40 each); median and quartiles. Words: ``fwd`` (forward, the
  default) and/or ``bwd`` (forward+backward), and shapes by their first word (default: dense,
  causal; their float16 twins with ``fp16``)."""
  passes = [p for p in ("fwd", "bwd") if p in only] or ["fwd"]
  switches = _variants(only)
  only = [o for o in only if o not in ("fwd", "bwd") and "=" not in o] or ["dense", "causal"]
  for pass_ in passes:
    for name, t, n, kh, h, mask, kind, dt in _FWD_SHAPES:
      if not _picked(name, dt, only):
        continue
      b, (q, k, v, do) = _shape_inputs(name, t, n, h, kh, dt)
      seg = (jnp.arange(t, dtype=jnp.int32) // 1024)[None] if kind == "documents" else None
      window = masks.window_width(mask) if kind == "window" else None
      args = (q, k, v) if pass_ == "fwd" else (q, k, v, do)
      comp = lambda f: _compiled(jax.jit(f) if pass_ == "fwd" else bench.fwd_bwd(f), *args)
      ours = lambda q, k, v, bs: flash_attention(q, k, v, mask=mask, segment_ids=seg,
                                                 backend="pallas_mosaic_gpu", block_sizes=bs)
      fns = {label.removeprefix("ours pallas_mosaic_gpu").strip() or "ours": f
             for label, f in _ours_each(
                 switches, lambda bs: comp(functools.partial(ours, bs=bs))).items()}
      if kind != "documents":
        fns["cudnn"] = comp(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=kind != "full", local_window_size=window and (window, 0),
            implementation="cudnn"))
      flops = 4 * b * n * visible_pairs(t, kind, window=window or 0) * h * (
          1 if pass_ == "fwd" else 3.5)
      _span_rows(f"{pass_} {name}", {i: (f, args) for i, f in fns.items()}, flops, "cudnn")


def _span_rows(title, calls, flops, base):
  """Times ``calls`` (label -> (compiled function, its arguments)) interleaved on the device
  clock, in batches of at least 50 ms and as calls synchronized one at a time (40 each), and
  prints each one's median (quartiles), TFLOP/s and the ratio of ``base``'s time to it."""
  for how, batch_s, iters, reps in (("batches", bench.MIN_BATCH_S, 10, 8),
                                    ("one call", 0.0, 1, 40)):
    with bench.clock("device"):
      samples = bench.interleaved_samples(calls, iters=iters, reps=reps, min_batch_s=batch_s)
    q1q3 = {i: np.percentile(ts, (25, 50, 75)) * 1e3 for i, ts in samples.items()}
    for impl, (lo, med, hi) in q1q3.items():
      vs = f"  vs {base} {q1q3[base][1] / med:.3f}x" if base in q1q3 else ""
      print(f"{title:22s} {how:8s} {impl:14s} {med:.3f} ms ({lo:.3f}-{hi:.3f}) "
            f"{flops / med / 1e9:5.0f} TFLOP/s, {len(samples[impl])} samples{vs}", flush=True)


_FEATURES = {  # name: keyword arguments of flash_attention for (N, T)
    "alibi": lambda n, t: dict(alibi_slopes=2.0 ** -jnp.arange(1, n + 1, dtype=jnp.float32)),
    "dropout": lambda n, t: dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)),
    # a bfloat16 bias shared by the heads (its gradient: XLA's, for every lowering)
    "bias": lambda n, t: dict(bias=jax.random.normal(jax.random.key(1), (1, 1, t, t),
                                                     jnp.bfloat16)),
    # a dense mask hiding 10% of the pairs at random: every tile is partial
    "dense": lambda n, t: dict(dense_mask=jax.random.uniform(jax.random.key(2), (1, 1, t, t))
                               < 0.9)}


def _with_arrays(f, kw, pass_="bwd"):
  """``(step, arrays)``: ``step(q, k, v, *arrays)`` jitted, ``f(q, k, v, **kw)`` (``pass_``
  "fwd") or ``(that, its vjp at do)`` from ``step(q, k, v, do, *arrays)``; the array keyword
  arguments are passed as arguments (a closed-over bias would be a constant of the program)."""
  names = sorted(i for i, x in kw.items() if isinstance(x, jax.Array))
  g = lambda q, k, v, *x: f(q, k, v, **{**kw, **dict(zip(names, x))})

  def fwd_bwd(q, k, v, do, *x):  # (bench.fwd_bwd with the extra arguments)
    out, vjp = jax.vjp(lambda q, k, v: g(q, k, v, *x), q, k, v)
    return out, vjp(do)

  return jax.jit(g if pass_ == "fwd" else fwd_bwd), tuple(kw[i] for i in names)


def features(*only):
  """The cost of ALiBi, dropout, a bias and a dense mask in the Mosaic GPU kernels: each against
  the plain kernel in the same interleaved run (``_span_rows``; ratios: plain time / time),
  beside the Triton kernels with the feature and cuDNN without it. Words: ``fwd`` and/or
  ``bwd`` (default: bwd, forward+backward), feature names (default: all), shapes by their
  first word (default: causal, dense; float16 twins with ``fp16``), and ``field=v1,v2`` to time
  each feature once per value of that ``Variants`` field (then without the Triton kernels)."""
  passes = [p for p in ("fwd", "bwd") if p in only] or ["bwd"]
  feats = [f for f in _FEATURES if f in only] or list(_FEATURES)
  settings = _variants(only)
  only = [o for o in only if o not in ("fwd", "bwd", *_FEATURES) and not _is_variant(o)] or [
      "causal", "dense"]
  for pass_ in passes:
    for name, t, n, kh, h, mask, kind, dt in _FWD_SHAPES:
      if not _picked(name, dt, only) or kind in ("documents", "window"):
        continue
      b, (q, k, v, do) = _shape_inputs(name, t, n, h, kh, dt)
      args = (q, k, v) if pass_ == "fwd" else (q, k, v, do)

      def call(f, **kw):
        """``(compiled, arguments)`` of ``f(q, k, v, **kw)`` (``_with_arrays``)."""
        step, arrays = _with_arrays(f, kw, pass_)
        full = (*args, *arrays)
        return _compiled(step, *full), full

      attn = lambda be, bs=None: lambda q, k, v, **kw: flash_attention(
          q, k, v, mask=mask, backend=be, block_sizes=bs, **kw)
      calls = {"plain": call(attn("pallas_mosaic_gpu"))}
      for feat in feats:
        kw = _FEATURES[feat](n, t)
        for label, v in zip(*settings):
          calls[f"{feat} {label}".strip()] = call(
              attn("pallas_mosaic_gpu", BlockSizes(variants=v)), **kw)
        if settings[0] == [""]:
          calls[f"triton {feat}"] = call(attn("pallas_triton"), **kw)
      calls["cudnn"] = call(lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=kind != "full", implementation="cudnn"))
      flops = 4 * b * n * visible_pairs(t, kind) * h * (1 if pass_ == "fwd" else 3.5)
      _span_rows(f"{pass_} {name}", calls, flops, "plain")


def _hlo_lines(f, args, path):
  """``{kernel name: its HLO instruction}`` of the jitted ``f``'s optimized module (kernel names
  are instruction names with dots as underscores); the whole text goes to ``path``."""
  text = f.lower(*args).compile().as_text()
  with open(path, "w") as fh:
    fh.write(text)
  lines = {}
  for line in text.splitlines():
    lhs, sep, _ = line.strip().partition(" = ")
    if sep:
      lines.setdefault(lhs.removeprefix("ROOT ").lstrip("%").replace(".", "_"), line.strip())
  return lines


def calls(*opts):
  """Two forward+backward calls (Mosaic GPU) per shape, for an outside profiler: with one
  shape, ``ncu --kernel-name regex:mosaic --launch-skip 2 --launch-count 2`` profiles the second
  call's two kernels (forward, fused dK/dV; three where the reproducible pair runs: forward, dQ,
  dK/dV, ``tiles.fused_backward``). Words select shapes as in ``spans`` (default: dense), one
  ``Variants`` setting and one feature of ``features`` (e.g. ``alibi``; its arrays are
  arguments, not constants; ``dense`` names the shape here, ``dense_mask`` the dense mask), and
  ``fp8``: q, k, v quantized to float8_e4m3fn (``quantize=``), the FP8 kernels. Other words
  stop it (a profile of the default shape under another's name would mislead)."""
  shapes = {name.split()[0] for name, *_ in _FWD_SHAPES}
  unknown = [o for o in opts if o not in shapes | set(_FEATURES) | {"dense_mask", "fp8", "fp16"}
             and not _is_variant(o)]
  if unknown:
    raise SystemExit(f"calls: unknown words {unknown}; shapes: {' '.join(sorted(shapes))}; "
                     f"features: {' '.join(_FEATURES)}, dense_mask; fp8, fp16; field=value")
  feats = ["dense" if o == "dense_mask" else o for o in opts
           if o == "dense_mask" or (o in _FEATURES and o not in shapes)]
  only = [o for o in opts if o in shapes or o == "fp16"] or ["dense"]
  quantize = jnp.float8_e4m3fn if "fp8" in opts else None
  (variants,) = _variants(opts)[1]
  for name, t, n, kh, h, mask, kind, dt in _FWD_SHAPES:
    if not _picked(name, dt, only):
      continue
    _, (q, k, v, do) = _shape_inputs(name, t, n, h, kh, dt)
    seg = (jnp.arange(t, dtype=jnp.int32) // 1024)[None] if kind == "documents" else None
    feature = _FEATURES[feats[0]](n, t) if feats else {}
    f, arrays = _with_arrays(lambda q, k, v, **kw: flash_attention(
        q, k, v, mask=mask, segment_ids=seg, backend="pallas_mosaic_gpu", quantize=quantize,
        block_sizes=BlockSizes(variants=variants), **kw), feature)
    for _ in range(2):
      jax.block_until_ready(f(q, k, v, do, *arrays))
    print(f"{name} {' '.join(feats)}{' fp8' if quantize else ''}: two forward+backward calls",
          flush=True)


if __name__ == "__main__":
  print(jax.__version__, jax.devices()[0].device_kind, flush=True)
  mode, opts = sys.argv[1], sys.argv[2:]
  {"correct": correct, "tiles": tiles, "sparse_tiles": sparse_tiles, "variants": variants,
   "grads": grads,
   "bwd": bwd, "parts": parts, "calls": calls, "step": step, "spans": spans,
   "features": features}[mode](*opts)
