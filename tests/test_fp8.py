"""FP8 inputs: ``quantize_fp8`` and the descales / ``out_dtype`` of every entry point, against the
dense reference on the dequantized values."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from pallas_ring import (SequenceParallelConfig, decode_attention, flash_attention, layouts,
                         masks, quantize_fp8, reference, sharded_attention)
from conftest import jaxpr_eqns, rel_err


def _problem(seed, b=2, t=64, n=4, kh=2, h=32):
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.standard_normal(s), jnp.float32)
               for s in ((b, t, n, h), (b, t, kh, h), (b, t, kh, h)))


def _dequantized(x8, descale):
  return x8.astype(jnp.float32) * descale[:, None, :, None]


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_quantize_keeps_each_heads_amax_and_its_precision(dtype):
  x = _problem(1)[1] * jnp.asarray([1.0, 100.0])[None, None, :, None]  # heads of other ranges
  x8, d = quantize_fp8(x, dtype)
  assert x8.dtype == dtype and d.shape == (2, 2) and d.dtype == jnp.float32
  back = _dequantized(x8, d)
  np.testing.assert_allclose(np.max(np.abs(back), axis=(1, 3)), np.max(np.abs(x), axis=(1, 3)),
                             rtol=1e-6)
  mantissa = 3 if dtype == jnp.float8_e4m3fn else 2
  assert rel_err(back, x) < 2.0 ** -mantissa / 2
  z8, dz = quantize_fp8(jnp.zeros((1, 4, 1, 8)), dtype)  # an all-zero head: descale 1, no NaN
  assert float(dz[0, 0]) == 1.0 and not np.any(np.isnan(np.asarray(z8, np.float32)))


def test_a_head_holding_nan_gets_a_nan_descale_that_attention_rejects():
  """No scale represents NaN or infinity: such a head's descale is NaN (it was finite, or
  infinite for infinity), the other heads' are as without it; attention names the descale, and
  under jit, where it cannot read it, gives NaN."""
  x = _problem(2)[1]
  bad = x.at[0, 3, 1, 5].set(jnp.nan).at[1, 0, 0, 0].set(jnp.inf)
  d, d_bad = quantize_fp8(x)[1], quantize_fp8(bad)[1]
  assert np.isnan(d_bad[0, 1]) and np.isnan(d_bad[1, 0])
  np.testing.assert_array_equal(d_bad[0, 0], d[0, 0])
  np.testing.assert_array_equal(d_bad[1, 1], d[1, 1])
  x8, _ = quantize_fp8(x)
  with pytest.raises(ValueError, match="`k_descale` holds values that are not positive"):
    flash_attention(x8, x8, x8, q_descale=d, k_descale=d_bad, v_descale=d, backend="xla")
  out = jax.jit(lambda kd: flash_attention(x8, x8, x8, q_descale=d, k_descale=kd, v_descale=d,
                                           backend="xla"))(d_bad)
  assert np.all(np.isnan(np.asarray(out[0, :, 1], np.float32)))


def test_differentiating_fp8_operands_warns():
  """Gradients of FP8 q, k, v are FP8 (most entries underflow): differentiating them, directly
  or through quantize_fp8, warns; evaluating, or differentiating a 16-bit q against FP8 k, v,
  does not."""
  q, k, v = _problem(7)
  (q8, qd), (k8, kd), (v8, vd) = map(quantize_fp8, (q, k, v))

  def attend(q, k, v, **descales):
    return flash_attention(q, k, v, mask=masks.Causal(), backend="xla",
                           **descales).astype(jnp.float32).sum()

  def quantized(q):
    q8, qd = quantize_fp8(q)
    return attend(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)

  for f, x in ((lambda x: attend(x, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd), q8),
               (lambda x: attend(q8, x, v8, q_descale=qd, k_descale=kd, v_descale=vd), k8),
               (quantized, q)):
    with pytest.warns(UserWarning, match="FP8 q, k or v"):
      jax.grad(f)(x)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    quantized(q)
    jax.grad(lambda x: attend(x, k8, v8, k_descale=kd, v_descale=vd))(q.astype(jnp.bfloat16))


@pytest.mark.ci_cases("xla-None", "pallas_triton-True")
@pytest.mark.parametrize("backend, interpret", [("xla", None), ("pallas_tpu", True),
                                                ("pallas_triton", True)])
def test_quantize_trains_straight_through(backend, interpret):
  """``quantize=``: the forward on FP8 operands, gradients in q's, k's and v's own dtypes at the
  quantized values (the dequantized reference's), against 0.3-0.6 through FP8 operands."""
  q, k, v = (x.astype(jnp.bfloat16) for x in _problem(8))
  do = jnp.asarray(np.random.default_rng(9).standard_normal(q.shape), jnp.float32)
  f = lambda *x: flash_attention(*x, mask=masks.Causal(), backend=backend, interpret=interpret,
                                 quantize=jnp.float8_e4m3fn)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # (no FP8 operand is differentiated)
    out, vjp = jax.vjp(f, q, k, v)
    grads = vjp(do.astype(out.dtype))
  deq = [_dequantized(*quantize_fp8(x)) for x in (q, k, v)]
  ref, ref_vjp = jax.vjp(lambda *x: reference.attention(*x, mask=masks.Causal())[0], *deq)
  assert out.dtype == jnp.bfloat16 and rel_err(out, ref) < 2e-2
  for g, r in zip(grads, ref_vjp(do)):
    assert g.dtype == jnp.bfloat16 and rel_err(g, r) < 2e-2, rel_err(g, r)


def test_quantize_keeps_the_inputs_sharding_on_an_explicit_mesh():
  """Batch-sharded q, k, v on a default (Explicit) mesh: the gradients come back sharded alike."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = jax.make_mesh((2,), ("dp",), axis_types=(AxisType.Explicit,))
  with jax.set_mesh(mesh):
    q, k, v = (jax.device_put(x.astype(jnp.bfloat16), NamedSharding(mesh, P("dp")))
               for x in _problem(11))
    loss = lambda *x: flash_attention(*x, backend="xla", quantize=jnp.float8_e4m3fn).astype(
        jnp.float32).sum()
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  assert all(g.sharding.spec[0] == "dp" and g.dtype == jnp.bfloat16 for g in grads)


@pytest.mark.ci_cases("xla-None", "pallas_triton-True")
@pytest.mark.parametrize("backend, interpret", [("xla", None), ("pallas_tpu", True),
                                                ("pallas_triton", True)])
def test_flash_attention_on_fp8_operands(backend, interpret):
  """Per-(batch, kv head) descales, q's per query head; bfloat16 output by default, forward and
  the gradient of a 16-bit q; the reference runs on the dequantized values."""
  q, k, v = _problem(2)
  (q8, qd), (k8, kd), (v8, vd) = map(quantize_fp8, (q, k, v))
  deq = [_dequantized(*p) for p in ((q8, qd), (k8, kd), (v8, vd))]
  kw = dict(mask=masks.Causal(), backend=backend, interpret=interpret)
  out = flash_attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, **kw)
  ref = reference.attention(*deq, mask=masks.Causal())[0]
  assert out.dtype == jnp.bfloat16 and rel_err(out, ref) < 2e-2
  out32 = flash_attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                          out_dtype=jnp.float32, **kw)
  assert out32.dtype == jnp.float32 and rel_err(out32, ref) < 2e-2
  qb = q.astype(jnp.bfloat16)  # a 16-bit q against FP8 k, v: its gradient
  g = jax.grad(lambda x: jnp.sum(flash_attention(x, k8, v8, k_descale=kd, v_descale=vd,
                                                 **kw).astype(jnp.float32) ** 2))(qb)
  g_ref = jax.grad(lambda x: jnp.sum(reference.attention(x, *deq[1:], mask=masks.Causal())[0]
                                     ** 2))(qb.astype(jnp.float32))
  assert g.dtype == jnp.bfloat16 and rel_err(g, g_ref) < 3e-2


@pytest.mark.parametrize("backend", ["pallas_triton", "pallas_tpu", "xla"])
def test_decode_reads_an_fp8_cache_with_a_16_bit_query(backend):
  """The descales folded into q and the output (``fp8.fold``): the same result as the
  dequantized cache, on the kernel that reads FP8 (Triton's) and those that widen it first."""
  q, k, v = _problem(3, t=128)
  (k8, kd), (v8, vd) = quantize_fp8(k), quantize_fp8(v)
  qb = q[:, -2:].astype(jnp.bfloat16)
  lengths = jnp.asarray([128, 70], jnp.int32)
  out = decode_attention(qb, k8, v8, k_descale=kd, v_descale=vd, kv_lengths=lengths,
                         backend=backend, interpret=backend != "xla" or None)
  ref = decode_attention(qb.astype(jnp.float32), _dequantized(k8, kd), _dequantized(v8, vd),
                         kv_lengths=lengths, backend="xla")
  assert out.dtype == jnp.bfloat16 and rel_err(out, ref) < 2e-2


def test_the_gpu_decode_kernel_reads_the_cache_in_fp8():
  """Lowered for CUDA: one Triton kernel whose cache operands are float8 (half the bytes of a
  bfloat16 cache; nothing widens the cache before it)."""
  sd = jax.ShapeDtypeStruct
  args = (sd((2, 1, 32, 128), jnp.bfloat16), sd((2, 4096, 8, 128), jnp.float8_e4m3fn),
          sd((2, 4096, 8, 128), jnp.float8_e4m3fn), sd((2, 8), jnp.float32),
          sd((2, 8), jnp.float32))
  f = lambda q, k, v, kd, vd: decode_attention(q, k, v, k_descale=kd, v_descale=vd,
                                               backend="pallas_triton", interpret=False)
  text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  calls = [line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line]
  assert len(calls) == 1 and calls[0].count("x8x128xf8E4M3FN>") == 2, calls
  assert "tensor<2x4096x8x128xbf16>" not in text


def test_sharded_ring_on_fp8_operands():
  q, k, v = _problem(4, b=1)
  (q8, qd), (k8, kd), (v8, vd) = map(quantize_fp8, (q, k, v))
  mesh = jax.make_mesh((4,), ("sp",), axis_types=(AxisType.Auto,))
  cfg = SequenceParallelConfig(axis_name="sp", layout="zigzag", backend="xla")
  perm = lambda x: layouts.permute(x, "zigzag", 4)
  out = sharded_attention(perm(q8), perm(k8), perm(v8), q_descale=qd, k_descale=kd,
                          v_descale=vd, mesh=mesh, config=cfg, mask=masks.Causal())
  ref = reference.attention(*(_dequantized(*p) for p in ((q8, qd), (k8, kd), (v8, vd))),
                            mask=masks.Causal())[0]
  assert out.dtype == jnp.bfloat16
  assert rel_err(layouts.unpermute(out, "zigzag", 4), ref) < 2e-2


SHARDED_QUANTIZE = {
    "ring-zigzag-causal": ("ring", "zigzag", masks.Causal()),
    "all_gather-contiguous-causal": ("all_gather", "contiguous", masks.Causal()),
    "ulysses-zigzag-causal": ("ulysses", "zigzag", masks.Causal()),
    "ring-contiguous-window": ("ring", "contiguous", masks.SlidingWindow(8)),  # halo_gather
    "ring-contiguous-chunks": ("ring", "contiguous", masks.ChunkedCausal(16)),  # local shards
}


@pytest.mark.ci_cases("ring-zigzag-causal-xla-None", "ulysses-zigzag-causal-xla-None",
                      "ring-contiguous-window-pallas_triton-True")
@pytest.mark.parametrize("backend, interpret", [("xla", None), ("pallas_triton", True)])
@pytest.mark.parametrize("case", list(SHARDED_QUANTIZE))
def test_sharded_quantize_trains_straight_through(case, backend, interpret):
  """``sharded_attention(quantize=)`` on 4 devices, GQA 4/2: the forward at the quantized values
  (scales over the whole sequence), gradients straight through in the inputs' dtype (xla reads
  FP8: the custom VJPs quantize; Triton: the quantized values in bfloat16), for every path the
  ring takes (ring steps, gathered K/V, Ulysses, halos, shards that see only themselves)."""
  strategy, layout, mask = SHARDED_QUANTIZE[case]
  q, k, v = (x.astype(jnp.bfloat16) for x in _problem(12, b=1))
  do = jnp.asarray(np.random.default_rng(13).standard_normal(q.shape), jnp.float32)
  mesh = jax.make_mesh((4,), ("sp",), axis_types=(AxisType.Auto,))
  cfg = SequenceParallelConfig(axis_name="sp", layout=layout, strategy=strategy,
                               backend=backend)
  perm = lambda x: layouts.permute(x, layout, 4)

  def f(*x):
    out = sharded_attention(*map(perm, x), mesh=mesh, config=cfg, mask=mask,
                            interpret=interpret, quantize=jnp.float8_e4m3fn)
    return layouts.unpermute(out, layout, 4)

  with warnings.catch_warnings():
    warnings.simplefilter("error")  # (no FP8 operand is differentiated)
    out, vjp = jax.vjp(jax.jit(f), q, k, v)
    grads = vjp(do.astype(out.dtype))
  deq = [_dequantized(*quantize_fp8(x)) for x in (q, k, v)]
  ref, ref_vjp = jax.vjp(lambda *x: reference.attention(*x, mask=mask)[0], *deq)
  assert out.dtype == jnp.bfloat16 and rel_err(out, ref) < 2e-2
  for g, r in zip(grads, ref_vjp(do)):
    assert g.dtype == jnp.bfloat16 and rel_err(g, r) < 2e-2, rel_err(g, r)


def _quantized_sends(mask=None):
  """The dtypes ``sharded_attention(quantize=float8_e4m3fn)`` sends by ``ppermute`` on 4
  devices (bfloat16 inputs, xla backend): ``(forward's, gradient's)``."""
  mesh = jax.make_mesh((4,), ("sp",), axis_types=(AxisType.Auto,))
  cfg = SequenceParallelConfig(axis_name="sp", backend="xla")  # (contiguous)
  f = lambda *x: sharded_attention(*x, mesh=mesh, config=cfg, mask=mask,
                                   quantize=jnp.float8_e4m3fn)
  x = jax.ShapeDtypeStruct((1, 64, 2, 32), jnp.bfloat16)
  grad = jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1, 2))
  sent = lambda jaxpr: {str(v.aval.dtype) for e in jaxpr_eqns(jaxpr)
                        if e.primitive.name == "ppermute" for v in e.invars}
  return sent(jax.make_jaxpr(f)(x, x, x).jaxpr), sent(jax.make_jaxpr(grad)(x, x, x).jaxpr)


def test_quantized_ring_sends_fp8_and_its_gradients_wide():
  """Under ``quantize=`` the ring's steps send K/V as FP8 bytes, forward and backward (which
  dequantizes each step's pair), and the backward's dK/dV in float32."""
  assert _quantized_sends() == ({"float8_e4m3fn"}, {"float8_e4m3fn", "float32"})


def test_quantized_halos_travel_as_fp8():
  """Under ``quantize=`` a sliding window's halos (``halo_gather``: K's and V's slices of the
  neighbouring shard) travel as FP8 bytes; their cotangents come back in the inputs' dtype."""
  from pallas_ring import halo, halo_gather
  mask = masks.SlidingWindow(8)
  assert halo_gather.pieces(mask, 64, "contiguous", 4, halo.RingVariants())  # (the halo path)
  assert _quantized_sends(mask) == ({"float8_e4m3fn"}, {"float8_e4m3fn", "bfloat16"})


@pytest.mark.ci_cases(every=True)
@pytest.mark.parametrize("mask", [None, masks.SlidingWindow(8)], ids=["ring", "halos"])
def test_ring_attention_quantize_shares_scales_over_the_ring(mask):
  """``ring_attention(quantize=)`` under ``shard_map``: each shard's K/V of another range (v:
  x1 to x1000), quantized with the ring's maxima, so a step reads another device's FP8 K/V at
  their scale (a sliding window: the halos' FP8 slices, ``halo_gather``)."""
  from jax.sharding import PartitionSpec as P
  from pallas_ring import ring_attention
  q, k, v = _problem(14, b=1)
  ranges = lambda *r: jnp.repeat(jnp.asarray(r), 16)[None, :, None, None]  # per shard of 16
  k, v = k * ranges(1.0, 2.0, 3.0, 4.0), v * ranges(1.0, 10.0, 100.0, 1000.0)
  mesh = jax.make_mesh((4,), ("sp",), axis_types=(AxisType.Auto,))
  f = jax.shard_map(lambda *x: ring_attention(*x, axis_name="sp", backend="xla", mask=mask,
                                              quantize=jnp.float8_e4m3fn),
                    mesh=mesh, in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp"),
                    check_vma=False)
  out = jax.jit(f)(q, k, v)
  ref = reference.attention(*(_dequantized(*quantize_fp8(x)) for x in (q, k, v)), mask=mask)[0]
  assert out.dtype == jnp.float32 and rel_err(out, ref) < 2e-2, rel_err(out, ref)


MISTAKES = {
    "no_descale": (lambda q8, k8, kd: dict(q=q8, k=k8, v=k8, k_descale=kd, v_descale=kd),
                   r"`q` is float8_e4m3fn but `q_descale` is None"),
    "descale_of_another_shape": (lambda q8, k8, kd: dict(q=q8, k=k8, v=k8, q_descale=kd[:1],
                                                         k_descale=kd, v_descale=kd),
                                 r"`q_descale` has shape \(1, 2\); it must be a scalar or \[B, K\]"),
    "descale_of_a_wide_operand": (lambda q8, k8, kd: dict(q=q8.astype(jnp.bfloat16), k=k8,
                                                          v=k8, q_descale=1.0, k_descale=kd,
                                                          v_descale=kd),
                                  r"`q_descale` was given but `q` is bfloat16, not FP8"),
    "zero_descale": (lambda q8, k8, kd: dict(q=q8, k=k8, v=k8, q_descale=0.0, k_descale=kd,
                                             v_descale=kd),
                     r"`q_descale` holds values that are not positive and finite \(e.g. 0.0\)"),
    "fp8_output": (lambda q8, k8, kd: dict(q=q8, k=k8, v=k8, q_descale=1.0, k_descale=kd,
                                           v_descale=kd, out_dtype=jnp.float8_e4m3fn),
                   r"`out_dtype`=float8_e4m3fn is not an output dtype"),
    "quantize_fp8_operands": (lambda q8, k8, kd: dict(q=q8, k=k8, v=k8, quantize=q8.dtype),
                              r"`quantize` quantizes 16/32/64-bit floats, but `q` has dtype "
                              r"float8_e4m3fn"),
    "quantize_with_descales": (lambda q8, k8, kd: dict(
        q=q8.astype(jnp.float32), k=k8.astype(jnp.float32), v=k8.astype(jnp.float32),
        k_descale=kd, quantize=q8.dtype), r"`quantize` makes the descales itself"),
    "quantize_to_bfloat16": (lambda q8, k8, kd: dict(
        q=q8.astype(jnp.float32), k=k8.astype(jnp.float32), v=k8.astype(jnp.float32),
        quantize=jnp.bfloat16), r"`quantize`=bfloat16 is not an FP8 dtype"),
    "quantize_true": (lambda q8, k8, kd: dict(
        q=q8.astype(jnp.float32), k=k8.astype(jnp.float32), v=k8.astype(jnp.float32),
        quantize=True), r"`quantize`=True is not an FP8 dtype"),
}


@pytest.mark.ci_cases(every=True)
@pytest.mark.parametrize("case", list(MISTAKES))
def test_mistakes_name_the_argument(case):
  q, k, _ = _problem(5)
  (q8, _), (k8, kd) = quantize_fp8(q), quantize_fp8(k)
  make, match = MISTAKES[case]
  kw = make(q8, k8, kd)
  with pytest.raises(ValueError, match=match):
    flash_attention(kw.pop("q"), kw.pop("k"), kw.pop("v"), backend="xla", **kw)
