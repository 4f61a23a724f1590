"""The FP8 backward of the Mosaic GPU kernels (Hopper): FP8 q, k, v (and ``quantize=``) run
q.k^T, dO.v^T and p^T dO as FP8 wgmmas in the two deterministic backward kernels, ds's products
in bfloat16 (``kernels/pallas_mosaic_gpu/fp8.py``).

On a CPU machine: every configuration at head dims up to 128 lowers for CUDA to backward kernels
that read FP8; the wide and fused kernels, and ``Variants(fp8_backward=False)``, read the
dequantized values; the host-side operands (dO's quantization per kv head, its transposed
layout) are checked against their definition. Natively (PALLAS_RING_TEST_GPU=1 on sm_90+) the
gradients are checked against the float32 reference on the dequantized values, and for bitwise
reproducibility.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_ring import BlockSizes, flash_attention, masks, quantize_fp8, reference
from pallas_ring.kernels import common, pallas_mosaic_gpu
from pallas_ring.kernels.pallas_mosaic_gpu import Variants, fp8, tiles
from conftest import ON_GPU, rel_err
from test_fp8_forward import F8, _lower, _mosaic_calls, _structs
from test_pallas_mosaic_gpu import CASES, HV

NARROW = [name for name, case in CASES.items() if case[5] <= 128]
WIDE = [name for name, case in CASES.items() if case[5] > 128]
native = pytest.mark.skipif(
    not ON_GPU or not pallas_mosaic_gpu.hopper(),
    reason="runs the Mosaic GPU kernels natively: PALLAS_RING_TEST_GPU=1 on sm_90+")


def _backward_calls(name, dtype=F8, **variants):
  """How many FP8 operands (of ``dtype``) each Mosaic GPU kernel of the gradient of an FP8 call
  reads: the forward's, then the backward's."""
  args, seg, kw = _structs(name, dtype)
  bs = BlockSizes(variants=Variants(**variants)) if variants else None

  def f(q, k, v, qd, kd, vd, *seg):
    extra = dict(segment_ids=seg[0]) if seg else {}
    return flash_attention(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd,
                           backend="pallas_mosaic_gpu", interpret=False, block_sizes=bs,
                           **extra, **kw)

  grad = jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1, 2))
  with pytest.warns(UserWarning, match="FP8"):  # (FP8 operands' own gradients)
    calls = _mosaic_calls(_lower(grad, *args, *seg))
  mlir = {jnp.dtype(F8): "xf8E4M3FN>", jnp.dtype(jnp.float8_e5m2): "xf8E5M2>"}[jnp.dtype(dtype)]
  return [c.count(mlir) for c in calls]


@pytest.mark.ci_cases("causal_gqa", "documents", "softcap_h64", "hv64_documents_fp16")
@pytest.mark.parametrize("name", NARROW)
def test_narrow_head_dims_lower_to_fp8_backward_kernels(name):
  """The forward and the two backward kernels; the dQ kernel reads q, k, v and dO in FP8, the
  dK/dV kernel also dO's transposed copy."""
  assert _backward_calls(name) == [3, 4, 5]


def test_e5m2_lowers_to_fp8_backward_kernels():
  assert _backward_calls("causal_gqa", jnp.float8_e5m2) == [3, 4, 5]


@pytest.mark.ci_cases("h256")
@pytest.mark.parametrize("name", WIDE)
def test_wide_head_dims_take_the_dequantized_values(name):
  """Above head dim 128 (the wide dK/dV kernel) the backward kernels read 16-bit values."""
  assert _backward_calls(name) == [3, 0, 0]


@pytest.mark.parametrize("variants, backward_kernels", [
    (dict(fp8_backward=False, deterministic=True), 2), (dict(fp8_backward=False), 1),
    (dict(deterministic=False), 1)])
def test_variants_that_dequantize(variants, backward_kernels):
  """``fp8_backward=False`` runs the 16-bit kernels on the dequantized values (by default the
  fused one, as 16-bit inputs); the fused kernel (``deterministic=False``) has no FP8 mode."""
  counts = _backward_calls("causal_gqa", **variants)
  assert counts[0] == 3 and counts[1:] == [0] * backward_kernels


def test_fp8_backward_rule():
  cfg = common.KernelConfig(mask=masks.Causal(), scale=1.0, softcap=None, q_len=1, kv_len=1,
                            block_q=128, block_kv=256, block_q_bwd=128, block_kv_bwd=128)
  assert tiles.fp8_backward(cfg, 128, Variants())
  assert tiles.fp8_backward(cfg, 64, Variants())
  assert not tiles.fp8_backward(cfg, 192, Variants())
  assert not tiles.fp8_backward(cfg, 128, Variants(fp8_backward=False))
  assert not tiles.fp8_backward(cfg, 128, Variants(deterministic=False))
  assert tiles.fp8_backward(cfg, 128, Variants(deterministic=True))  # (in the pair)
  assert not tiles.fp8_backward(dataclasses.replace(cfg, interpret=True), 128, Variants())


def test_backward_operands():
  """dO quantized with one descale per batch row and kv head (its group's amax), its copy in
  ``v_layout``; q and k dequantized; ``do_wide`` what the FP8 dO stands for."""
  rng = np.random.default_rng(0)
  b, t, n, kh, h = 2, 64, 4, 2, 64
  q8, qd = quantize_fp8(jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32))
  k8, kd = quantize_fp8(jnp.asarray(rng.standard_normal((b, t, kh, h)), jnp.float32))
  v8, vd = quantize_fp8(jnp.asarray(rng.standard_normal((b, t, kh, h)), jnp.float32))
  do = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32)
  do = do * jnp.asarray([1.0, 3.0, 10.0, 0.5])[None, None, :, None]  # heads of unlike ranges
  descales = jnp.stack([qd, jnp.repeat(kd, 2, 1), jnp.repeat(vd, 2, 1)], -1)  # [B, N, 3]
  ops = fp8.backward_operands(q8, k8, v8, do, descales, jnp.bfloat16)
  amax = np.abs(np.asarray(do)).reshape(b, t, kh, 2 * h).max(axis=(1, 3))  # [B, K]
  want = np.repeat(amax / 448.0, 2, axis=1)
  np.testing.assert_allclose(np.asarray(ops.descales[..., 3]), want, rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(ops.descales[..., :3]), np.asarray(descales))
  assert ops.do.dtype == F8 and rel_err(ops.do_wide, do) < 0.05
  np.testing.assert_array_equal(np.asarray(ops.do_t, np.float32),
                                np.asarray(fp8.v_layout(ops.do), np.float32))
  deq = common.dequantize(q8, k8, v8, descales, jnp.bfloat16)
  for got, want in zip((ops.q, ops.k), deq[:2]):
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def _problem(name, seed):
  mask, t, s, n, kh, h, _, segs, cap = CASES[name]
  rng = np.random.default_rng(seed)
  q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
             for shape in ((2, t, n, h), (2, s, kh, h), (2, s, kh, HV.get(name, h))))
  do = jnp.asarray(rng.standard_normal((2, t, n, HV.get(name, h))), jnp.float32)
  kw = dict(mask=mask, softcap=cap)
  if segs:
    kw["segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 4, (2, t)), axis=1), jnp.int32)
  return (q, k, v), do, kw


@native
@pytest.mark.parametrize("name,f8", [
    *((name, F8) for name in ("causal_gqa", "full_odd_lengths", "window_mqa", "documents",
                              "softcap_h64", "one_token", "hv64_documents_fp16")),
    ("causal_gqa", jnp.float8_e5m2)])
def test_native_fp8_backward_matches_the_dequantized_reference(name, f8):
  """``quantize=``'s gradients (the FP8 forward and backward) against the float32 reference on
  the dequantized values, and close to the dequantized 16-bit backward's; bitwise the same in a
  second run."""
  (q, k, v), do, kw = _problem(name, 3)

  def grads(**variants):
    bs = BlockSizes(variants=Variants(**variants))
    f = jax.jit(lambda *x: flash_attention(*x, quantize=f8, block_sizes=bs, **kw))
    out, vjp = jax.vjp(f, q, k, v)
    return vjp(do.astype(out.dtype))

  deq = [x8.astype(jnp.float32) * d[:, None, :, None]
         for x8, d in (quantize_fp8(x, f8) for x in (q, k, v))]
  _, ref_vjp = jax.vjp(lambda *x: reference.attention(*x, **kw)[0], *deq)
  ref = ref_vjp(do)
  got, again, wide = grads(), grads(), grads(fp8_backward=False)
  for i, (g, g2, w, r) in enumerate(zip(got, again, wide, ref)):
    assert g.dtype == jnp.bfloat16 and not np.any(np.isnan(np.asarray(g, np.float32)))
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(g2, np.float32))
    if name == "one_token" and i < 2:  # dq = dk = 0 exactly; FP8's rounding leaves ~1.5% of dv
      assert np.linalg.norm(np.asarray(g, np.float32)) < 3e-2 * np.linalg.norm(ref[2])
      continue
    # dO's and p's FP8 rounding (about 2% each in e4m3, twice that in e5m2) on top of the
    # forward's
    tol = 0.08 if f8 == F8 else 0.16
    assert rel_err(g, r) < tol, (rel_err(g, r), rel_err(w, r))
    assert rel_err(g, w) < tol, rel_err(g, w)


@native
def test_native_fp8_backward_with_score_terms():
  """ALiBi, a bias and dropout through the FP8 backward (the logit descale reaches the
  position term) against the dequantized 16-bit backward with the same terms."""
  (q, k, v), do, _ = _problem("causal_gqa", 4)
  n, t = q.shape[2], q.shape[1]
  rng = np.random.default_rng(5)
  kw = dict(mask=masks.Causal(), alibi_slopes=jnp.linspace(0.05, 0.5, n),
            bias=jnp.asarray(rng.standard_normal((1, n, t, t)), jnp.bfloat16),
            dropout_rate=0.1, dropout_rng=jax.random.key(1))

  def grads(**variants):
    bs = BlockSizes(variants=Variants(**variants))
    f = jax.jit(lambda *x: flash_attention(*x, quantize=F8, block_sizes=bs, **kw))
    out, vjp = jax.vjp(f, q, k, v)
    return vjp(do.astype(out.dtype))

  for g, w in zip(grads(), grads(fp8_backward=False)):
    assert rel_err(g, w) < 0.08, rel_err(g, w)


@pytest.mark.parametrize("bias", [False, True])
def test_the_rings_backward_steps_read_fp8(bias):
  """``sharded_attention(quantize=)`` over 2 devices lowered for CUDA: every ring step's
  backward kernels read FP8 q, k, v and dO; with a bias (differentiable: its gradient reads q
  and k) they take the dequantized values."""
  from jax.sharding import Mesh
  from pallas_ring import SequenceParallelConfig, sharded_attention
  mesh = Mesh(jax.devices()[:2], ("sp",))
  cfg = SequenceParallelConfig(axis_name="sp", layout="zigzag", backend="pallas_mosaic_gpu")
  x = jax.ShapeDtypeStruct((1, 1024, 2, 128), jnp.bfloat16)
  extra = dict(bias=jnp.zeros((1, 2, 1024, 1024), jnp.bfloat16)) if bias else {}
  ring = lambda *a: sharded_attention(*a, mesh=mesh, config=cfg, mask=masks.Causal(),
                                      interpret=False, quantize=F8, **extra)
  grad = jax.grad(lambda *a: jnp.sum(ring(*a).astype(jnp.float32)), argnums=(0, 1, 2))
  counts = sorted(c.count("xf8E4M3FN>") for c in _mosaic_calls(_lower(grad, x, x, x)))
  # two forward steps (q, k, v); FP8: two dQ (and dO) and two dK/dV (and dO^T) kernels; with a
  # bias, 16-bit: the local pair's dQ and dK/dV, the other step's fused kernel
  assert counts == ([0, 0, 0, 3, 3] if bias else [3, 3, 4, 4, 5, 5]), counts
