"""decode_attention: a few queries against a KV cache, on every backend, split and sharded."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from pallas_ring import BlockSizes, SequenceParallelConfig, decode_attention, masks, reference
from conftest import rel_err

BACKENDS = [("xla", None), ("pallas_triton", True), ("pallas_tpu", True)]

CASES = {  # name: (T, N, K, mask, extra keywords, kv_splits)
    "greedy_gqa_causal": (1, 8, 2, masks.Causal(), {}, 4),
    "speculative_mqa_window": (4, 4, 1, masks.SlidingWindow(100), {}, 2),
    "chunk_mha_full_sinks_softcap": (3, 2, 2, masks.Full(), dict(softcap=5.0), None),
    "alibi_gqa": (2, 4, 2, masks.Causal(), dict(alibi_slopes=np.linspace(0.01, 0.2, 4)), 4),
}


def _problem(seed, t, n, kh, b=2, s=512, h=32, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((b, t, n, h)), dtype)
  k = jnp.asarray(rng.standard_normal((b, s, kh, h)), dtype)
  v = jnp.asarray(rng.standard_normal((b, s, kh, h)), dtype)
  lengths = jnp.asarray(rng.integers(t, s + 1, b), jnp.int32).at[0].set(s)
  return q, k, v, lengths


def _reference(q, k, v, lengths, mask, q_positions=None, **kw):
  """Dense attention over the slots below each row's length."""
  b, t = q.shape[:2]
  s = k.shape[1]
  if q_positions is None:
    q_positions = lengths[:, None] - t + jnp.arange(t)
  kv_seg = (jnp.arange(s)[None] >= lengths[:, None]).astype(jnp.int32)
  return reference.attention(q, k, v, mask=mask, q_positions=q_positions,
                             kv_positions=jnp.arange(s), segment_ids=jnp.zeros((b, t), jnp.int32),
                             kv_segment_ids=kv_seg, **kw)


@pytest.mark.ci_cases("greedy_gqa_causal-xla", "speculative_mqa_window-pallas_triton",
                      "chunk_mha_full_sinks_softcap-pallas_tpu")
@pytest.mark.parametrize("backend, interpret", BACKENDS, ids=[b for b, _ in BACKENDS])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_the_reference(case, backend, interpret):
  """Ragged lengths, GQA / MQA / MHA, T = 1 to 4, masks, sinks, soft-cap and ALiBi, the cache
  split into chunks or not: the dense reference's output and lse."""
  t, n, kh, mask, extra, splits = CASES[case]
  q, k, v, lengths = _problem(sum(map(ord, case)), t, n, kh)
  sinks = jnp.linspace(-1.0, 1.0, n) if "sinks" in case else None
  out, lse = decode_attention(q, k, v, kv_lengths=lengths, mask=mask, sinks=sinks,
                              backend=backend, interpret=interpret, return_lse=True,
                              block_sizes=BlockSizes(kv_splits=splits), **extra)
  ref, ref_lse = _reference(q, k, v, lengths, mask, sinks=sinks, **extra)
  assert out.shape == q.shape and out.dtype == q.dtype
  assert rel_err(out, ref) < 1e-5
  assert rel_err(lse, ref_lse) < 1e-5


@pytest.mark.parametrize("backend, interpret", BACKENDS, ids=[b for b, _ in BACKENDS])
def test_absorbed_mla_cache_with_its_own_value_head_dim(backend, interpret):
  """DeepSeek-style absorbed MLA decode: one latent kv head, q/k head dim 576, v head dim 512
  (the first 512 columns of the latent cache), ragged lengths: output ``[B, T, N, 512]``."""
  rng = np.random.default_rng(11)
  b, t, n, s, h, hv = 2, 2, 4, 256, 576, 512
  q = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((b, s, 1, h)), jnp.float32)
  v, lengths = k[..., :hv], jnp.asarray([s, 100], jnp.int32)
  out = decode_attention(q, k, v, kv_lengths=lengths, scale=0.07, backend=backend,
                         interpret=interpret, block_sizes=BlockSizes(kv_splits=2))
  ref = _reference(q, k, v, lengths, masks.Causal(), scale=0.07)[0]
  assert out.shape == (b, t, n, hv)
  assert rel_err(out, ref) < 1e-5


def test_default_lengths_positions_and_bfloat16():
  """No ``kv_lengths``: every slot is filled and the queries are its last T tokens; explicit
  ``q_positions`` are honoured; bfloat16 stays within 2x of a bfloat16 reference's error."""
  q, k, v, _ = _problem(3, 2, 4, 2, dtype=jnp.bfloat16)
  full = jnp.full((2,), 512, jnp.int32)
  out = decode_attention(q, k, v, backend="xla", block_sizes=BlockSizes(kv_splits=4))
  f32 = lambda x: x.astype(jnp.float32)
  exact, _ = _reference(f32(q), f32(k), f32(v), full, masks.Causal())
  ref, _ = _reference(q, k, v, full, masks.Causal())
  assert out.dtype == jnp.bfloat16
  assert rel_err(out, exact) <= 2 * rel_err(ref, exact) + 1e-3
  pos = jnp.asarray([100, 300])
  got = decode_attention(f32(q), f32(k), f32(v), q_positions=pos, kv_lengths=full,
                         backend="xla")
  want, _ = _reference(f32(q), f32(k), f32(v), full, masks.Causal(), q_positions=pos)
  assert rel_err(got, want) < 1e-5


def test_a_row_with_nothing_visible_is_zero():
  """A row of length 0 (and a query before every slot) returns 0 and an lse of -inf."""
  q, k, v, _ = _problem(4, 1, 4, 2)
  out, lse = decode_attention(q, k, v, kv_lengths=jnp.asarray([0, 512]), backend="xla",
                              return_lse=True, block_sizes=BlockSizes(kv_splits=4))
  assert not jnp.any(jnp.isnan(out))
  assert jnp.all(out[0] == 0) and jnp.all(lse[0] == -jnp.inf)
  assert jnp.all(jnp.isfinite(lse[1]))


@pytest.mark.parametrize("shape, other, backend", [((8,), None, "xla"),
                                              ((2, 4), "batch_axes", "xla"),
                                              ((2, 4), "head_axis", "xla"),
                                              ((4,), None, "pallas_triton")],
                         ids=["sp8", "dp2_sp4", "hp2_sp4", "sp4_triton"])
def test_a_cache_sharded_along_its_slots_matches_one_device(shape, other, backend):
  """The cache sharded over ``axis_name`` (and the batch over ``batch_axes``, or the heads, with
  the sinks and ALiBi slopes, over ``head_axis``): each device attends its own slot range and
  the results merge; equal to one device (output and lse)."""
  names = ({"head_axis": "hp"}.get(other, "dp"), "sp")[-len(shape):]
  mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))
  axes = {} if other is None else {other: ("dp",) if other == "batch_axes" else "hp"}
  cfg = SequenceParallelConfig(axis_name="sp", backend=backend, **axes)
  q, k, v, lengths = _problem(5, 2, 8, 2, s=1024)
  lengths = lengths.at[1].set(100)  # (most devices hold none of this row's slots)
  kw = dict(kv_lengths=lengths, mask=masks.SlidingWindow(300), return_lse=True)
  if other == "head_axis":
    kw |= dict(sinks=jnp.linspace(-1.0, 1.0, 8), alibi_slopes=jnp.linspace(0.01, 0.1, 8),
               q_positions=(lengths[:, None] - 1 - jnp.arange(2)[::-1]) // 2)
  out, lse = jax.jit(lambda *a: decode_attention(*a, mesh=mesh, config=cfg, **kw))(q, k, v)
  one, one_lse = decode_attention(q, k, v, backend="xla", **kw)
  assert rel_err(out, one) < 1e-6 and rel_err(lse, one_lse) < 1e-6
  if other == "head_axis":  # (each device attended its own heads)
    assert out.sharding.spec[2] == "hp" and lse.sharding.spec[1] == "hp"
  with jax.set_mesh(mesh):  # the active mesh serves as well
    np.testing.assert_array_equal(decode_attention(q, k, v, config=cfg, **kw)[0], out)


@pytest.mark.parametrize("mask", [masks.Causal(), masks.SlidingWindow(60), masks.PrefixLM(40)],
                         ids=["causal", "window", "prefix"])
def test_the_dedicated_triton_kernel_runs_alone(mask):
  """Triton decodes with its dedicated kernel (one launch, no block plan): given positions,
  ragged lengths (a row with none), chunks, output and lse equal to the reference."""
  q, k, v, lengths = _problem(8, 3, 8, 2)
  lengths = lengths.at[1].set(0)
  pos = jnp.asarray([[5, 200, 511], [0, 1, 2]], jnp.int32)
  f = lambda q, k, v: decode_attention(q, k, v, kv_lengths=lengths, q_positions=pos, mask=mask,
                                       backend="pallas_triton", interpret=True, return_lse=True,
                                       block_sizes=BlockSizes(kv_splits=4))
  jaxpr = str(jax.make_jaxpr(f)(q, k, v))
  assert jaxpr.count("pallas_call") == 1 and "pallas_ring_decode" in jaxpr
  assert " sort" not in jaxpr  # (no block plan)
  out, lse = f(q, k, v)
  ref, ref_lse = _reference(q, k, v, lengths, mask, q_positions=pos)
  assert rel_err(out, ref) < 1e-5
  assert np.array_equal(np.isinf(lse), np.isinf(ref_lse))
  finite = lambda x: jnp.where(jnp.isinf(x), 0, x)
  assert rel_err(finite(lse), finite(ref_lse)) < 1e-5
  assert not jnp.any(out[1])  # (no visible slot: zeros)


def test_differentiating_it_raises_naming_flash_attention():
  q, k, v, _ = _problem(6, 1, 2, 2, s=128)
  f = lambda q: decode_attention(q, k, v, backend="xla").sum()
  with pytest.raises(NotImplementedError, match="flash_attention"):
    jax.grad(f)(q)
  with pytest.raises(NotImplementedError, match="forward only"):
    jax.jvp(f, (q,), (q,))


@pytest.mark.ci_cases(every=True)
@pytest.mark.parametrize("change, error, match", [
    (dict(kv_lengths=jnp.ones((3,), jnp.int32)), ValueError, r"`kv_lengths` has shape \(3,\)"),
    (dict(kv_lengths=jnp.ones((2,))), TypeError, "`kv_lengths` has dtype float32"),
    (dict(q=jnp.ones((2, 200, 2, 32))), ValueError, "T=200 tokens but the cache has S=128"),
    (dict(mesh="mesh"), ValueError, "needs config=SequenceParallelConfig"),
    (dict(block_sizes=BlockSizes(kv_splits=3)), ValueError, "kv_splits=3 does not divide"),
    (dict(q_positions=jnp.ones((5,), jnp.int32)), ValueError, "`q_positions` has shape"),
    (dict(kv_lengths=[129, 5]), ValueError, "from 5 to 129; each must be between 0 and the "
                                            "cache's S=128"),
    (dict(kv_lengths=np.array([-1, 5])), ValueError, "from -1 to 5; each must be between 0"),
], ids=["lengths_shape", "lengths_dtype", "query_longer_than_cache", "mesh_without_config",
        "splits", "positions", "lengths_past_the_cache", "negative_lengths"])
def test_mistakes_raise_naming_the_argument(change, error, match):
  q, k, v, _ = _problem(7, 1, 2, 2, s=128)
  kw = dict(q=q, backend="xla") | change
  with pytest.raises(error, match=match):
    decode_attention(kw.pop("q"), k, v, **kw)


def test_traced_lengths_past_the_cache_make_the_output_nan():
  """Under ``jit`` a length outside ``[0, S]`` cannot raise: the output is NaN, not the
  attention of a cache clipped (or, in the Triton kernel, padded) to its length."""
  q, k, v, _ = _problem(9, 1, 2, 2, s=128)
  f = jax.jit(lambda lengths: decode_attention(q, k, v, kv_lengths=lengths, backend="xla"))
  assert jnp.all(jnp.isnan(f(jnp.array([129, 5]))))
  assert not jnp.any(jnp.isnan(f(jnp.array([128, 5]))))


@pytest.mark.ci_cases(every=True)
@pytest.mark.parametrize("shape", [(), (4,)], ids=["one_device", "sp4"])
def test_triton_cache_slots_that_are_not_a_tile_multiple(shape):
  """The dedicated Triton kernel pads the cache (this device's slots) to whole tiles: the
  padding stays invisible, also where its positions are another device's slots."""
  q, k, v, lengths = _problem(10, 1, 4, 1, s=4 * 90)
  lengths = lengths.at[1].set(4 * 90)
  kw = dict(kv_lengths=lengths, return_lse=True)
  if shape:
    mesh = jax.make_mesh(shape, ("sp",), axis_types=(AxisType.Auto,))
    kw |= dict(mesh=mesh, config=SequenceParallelConfig(axis_name="sp", backend="xla"))
  out, lse = decode_attention(q, k, v, backend="pallas_triton", interpret=True, **kw)
  ref, ref_lse = _reference(q, k, v, lengths, masks.Causal())
  assert rel_err(out, ref) < 1e-5 and rel_err(lse, ref_lse) < 1e-5


def test_a_batch_that_batch_axes_do_not_divide_raises():
  mesh = jax.make_mesh((2, 4), ("dp", "sp"), axis_types=(AxisType.Auto,) * 2)
  cfg = SequenceParallelConfig(axis_name="sp", batch_axes=("dp",), backend="xla")
  q, k, v, _ = _problem(7, 1, 2, 2, b=3, s=128)
  with pytest.raises(ValueError, match="batch size 3 is not divisible by the 2 devices"):
    decode_attention(q, k, v, mesh=mesh, config=cfg)


def test_heads_that_the_head_axis_does_not_divide_raise():
  mesh = jax.make_mesh((2, 4), ("hp", "sp"), axis_types=(AxisType.Auto,) * 2)
  cfg = SequenceParallelConfig(axis_name="sp", head_axis="hp", backend="xla")
  q, k, v, _ = _problem(7, 1, 3, 1, s=128)
  with pytest.raises(ValueError, match="head_axis='hp' has 2 devices but q has 3 heads and the "
                                       "caches 1"):
    decode_attention(q, k, v, mesh=mesh, config=cfg)


def test_kv_lengths_may_be_a_list():
  q, k, v, _ = _problem(8, 1, 2, 2, s=128)
  want = decode_attention(q, k, v, kv_lengths=jnp.array([13, 128]), backend="xla")
  assert jnp.array_equal(decode_attention(q, k, v, kv_lengths=[13, 128], backend="xla"), want)


@pytest.mark.ci_cases(every=True)
@pytest.mark.parametrize("backend, marker", [("pallas_triton", "__gpu$xla.gpu.triton"),
                                             ("pallas_mosaic_gpu", "@mosaic_gpu")])
def test_lowers_to_one_gpu_kernel_for_cuda(backend, marker):
  """GQA, MQA and absorbed-MLA caches, split into chunks: one kernel call, lowered for CUDA on
  this host. The Mosaic GPU decode kernel takes head dims up to 256: it refuses the absorbed MLA
  cache (576 / 512) naming the Triton kernel, which ``auto`` then picks."""
  sd = jax.ShapeDtypeStruct
  for n, kh, h, hv in ((32, 8, 128, 128), (16, 1, 128, 128), (16, 1, 576, 512)):  # GQA, MQA, MLA
    args = (sd((2, 1, n, h), jnp.bfloat16), sd((2, 4096, kh, h), jnp.bfloat16),
            sd((2, 4096, kh, hv), jnp.bfloat16), sd((2,), jnp.int32))
    f = lambda q, k, v, n: decode_attention(q, k, v, kv_lengths=n, backend=backend,
                                            interpret=False,
                                            block_sizes=BlockSizes(kv_splits=8))
    lower = lambda: jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    if backend == "pallas_mosaic_gpu" and h > 256:
      with pytest.raises(ValueError, match="head dim .* Use backend='pallas_triton'"):
        lower()
      backend = "auto"
    assert lower().count(marker if backend != "auto" else "__gpu$xla.gpu.triton") == 1


@pytest.mark.xdist_group("libtpu")
def test_default_arguments_compile_a_mosaic_kernel_for_tpu():
  """v5e, default arguments: one Mosaic kernel, and no temporary as large as the cache (no
  ``[B, N, T, S]`` scores)."""
  from jax.experimental import topologies
  topo = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu")
  mesh = jax.sharding.Mesh(np.array(topo.devices[:1]), ("x",))
  sd = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(
      shape, dt, sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  b, s, n, kh, h = 2, 32768, 32, 8, 128
  args = (sd((b, 1, n, h)), sd((b, s, kh, h)), sd((b, s, kh, h)), sd((b,), jnp.int32))
  f = lambda q, k, v, n: decode_attention(q, k, v, kv_lengths=n)
  compiled = jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",)).compile()
  assert compiled.as_text().count("custom_call_target=\"tpu_custom_call\"") == 1
  cache_bytes = b * s * kh * h * 2
  assert compiled.memory_analysis().temp_size_in_bytes < cache_bytes // 8


@pytest.mark.xdist_group("libtpu")
@pytest.mark.ci_cases("v6e")
@pytest.mark.parametrize("generation", ["v6e", "v5e"])
def test_an_fp8_cache_reaches_the_tpu_kernel_in_fp8(generation):
  """Compiled for v5e and v6e: the one Mosaic kernel takes the FP8 cache as it is (half the bytes
  of a bfloat16 cache; it widens each tile after loading it) and nothing holds a widened copy."""
  from jax.experimental import topologies
  topo = topologies.get_topology_desc(topology_name=f"{generation}:2x2", platform="tpu")
  mesh = jax.sharding.Mesh(np.array(topo.devices[:1]), ("x",))
  sd = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(
      shape, dt, sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  b, s, n, kh, h = 2, 32768, 32, 8, 128
  f8 = jnp.float8_e4m3fn
  args = (sd((b, 1, n, h)), sd((b, s, kh, h), f8), sd((b, s, kh, h), f8),
          sd((b, kh), jnp.float32), sd((b, kh), jnp.float32), sd((b,), jnp.int32))
  f = lambda q, k, v, kd, vd, n: decode_attention(q, k, v, k_descale=kd, v_descale=vd,
                                                  kv_lengths=n)
  compiled = jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",)).compile()
  text = compiled.as_text()
  calls = [line for line in text.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
  assert len(calls) == 1 and calls[0].count("f8e4m3fn[") >= 2, calls
  assert compiled.memory_analysis().temp_size_in_bytes < b * s * kh * h // 8  # (FP8 bytes)
