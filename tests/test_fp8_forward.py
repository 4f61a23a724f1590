"""The FP8 forward of the Mosaic GPU kernels (Hopper): q, k and v of one FP8 dtype run the
forward's matmuls in FP8.

On a CPU machine: every configuration lowers for CUDA to one Mosaic GPU kernel that reads the FP8
operands (nothing widens them), gradients lower to that kernel and the two backward kernels (their
FP8 mode: ``test_fp8_backward``), and in interpret mode the whole call (descales, the dequantizing
backward, the descales' gradients) matches the xla backend on the same FP8 inputs. Natively
(PALLAS_RING_TEST_GPU=1 on sm_90+) the kernel itself is checked against the dequantized inputs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_ring import BlockSizes, flash_attention, masks, quantize_fp8, reference
from pallas_ring import fp8 as fp8_args
from pallas_ring.kernels import common, pallas_mosaic_gpu
from pallas_ring.kernels.pallas_mosaic_gpu import Variants, fp8, tiles
from conftest import ON_GPU, rel_err
from test_pallas_mosaic_gpu import CASES, HV, MOSAIC, TRITON

F8 = jnp.float8_e4m3fn
# The FP8 forward's error against the dequantized inputs is p's quantization to e4m3 (about 2%
# of the output's norm on random inputs: BENCHMARKS.md, "FP8 forward"); bfloat16's is 0.4%.
FP8_TOL = 4e-2


def _structs(name, dtype=F8):
  mask, t, s, n, kh, h, _, segs, cap = CASES[name]
  sd = jax.ShapeDtypeStruct
  args = (sd((2, t, n, h), dtype), sd((2, s, kh, h), dtype), sd((2, s, kh, HV.get(name, h)), dtype),
          sd((2, kh), jnp.float32), sd((2, kh), jnp.float32), sd((2, kh), jnp.float32))
  seg = (sd((2, t), jnp.int32),) if segs and t == s else ()
  return args, seg, dict(mask=mask, softcap=cap)


def _fp8_attention(kw, **variants):
  bs = BlockSizes(variants=Variants(**variants)) if variants else None

  def f(q, k, v, qd, kd, vd, *seg):
    extra = dict(segment_ids=seg[0]) if seg else {}
    return flash_attention(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd,
                           backend="pallas_mosaic_gpu", interpret=False, block_sizes=bs,
                           **extra, **kw)

  return f


def _lower(fn, *args):
  return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _mosaic_calls(text):
  return [line for line in text.splitlines() if MOSAIC in line and "custom_call" in line]


@pytest.mark.ci_cases("causal_gqa", "documents", "h256", "mla_192_128_documents")
@pytest.mark.parametrize("name", list(CASES))
def test_every_configuration_lowers_to_an_fp8_kernel(name):
  """One Mosaic GPU kernel taking q and k in FP8 (v too, transposed); no 16-bit copy of them.
  Gradients: that kernel and the two backward kernels."""
  args, seg, kw = _structs(name)
  f = _fp8_attention(kw)
  text = _lower(f, *args, *seg)
  calls = _mosaic_calls(text)
  assert len(calls) == 1 and TRITON not in text
  assert calls[0].count("xf8E4M3FN>") >= 3, calls[0]  # q, k, v
  grad = jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1, 2))
  assert len(_mosaic_calls(_lower(grad, *args, *seg))) == 3


def test_quantize_runs_the_fp8_kernel_and_16_bit_gradients():
  """``quantize=``: 16-bit q, k, v run the FP8 forward kernel; their gradients come from the
  two backward kernels, in bfloat16."""
  args, _, _ = _structs("causal_gqa")
  wide = [jax.ShapeDtypeStruct(a.shape, jnp.bfloat16) for a in args[:3]]
  f = lambda *x: flash_attention(*x, mask=masks.Causal(), backend="pallas_mosaic_gpu",
                                 interpret=False, quantize=F8)
  text = _lower(f, *wide)
  assert len(_mosaic_calls(text)) == 1 and _mosaic_calls(text)[0].count("xf8E4M3FN>") >= 3
  grad = jax.grad(lambda *x: jnp.sum(f(*x).astype(jnp.float32)), argnums=(0, 1, 2))
  assert [g.dtype for g in jax.eval_shape(grad, *wide)] == [jnp.bfloat16] * 3
  assert len(_mosaic_calls(_lower(grad, *wide))) == 3


@pytest.mark.ci_cases(every=True)
@pytest.mark.parametrize("terms", ["alibi", "bias_dense", "sinks_dropout"])
def test_score_terms_lower_in_the_fp8_kernel(terms):
  args, _, kw = _structs("causal_gqa")
  n, t = args[0].shape[2], args[0].shape[1]
  extra = {"alibi": dict(alibi_slopes=jnp.linspace(0.1, 1.0, n)),
           "bias_dense": dict(bias=jnp.zeros((1, n, t, t), jnp.bfloat16),
                              dense_mask=jnp.ones((1, 1, t, t), bool)),
           "sinks_dropout": dict(sinks=jnp.zeros((n,)), dropout_rate=0.1,
                                 dropout_rng=jax.random.key(0))}[terms]
  text = _lower(_fp8_attention({**kw, **extra}), *args)
  assert len(_mosaic_calls(text)) == 1 and "xf8E4M3FN>" in _mosaic_calls(text)[0]


def test_e5m2_and_both_walks_lower():
  args, _, kw = _structs("causal_gqa", jnp.float8_e5m2)
  for overlap in (False, True):
    text = _lower(_fp8_attention(kw, overlap_pv=overlap), *args)
    assert len(_mosaic_calls(text)) == 1 and "xf8E5M2>" in _mosaic_calls(text)[0]


def test_fp8_tile_rules():
  """Twice the keys per tile where the bytes allow, and the serial walk by default."""
  backend = pallas_mosaic_gpu.BACKEND
  for h, fp8_keys, keys in ((64, 256, 256), (128, 256, 128), (192, 128, 64), (256, 64, 64)):
    assert backend.default_block_sizes(h, "H100", F8).block_kv == fp8_keys
    assert backend.default_block_sizes(h, "H100", jnp.bfloat16).block_kv == keys
  assert tiles.overlaps(128, 128, False, Variants())
  assert not tiles.overlaps(128, 128, False, Variants(), fp8=True)
  assert tiles.overlaps(128, 128, False, Variants(overlap_pv=True), fp8=True)
  # the output's own staging tile (16-bit beside FP8 q) counts in the budget
  cfg = common.KernelConfig(
      mask=masks.Causal(), scale=1.0, softcap=None, q_len=1, kv_len=1, block_q=128,
      block_kv=256, block_q_bwd=128, block_kv_bwd=128)
  assert tiles.fwd_smem(cfg, 128, 1, out_itemsize=2) == 128 * 128 * 3 + 2 * 256 * 256


def test_v_layout_permutes_each_16_keys():
  """v ``[B, S, K, Hv]`` -> ``[B, K, Hv, S]``, the keys of every 16 in ``KEY_ORDER``, which is
  the permutation that relabelling p's registers applies (so ``p.v`` is unchanged)."""
  v = jnp.arange(2 * 32 * 3 * 4, dtype=jnp.float32).reshape(2, 32, 3, 4)
  got = np.asarray(fp8.v_layout(v))
  order = np.concatenate([fp8.KEY_ORDER, 16 + fp8.KEY_ORDER])
  np.testing.assert_array_equal(got, np.transpose(np.asarray(v)[:, order], (0, 2, 3, 1)))
  # thread j of a row's quad holds accumulator columns 2j, 2j+1, 2j+8, 2j+9 of every 16 and
  # the 8-bit operand's columns 4j .. 4j+3
  acc = [c for j in range(4) for c in (2 * j, 2 * j + 1, 2 * j + 8, 2 * j + 9)]
  np.testing.assert_array_equal(fp8.KEY_ORDER, acc)


def _problem(seed, t=200, n=4, kh=2, h=64):
  rng = np.random.default_rng(seed)
  q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32)
             for s in ((1, t, n, h), (1, t, kh, h), (1, t, kh, h)))
  return [quantize_fp8(x) for x in (q, k, v)]


@pytest.mark.ci_cases(every=True)
def test_interpret_matches_xla_on_the_same_fp8_inputs():
  """On CPU the call reaches the backend with FP8 operands and descales (the interpreter then
  dequantizes them): output, lse and q's gradient (FP8) match the xla backend, which
  dequantizes before its kernels; descales are constants (zero gradients) on both."""
  (q8, qd), (k8, kd), (v8, vd) = _problem(1)
  do = jnp.asarray(np.random.default_rng(2).standard_normal((1, 200, 4, 64)), jnp.float32)

  def run(backend):
    def f(qd, kd, vd, q8):
      out, lse = flash_attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                 mask=masks.Causal(), backend=backend, return_lse=True)
      return out.astype(jnp.float32), lse
    (out, lse), vjp = jax.vjp(f, qd, kd, vd, q8)
    return (out, lse, *vjp((do, jnp.zeros_like(lse))))

  got, ref = run("pallas_mosaic_gpu"), run("xla")
  assert got[0].dtype == jnp.float32 and got[-1].dtype == F8
  for a, r in zip(got[:2] + got[-1:], ref[:2] + ref[-1:]):
    assert a.shape == r.shape and rel_err(a, r) < 2e-2, (a.dtype, rel_err(a, r))
  for d in got[2:5] + ref[2:5]:
    assert not np.any(np.asarray(d))


@pytest.mark.ci_cases("ring", "ulysses")
@pytest.mark.parametrize("strategy", ["ring", "all_gather", "ulysses"])
def test_sharded_attention_keeps_fp8_to_the_kernels(strategy):
  """Over 4 CPU devices the descales are sharded and cut like the other operands (Ulysses:
  each device's heads) and reach every step's kernel (interpreted), forward and q's
  gradient against the dequantized reference."""
  from jax.sharding import AxisType
  from pallas_ring import SequenceParallelConfig, layouts, sharded_attention
  (q8, qd), (k8, kd), (v8, vd) = _problem(3, t=256, n=4, kh=4, h=64)
  mesh = jax.make_mesh((4,), ("sp",), axis_types=(AxisType.Auto,))
  cfg = SequenceParallelConfig(axis_name="sp", layout="zigzag", strategy=strategy,
                               backend="pallas_mosaic_gpu")
  perm = lambda x: layouts.permute(x, "zigzag", 4)
  deq = [x.astype(jnp.float32) * d[:, None, :, None] for x, d in
         ((q8, qd), (k8, kd), (v8, vd))]

  def loss(q8):
    out = sharded_attention(perm(q8), perm(k8), perm(v8), q_descale=qd, k_descale=kd,
                            v_descale=vd, mesh=mesh, config=cfg, mask=masks.Causal(),
                            interpret=True)
    return layouts.unpermute(out, "zigzag", 4).astype(jnp.float32)

  out, vjp = jax.vjp(loss, q8)
  ref, ref_vjp = jax.vjp(lambda q: reference.attention(q, *deq[1:], mask=masks.Causal())[0],
                         deq[0])
  assert rel_err(out, ref) < 2e-2
  do = jnp.full_like(ref, 1e3)  # (q's FP8 cotangent in e4m3's normal range)
  (g,), (g_ref,) = vjp(do), ref_vjp(do)
  assert g.dtype == F8 and rel_err(g.astype(jnp.float32), g_ref * qd[:, None, :, None]) < 0.1


@pytest.mark.ci_cases(every=True)
@pytest.mark.parametrize("h", [128, 256])
def test_the_ring_sends_fp8_and_runs_fp8_kernels(h):
  """``sharded_attention`` lowered for CUDA over 2 devices: every forward step's Mosaic GPU
  kernel reads FP8, and the K/V the ring sends are FP8 bytes (half a bfloat16 shard's)."""
  from jax.sharding import Mesh
  from pallas_ring import SequenceParallelConfig, sharded_attention
  mesh = Mesh(jax.devices()[:2], ("sp",))
  cfg = SequenceParallelConfig(axis_name="sp", layout="zigzag", backend="pallas_mosaic_gpu")

  def ring(q, k, v, d):
    return sharded_attention(q, k, v, q_descale=d, k_descale=d, v_descale=d, mesh=mesh,
                             config=cfg, mask=masks.Causal(), interpret=False)

  x = jax.ShapeDtypeStruct((1, 1024, 2, h), F8)
  text = _lower(ring, x, x, x, jax.ShapeDtypeStruct((1, 2), jnp.float32))
  calls = _mosaic_calls(text)
  assert len(calls) >= 2 and all("xf8E4M3FN>" in c for c in calls)
  sends = [line for line in text.splitlines() if "collective_permute" in line]
  shard_bytes = 512 * 2 * h  # one FP8 K (or V) shard
  assert sends and all(f"tensor<{2 * shard_bytes // 4}xui32>" in line or "f8E4M3FN" in line
                       for line in sends), sends


def test_the_quantized_ring_sends_fp8_to_fp8_kernels():
  """``sharded_attention(quantize=)`` on bfloat16 lowered for CUDA over 2 devices: the custom VJP
  quantizes, every forward step's kernel reads FP8 and the forward's sends are FP8 bytes; the
  gradients are bfloat16."""
  from jax.sharding import Mesh
  from pallas_ring import SequenceParallelConfig, sharded_attention
  mesh = Mesh(jax.devices()[:2], ("sp",))
  cfg = SequenceParallelConfig(axis_name="sp", layout="zigzag", backend="pallas_mosaic_gpu")
  ring = lambda *x: sharded_attention(*x, mesh=mesh, config=cfg, mask=masks.Causal(),
                                      interpret=False, quantize=F8)
  x = jax.ShapeDtypeStruct((1, 1024, 2, 128), jnp.bfloat16)
  text = _lower(ring, x, x, x)
  calls = _mosaic_calls(text)
  assert len(calls) >= 2 and all("xf8E4M3FN>" in c for c in calls)
  sends = [line for line in text.splitlines() if "collective_permute" in line]
  assert sends and all(f"tensor<{2 * 512 * 2 * 128 // 4}xui32>" in line for line in sends)
  grad = jax.grad(lambda *a: jnp.sum(ring(*a).astype(jnp.float32)), argnums=(0, 1, 2))
  assert [g.dtype for g in jax.eval_shape(grad, x, x, x)] == [jnp.bfloat16] * 3


@pytest.mark.ci_cases(every=True)
@pytest.mark.parametrize("strategy", ["ring", "all_gather", "ulysses"])
def test_fp8_on_an_explicit_mesh(strategy):
  """A default ``jax.make_mesh`` mesh (Explicit axes), used as the ambient mesh: FP8 inputs and
  their descales shard like on an Auto mesh; the output keeps the sequence sharding, and q's
  FP8 gradient matches the dequantized reference."""
  from jax.sharding import AxisType
  from pallas_ring import SequenceParallelConfig, sharded_attention
  (q8, qd), (k8, kd), (v8, vd) = _problem(5, t=256, n=2, kh=2, h=64)
  mesh = jax.make_mesh((2,), ("sp",), axis_types=(AxisType.Explicit,))
  deq = [x.astype(jnp.float32) * d[:, None, :, None] for x, d in
         ((q8, qd), (k8, kd), (v8, vd))]
  cfg = SequenceParallelConfig(axis_name="sp", strategy=strategy, backend="pallas_mosaic_gpu")

  def loss(q8):
    return sharded_attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, mesh=mesh,
                             config=cfg, mask=masks.Causal(), interpret=True).astype(jnp.float32)

  with jax.set_mesh(mesh):
    out, vjp = jax.vjp(loss, q8)
    do = jnp.full_like(out, 1e3)  # (q's FP8 cotangent in e4m3's normal range)
    (g,) = vjp(do)
  ref, ref_vjp = jax.vjp(lambda q: reference.attention(q, *deq[1:], mask=masks.Causal())[0],
                         deq[0])
  (g_ref,) = ref_vjp(do)
  assert out.sharding.spec[1] == "sp" and rel_err(out, ref) < 2e-2
  assert g.dtype == F8 and rel_err(g.astype(jnp.float32), g_ref * qd[:, None, :, None]) < 0.1


def test_ring_attention_takes_each_devices_own_descales():
  """Inside your own shard_map each device may quantize its own shard (descales that differ per
  device): ``ring_attention`` dequantizes first, so a step's K/V from another device carry
  their own descales."""
  from jax.sharding import AxisType, PartitionSpec as P
  from pallas_ring import ring_attention
  rng = np.random.default_rng(4)
  x = [jnp.asarray(rng.standard_normal((1, 256, 2, 64)), jnp.float32) for _ in range(3)]
  x = [a.at[:, 128:].multiply(8.0) for a in x]  # shard 1's values 8x larger
  mesh = jax.make_mesh((2,), ("sp",), axis_types=(AxisType.Auto,))

  def per_shard(q, k, v):
    (q8, qd), (k8, kd), (v8, vd) = (quantize_fp8(a) for a in (q, k, v))
    out = ring_attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, axis_name="sp",
                         mask=masks.Causal(), backend="pallas_mosaic_gpu", interpret=True)
    deq = [a8.astype(jnp.float32) * d[:, None, :, None] for a8, d in
           ((q8, qd), (k8, kd), (v8, vd))]
    return out.astype(jnp.float32), *deq

  out, *deq = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=(P(None, "sp"),) * 3,
                                    out_specs=(P(None, "sp"),) * 4, check_vma=False))(*x)
  assert rel_err(out, reference.attention(*deq, mask=masks.Causal())[0]) < 2e-2


@pytest.mark.skipif(not ON_GPU or not pallas_mosaic_gpu.hopper(),
                    reason="runs the Mosaic GPU kernels natively: PALLAS_RING_TEST_GPU=1 on sm_90+")
@pytest.mark.parametrize("name", ["causal_gqa", "full_odd_lengths", "window_mqa", "documents",
                                  "softcap_h64", "h256", "mla_192_128_documents", "one_token"])
@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_native_fp8_forward_matches_the_dequantized_inputs(name, dtype):
  mask, t, s, n, kh, h, _, segs, cap = CASES[name]
  rng = np.random.default_rng(7)
  raw = [jnp.asarray(rng.standard_normal(shape), jnp.float32)
         for shape in ((2, t, n, h), (2, s, kh, h), (2, s, kh, HV.get(name, h)))]
  (q8, qd), (k8, kd), (v8, vd) = (quantize_fp8(x, dtype) for x in raw)
  kw = dict(mask=mask, softcap=cap)
  if segs:
    kw["segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 4, (2, t)), axis=1), jnp.int32)
  out, lse = jax.jit(lambda *a: flash_attention(
      *a[:3], q_descale=a[3], k_descale=a[4], v_descale=a[5], return_lse=True, **kw))(
          q8, k8, v8, qd, kd, vd)
  deq = [x.astype(jnp.float32) * d[:, None, :, None] for x, d in
         ((q8, qd), (k8, kd), (v8, vd))]
  ref, ref_lse = reference.attention(*deq, **kw)
  assert out.dtype == jnp.bfloat16 and not np.any(np.isnan(np.asarray(out, np.float32)))
  tol = FP8_TOL if dtype == jnp.float8_e4m3fn else 2 * FP8_TOL  # (e5m2: 2 mantissa bits)
  assert rel_err(out, ref) < tol
  # the lse undoes p's scaling (``fp8.P_LOG2``): p's quantization moves it by ~1e-3
  fin = np.isfinite(np.asarray(ref_lse))
  np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), fin)
  np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(ref_lse)[fin], atol=2e-2)


@pytest.mark.skipif(not ON_GPU or not pallas_mosaic_gpu.hopper(),
                    reason="runs the Mosaic GPU kernels natively: PALLAS_RING_TEST_GPU=1 on sm_90+")
def test_native_fp8_forward_merges_into_the_rings_running_result():
  """A ring step's FP8 forward given the running (o, lse) equals ``common.merge`` of it and the
  plain FP8 forward (whose output is rounded to bfloat16: 2^-9 relative, as in
  ``conftest.check_ring_step``)."""
  from pallas_ring import block_sparse, plans
  from pallas_ring.kernels import common as kc
  (q8, qd), (k8, kd), (v8, vd) = _problem(8, t=512, n=4, kh=2, h=128)
  descales = fp8_args.kernel_descales(
      *(d[:, None, :, None] for d in (qd, kd, vd)), 4)
  info = block_sparse.make_token_info(512, 1, None, None)
  ops = kc.Operands(info, info, fp8=descales)
  cfg = kc.KernelConfig(mask=masks.Causal(), scale=128 ** -0.5, softcap=None, q_len=512,
                        kv_len=512, block_q=128, block_kv=256, block_q_bwd=128,
                        block_kv_bwd=128, out_dtype=jnp.float32)
  fwd = pallas_mosaic_gpu.forward
  plan = plans.on_device(ops, cfg)
  rng = np.random.default_rng(9)
  o_acc = jnp.asarray(rng.standard_normal((1, 512, 4, 128)), jnp.float32)
  lse_acc = jnp.asarray(rng.standard_normal((1, 4, 512)) + 3.0, jnp.float32)
  merged = jax.jit(lambda *a: fwd(*a[:3], ops, plan, cfg, kc.Partial(*a[3:])))(
      q8, k8, v8, o_acc, lse_acc)
  o1, lse1 = jax.jit(lambda *a: fwd(*a, ops, plan, cfg))(q8, k8, v8)
  o_ref, lse_ref = kc.merge(o_acc, lse_acc, o1, lse1)
  assert rel_err(merged[0], o_ref) < 5e-3
  np.testing.assert_allclose(np.asarray(merged[1]), np.asarray(lse_ref), rtol=1e-5)


@pytest.mark.skipif(not ON_GPU or not pallas_mosaic_gpu.hopper(),
                    reason="runs the Mosaic GPU kernels natively: PALLAS_RING_TEST_GPU=1 on sm_90+")
def test_native_quantize_trains_straight_through():
  """``quantize=`` natively: the FP8 forward and backward at the quantized values, gradients in
  bfloat16 against the dequantized reference (the FP8 backward's error: dO's and p's
  quantization, BENCHMARKS.md, "FP8 backward")."""
  rng = np.random.default_rng(10)
  q, k, v, do = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
                 for s in ((2, 640, 8, 128), (2, 640, 2, 128), (2, 640, 2, 128), (2, 640, 8, 128)))
  f = jax.jit(lambda *x: flash_attention(*x, mask=masks.Causal(), quantize=F8))
  out, vjp = jax.vjp(f, q, k, v)
  deq = [x8.astype(jnp.float32) * d[:, None, :, None] for x8, d in map(quantize_fp8, (q, k, v))]
  ref, ref_vjp = jax.vjp(lambda *x: reference.attention(*x, mask=masks.Causal())[0], *deq)
  assert rel_err(out, ref) < FP8_TOL
  for g, r in zip(vjp(do), ref_vjp(do.astype(jnp.float32))):
    assert g.dtype == jnp.bfloat16 and rel_err(g, r) < 2 * FP8_TOL, rel_err(g, r)


@pytest.mark.skipif(not ON_GPU or not pallas_mosaic_gpu.hopper(),
                    reason="runs the Mosaic GPU kernels natively: PALLAS_RING_TEST_GPU=1 on sm_90+")
@pytest.mark.parametrize("strategy, layout", [("ring", "zigzag"), ("ulysses", "contiguous")])
def test_native_sharded_quantize_trains_straight_through(strategy, layout):
  """``sharded_attention(quantize=)`` over every local GPU: FP8 forward steps (the ring's K/V
  sent as FP8), gradients in bfloat16 against the dequantized reference."""
  from jax.sharding import AxisType
  from pallas_ring import SequenceParallelConfig, layouts, sharded_attention
  r = jax.device_count()
  rng = np.random.default_rng(11)
  q, k, v, do = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
                 for s in ((1, 1024, 8, 128), (1, 1024, 8, 128), (1, 1024, 8, 128),
                           (1, 1024, 8, 128)))
  mesh = jax.make_mesh((r,), ("sp",), axis_types=(AxisType.Auto,))
  cfg = SequenceParallelConfig(axis_name="sp", layout=layout, strategy=strategy)
  perm = lambda x: layouts.permute(x, layout, r)
  f = jax.jit(lambda *x: layouts.unpermute(sharded_attention(
      *map(perm, x), mesh=mesh, config=cfg, mask=masks.Causal(), quantize=F8), layout, r))
  out, vjp = jax.vjp(f, q, k, v)
  deq = [x8.astype(jnp.float32) * d[:, None, :, None] for x8, d in map(quantize_fp8, (q, k, v))]
  ref, ref_vjp = jax.vjp(lambda *x: reference.attention(*x, mask=masks.Causal())[0], *deq)
  assert rel_err(out, ref) < FP8_TOL
  for g, r_ in zip(vjp(do), ref_vjp(do.astype(jnp.float32))):
    assert g.dtype == jnp.bfloat16 and rel_err(g, r_) < FP8_TOL, rel_err(g, r_)
