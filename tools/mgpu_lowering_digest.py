"""Digests of the Mosaic GPU kernels' lowered code, cross-lowered for CUDA on this host (no GPU).

A refactor of ``pallas_ring/kernels/pallas_mosaic_gpu`` that must not change the generated code
is checked by running this before and after it and comparing::

    python tools/mgpu_lowering_digest.py --out before.json       # ~10-20 min on 2 cores
    python tools/mgpu_lowering_digest.py --out after.json
    python tools/mgpu_lowering_digest.py --compare before.json after.json
    python tools/mgpu_lowering_digest.py --only fused --out x.json   # names containing "fused"

Each configuration (forward, gradients, the ring's accumulating entry points, with the masks,
score terms, head dims and kernel variants of ``tests/test_pallas_mosaic_gpu.py``) is lowered
with ``lowering_platforms=("cuda",)``. Every Mosaic GPU kernel in it (the MLIR bytecode in its
custom call's backend config) is parsed and printed without debug info (locations carry source
lines and Python names), and the program around them is printed without debug info, its
kernels replaced by their digests. A configuration's digest is the SHA-256 of that text; its
kernels' digests are listed too, so a difference names the kernel that changed. The backward
is the reproducible pair (``Variants(deterministic=True)``, the default before 2026-11-29) in
every configuration but those named ``fused``, so that a name keeps its kernels across commits.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"  # (the ring's mesh)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# This checkout's pallas_ring (before an installed or editable one), and tests/conftest.py.
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "tests")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax._src.interpreters import mlir as jax_mlir  # noqa: E402
from jax.experimental.mosaic.gpu import dialect as mgpu_dialect  # noqa: E402
from jaxlib.mlir import ir  # noqa: E402

from pallas_ring import BlockSizes, flash_attention, masks  # noqa: E402
from pallas_ring.decode import decode_attention  # noqa: E402
from pallas_ring.kernels.pallas_mosaic_gpu import Variants  # noqa: E402
from conftest import ring_step  # noqa: E402  (tests/conftest.py)
# name: (mask, T, S, N, K, H, dtype, segments, softcap), and v's head dim where it is not H
from test_pallas_mosaic_gpu import CASES, HV  # noqa: E402

BACKEND = "pallas_mosaic_gpu"


def _structs(name):
  """``(q, k, v, *segment ids)`` shapes and the call's keywords (mask, soft-cap) of a case."""
  mask, t, s, n, kh, h, dt, segs, cap = CASES[name]
  sd = jax.ShapeDtypeStruct
  args = (sd((2, t, n, h), dt), sd((2, s, kh, h), dt), sd((2, s, kh, HV.get(name, h)), dt))
  seg = (sd((2, t), jnp.int32), sd((2, s), jnp.int32)) if segs else ()
  return args + seg, dict(mask=mask, softcap=cap)


def _pinned(**variants) -> Variants:
  """``Variants(**variants)`` with the reproducible backward unless they say otherwise."""
  return Variants(**{"deterministic": True, **variants})


def _attention(kw, **variants):
  """``f(q, k, v, *segment_ids)``: flash_attention on the Mosaic GPU kernels (the reproducible
  backward unless ``variants`` say otherwise)."""
  bs = BlockSizes(variants=_pinned(**variants))

  def f(q, k, v, *seg):
    extra = dict(segment_ids=seg[0], kv_segment_ids=seg[1]) if seg else {}
    return flash_attention(q, k, v, backend=BACKEND, interpret=False, block_sizes=bs, **extra,
                           **kw)

  return f


def _grad(f):
  return jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1, 2))


def _terms(name, rate=0.1, alibi=True, bias=False, dense=False, seed=3):
  """Score-term keywords of a case: ALiBi slopes, dropout at ``rate``, a per-head bias (float32,
  or ``bias``'s dtype where it is one) and a dense mask broadcast over the batch."""
  _, t, s, n = CASES[name][:4]
  rng = np.random.default_rng(seed)
  kw = {}
  if alibi:
    kw["alibi_slopes"] = np.linspace(0.05, 0.5, n, dtype=np.float32)
  if rate:
    kw.update(dropout_rate=rate, dropout_rng=jax.random.key(seed))
  if bias:
    kw["bias"] = jnp.asarray(rng.standard_normal((1, n, t, s)),
                             np.float32 if bias is True else bias)
  if dense:
    kw["dense_mask"] = jnp.asarray(rng.random((1, 1, t, s)) < 0.7)
  return kw


def _row_term(head_dim, dlse, in_dq):
  """The backward alone given delta as a ``common.RowTerm`` (the dQ kernel computes it)."""
  from pallas_ring import block_sparse, pair, plans
  from pallas_ring.kernels import common, pallas_mosaic_gpu, tuning
  b, t, n, kh = 2, 256, 4, 2
  sd = jax.ShapeDtypeStruct
  q, k = sd((b, t, n, head_dim), jnp.bfloat16), sd((b, t, kh, head_dim), jnp.bfloat16)
  tiles = tuning.resolve(BACKEND, BlockSizes(variants=_pinned(delta_in_dq=in_dq)), t, t,
                         head_dim)
  cfg = pair.kernel_config(tiles, mask=masks.Causal(), scale=0.1, softcap=None, q_len=t,
                           kv_len=t, out_dtype=jnp.bfloat16, interpret=False)

  def grads(q, k, v, do, lse, o, *dlse):
    info = block_sparse.make_token_info(t, b)
    ops = common.Operands(info, info)
    plan = plans.on_device(ops, cfg, backward=True)
    return pallas_mosaic_gpu.backward(q, k, v, do, lse, common.RowTerm(o, *dlse), ops, plan, cfg)

  return grads, (q, k, k, q, sd((b, n, t), jnp.float32), q,
                 *([sd((b, n, t), jnp.float32)] if dlse else []))


def _ring_attention(head_dim):
  """The ring's gradients over two devices (its steps merge into running results)."""
  from jax.sharding import Mesh, PartitionSpec as P
  from pallas_ring import ring_attention
  mesh = Mesh(jax.devices()[:2], ("sp",))

  def loss(q, k, v):
    ring = lambda q, k, v: ring_attention(
        q, k, v, axis_name="sp", mask=masks.Causal(), layout="zigzag", backend=BACKEND,
        interpret=False, block_sizes=BlockSizes(variants=_pinned()))
    o = jax.shard_map(ring, mesh=mesh, in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp"),
                      check_vma=False)(q, k, v)
    return jnp.sum(o.astype(jnp.float32))

  x = jax.ShapeDtypeStruct((1, 512, 2, head_dim), jnp.bfloat16)
  return jax.grad(loss, argnums=(0, 1, 2)), (x, x, x)


def _decode(n, kh, h):
  sd = jax.ShapeDtypeStruct
  args = (sd((2, 1, n, h), jnp.bfloat16), sd((2, 4096, kh, h), jnp.bfloat16),
          sd((2, 4096, kh, h), jnp.bfloat16), sd((2,), jnp.int32))
  f = lambda q, k, v, n: decode_attention(q, k, v, kv_lengths=n, backend=BACKEND,
                                          interpret=False, block_sizes=BlockSizes(kv_splits=8))
  return f, args


def _ring_step(name, **variants):
  step, _, args = ring_step(CASES[name], BACKEND, interpret=False,
                            variants=_pinned(**variants))
  return step, args


@dataclasses.dataclass(frozen=True)
class Config:
  """One lowering: ``make() -> (fn, args)``, optionally under x64 or warpgroup semantics."""

  name: str
  make: object
  x64: bool = False
  warpgroup: bool = False


def configs() -> list[Config]:
  """The configurations digested (names are stable: they key the JSON)."""
  out = []
  add = lambda name, make, **kw: out.append(Config(name, make, **kw))

  def fwd(name, kw=None, **v):
    args, base = _structs(name)
    return _attention({**base, **(kw or {})}, **v), args

  def grad(name, kw=None, **v):
    f, args = fwd(name, kw, **v)
    return _grad(f), args

  for name in CASES:
    add(f"grad/{name}", functools.partial(grad, name))
    add(f"ring_step/{name}", functools.partial(_ring_step, name))
  for name in ("causal_gqa", "documents", "h256", "one_token", "full_odd_lengths"):
    add(f"fwd/{name}", functools.partial(fwd, name))
  # Score terms (ALiBi split under causal masks, unsplit under Full; dropout; bias; dense mask).
  for name in ("causal_gqa", "h256_documents_gqa_softcap", "softcap_h64", "full_odd_lengths"):
    for label, bias, dense in (("alibi_dropout", False, False), ("bias32_dense", True, True),
                               ("dense", False, True), ("bias16", jnp.bfloat16, False)):
      kw = _terms(name, bias=bias, dense=dense)
      add(f"terms/{name}/{label}", functools.partial(grad, name, kw))
      if name == "causal_gqa":
        add(f"terms_fwd/{name}/{label}", functools.partial(fwd, name, kw))
  for name in ("causal_gqa", "full_odd_lengths", "h256_documents_gqa_softcap", "documents"):
    add(f"terms/{name}/alibi", functools.partial(grad, name, _terms(name, rate=0.0)))
  add("terms/causal_gqa/dropout", functools.partial(
      grad, "causal_gqa", _terms("causal_gqa", alibi=False)))
  add("terms/causal_gqa/bias32", functools.partial(
      grad, "causal_gqa", _terms("causal_gqa", rate=0.0, alibi=False, bias=True)))
  add("terms/causal_gqa/bias16_dense", functools.partial(
      grad, "causal_gqa", _terms("causal_gqa", rate=0.0, alibi=False, bias=jnp.bfloat16,
                                 dense=True)))
  both = _terms("causal_gqa", rate=0.0, alibi=False, bias=jnp.bfloat16, dense=True)
  add("terms/causal_gqa/bias16_dense/stage_bias=False", functools.partial(
      grad, "causal_gqa", both, stage_bias=False))
  add("terms/causal_gqa/bias16_dense/dense_visibility=False", functools.partial(
      grad, "causal_gqa", both, dense_visibility=False))
  add("terms/h256_documents_gqa_softcap/dense/dense_visibility=False", functools.partial(
      grad, "h256_documents_gqa_softcap",
      _terms("h256_documents_gqa_softcap", rate=0.0, alibi=False, dense=True),
      dense_visibility=False))
  add("sinks/causal_gqa", functools.partial(
      grad, "causal_gqa", dict(sinks=jnp.linspace(-1.0, 1.0, 4, dtype=jnp.float32))))
  # The fused backward (deterministic=False).
  for name, terms in (("causal_gqa", False), ("softcap_h64", False), ("window_mqa", False),
                      ("documents", True), ("full_odd_lengths", True), ("h256", False),
                      ("softcap_h64", True), ("causal_gqa", True)):
    kw = _terms(name, bias=True, dense=True) if terms else {}
    add(f"fused/{name}{'/terms' if terms else ''}", functools.partial(
        grad, name, kw, deterministic=False))
  add("fused/causal_gqa/bias16", functools.partial(
      grad, "causal_gqa", _terms("causal_gqa", bias=jnp.bfloat16), deterministic=False))
  add("fused/window_mqa/splits=4", functools.partial(
      grad, "window_mqa", deterministic=False, dkv_head_splits=4))

  def fused_vmap():
    f, args = grad("causal_gqa", deterministic=False)
    return jax.vmap(f), [jax.ShapeDtypeStruct((3, *a.shape), a.dtype) for a in args]

  add("fused/causal_gqa/vmap", fused_vmap)
  add("ring_step_fused/causal_gqa", functools.partial(_ring_step, "causal_gqa",
                                                      deterministic=False))
  add("ring_step_fused/documents", functools.partial(_ring_step, "documents",
                                                     deterministic=False))
  for name, splits in (("window_mqa", 4), ("causal_gqa", 2), ("h256_documents_gqa_softcap", 2)):
    add(f"splits/{name}/{splits}", functools.partial(grad, name, dkv_head_splits=splits))
  for name in ("documents", "h256_documents_gqa_softcap"):
    add(f"x64/grad/{name}", functools.partial(grad, name), x64=True)
    add(f"x64/ring_step/{name}", functools.partial(_ring_step, name), x64=True)
  for h, dlse, in_dq in ((128, False, True), (128, True, True), (256, True, True),
                         (128, False, False)):
    add(f"row_term/h{h}/dlse={dlse}/in_dq={in_dq}", functools.partial(_row_term, h, dlse, in_dq))
  for name, overlap in (("causal_gqa", False), ("documents", True), ("full_odd_lengths", True),
                        ("one_token", True)):
    add(f"overlap_pv={overlap}/{name}", functools.partial(fwd, name, overlap_pv=overlap))
  for order in ("heads", "blocks"):
    for name in ("documents", "window_mqa", "h96_padded_fp16", "one_token"):
      v = dict(persistent=3, item_order=order)
      add(f"persistent/{order}/{name}", functools.partial(fwd, name, **v))
      add(f"persistent/{order}/ring_step/{name}", functools.partial(_ring_step, name, **v))
  for name in ("causal_gqa", "documents", "h256_documents_gqa_softcap", "softcap_h64"):
    add(f"warpgroup/grad/{name}", functools.partial(grad, name), warpgroup=True)
    add(f"warpgroup/ring_step/{name}", functools.partial(_ring_step, name), warpgroup=True)
  for h in (128, 256):
    add(f"ring_attention/h{h}", functools.partial(_ring_attention, h))
  add("decode/gqa", functools.partial(_decode, 32, 8, 128))
  add("decode/mqa", functools.partial(_decode, 16, 1, 128))
  return out


_KERNEL_CTX = None


def _kernel_context():
  global _KERNEL_CTX
  if _KERNEL_CTX is None:
    _KERNEL_CTX = jax_mlir.make_ir_context()
    mgpu_dialect.register_dialect(_KERNEL_CTX)
    _KERNEL_CTX.allow_unregistered_dialects = True
  return _KERNEL_CTX


def _kernel_digest(bytecode: bytes) -> str:
  """SHA-256 of a Mosaic GPU kernel module printed without debug info."""
  with _kernel_context():
    asm = ir.Module.parse(bytecode).operation.get_asm(enable_debug_info=False)
  return hashlib.sha256(asm.encode()).hexdigest()


def _custom_calls(op):
  for region in op.regions:
    for block in region.blocks:
      for child in block.operations:
        if child.operation.name == "stablehlo.custom_call":
          yield child.operation
        yield from _custom_calls(child.operation)


def digest(fn, args) -> dict:
  """``{"digest", "kernels": [kernel digests in program order]}`` of ``fn`` lowered for CUDA."""
  module = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).compiler_ir("stablehlo")
  kernels = []
  with module.context:
    for op in _custom_calls(module.operation):
      if "mhlo.backend_config" not in op.attributes:
        continue
      config = ir.DictAttr(op.attributes["mhlo.backend_config"])
      if "module" not in config:
        continue
      kernels.append(_kernel_digest(ir.StringAttr(config["module"]).value_bytes))
      fields = {config[i].name: config[i].attr for i in range(len(config))}
      fields["module"] = ir.StringAttr.get(kernels[-1])
      fields["kernel_hash"] = ir.StringAttr.get("")
      op.attributes["mhlo.backend_config"] = ir.DictAttr.get(fields)
    text = module.operation.get_asm(enable_debug_info=False)
  return {"digest": hashlib.sha256(text.encode()).hexdigest(), "kernels": kernels}


def run(config: Config) -> dict:
  if config.warpgroup:
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax.experimental.mosaic import gpu as mgpu
    params = plgpu.CompilerParams
    plgpu.CompilerParams = functools.partial(
        params, lowering_semantics=mgpu.LoweringSemantics.Warpgroup)
    jax.clear_caches()
  try:
    with jax.enable_x64(config.x64):
      return digest(*config.make())
  finally:
    if config.warpgroup:
      plgpu.CompilerParams = params
      jax.clear_caches()


def compare(before: str, after: str) -> int:
  """Prints each configuration whose digest differs (and which kernels); returns their count."""
  a, b = (json.load(open(p)) for p in (before, after))
  bad = 0
  for name in sorted(set(a) | set(b)):
    if name not in a or name not in b:
      print(f"{name}: only in {before if name in a else after}")
      bad += 1
    elif a[name]["digest"] != b[name]["digest"]:
      ka, kb = a[name]["kernels"], b[name]["kernels"]
      which = [i for i in range(max(len(ka), len(kb)))
               if i >= len(ka) or i >= len(kb) or ka[i] != kb[i]]
      print(f"{name}: differs (kernels {which} of {len(ka)} / {len(kb)}"
            f"{'; the program around them' if not which else ''})")
      bad += 1
  print(f"{len(set(a) & set(b))} configurations in both, {bad} differ")
  return bad


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", help="JSON file of the digests")
  parser.add_argument("--only", help="only configurations whose name contains this")
  parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
  args = parser.parse_args()
  if args.compare:
    sys.exit(1 if compare(*args.compare) else 0)
  import pallas_ring
  print(f"pallas_ring from {os.path.dirname(pallas_ring.__file__)}", flush=True)
  results = {}
  for config in configs():
    if args.only and args.only not in config.name:
      continue
    start = time.perf_counter()
    results[config.name] = run(config)
    print(f"{config.name}: {results[config.name]['digest'][:16]} "
          f"({len(results[config.name]['kernels'])} kernels, "
          f"{time.perf_counter() - start:.1f} s)", flush=True)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(results, f, indent=1, sort_keys=True)


if __name__ == "__main__":
  main()
