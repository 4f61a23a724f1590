"""Flax: RingAttention and make_attention_fn against the stock linen / nnx modules."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import flax.linen as nn
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import pallas_ring
from pallas_ring import SequenceParallelConfig, layouts, masks, reference
from pallas_ring.examples.transformer import TransformerLM, train
from pallas_ring.nn import RingAttention, make_attention_fn
from conftest import rel_err

B, T, D, N = 2, 32, 32, 4


def _x(seed=0, t=T):
  return jnp.asarray(np.random.default_rng(seed).standard_normal((B, t, D)), jnp.float32)


def test_parameter_tree_parity_and_checkpoint_interchange():
  x = _x()
  stock = nn.MultiHeadDotProductAttention(num_heads=N)
  ours = RingAttention(num_heads=N, mask=masks.Causal())
  p_stock = stock.init(jax.random.key(0), x)
  p_ours = ours.init(jax.random.key(0), x)
  shapes = lambda p: jax.tree.map(lambda a: a.shape, p)
  assert shapes(p_stock) == shapes(p_ours)
  # The stock checkpoint runs unchanged in RingAttention.
  mask = nn.make_causal_mask(jnp.ones((B, T)))
  ref = stock.apply(p_stock, x, mask=mask)
  out = jax.jit(ours.apply)(p_stock, x)
  assert rel_err(out, ref) < 1e-5
  # Gradients with respect to the parameters agree.
  g_ref = jax.grad(lambda p: jnp.sum(stock.apply(p, x, mask=mask) ** 2))(p_stock)
  g_ours = jax.grad(lambda p: jnp.sum(ours.apply(p, x) ** 2))(p_stock)
  assert rel_err(_flat(g_ours), _flat(g_ref)) < 1e-5  # (the key bias' gradient is ~0 in both)


def _flat(tree):
  return np.concatenate([np.ravel(a) for a in jax.tree.leaves(tree)])


def test_ring_attention_module_dtype_and_segments():
  x = _x(1)
  seg = jnp.asarray(np.repeat([[0, 1, 2, 2]], 8, axis=1).repeat(B, 0), jnp.int32)
  ours = RingAttention(num_heads=N, mask=masks.Causal(), dtype=jnp.bfloat16)
  params = ours.init(jax.random.key(1), x)
  out = ours.apply(params, x, segment_ids=seg)
  assert out.dtype == jnp.bfloat16
  stock = nn.MultiHeadDotProductAttention(num_heads=N, dtype=jnp.bfloat16)
  mask = nn.combine_masks(nn.make_causal_mask(seg), nn.make_attention_mask(seg, seg, jnp.equal))
  assert rel_err(out, stock.apply(params, x, mask=mask)) < 2e-2


@pytest.mark.parametrize("mask_kind", ["float_causal", "bool_padding"])
def test_linen_attention_fn_honours_flax_masks(mask_kind):
  x = _x(2)
  if mask_kind == "float_causal":
    mask = nn.make_causal_mask(jnp.ones((B, T)), dtype=jnp.float32)  # 0/1 floats
  else:
    # Key padding as a bool mask (every query keeps a visible key: Flax would average V over a
    # fully masked row, pallas_ring returns 0 there).
    valid = jnp.arange(T)[None, :] < jnp.asarray([[T], [T - 7]])
    mask = nn.make_attention_mask(jnp.ones((B, T), bool), valid, dtype=bool)
  stock = nn.MultiHeadDotProductAttention(num_heads=N)
  ours = nn.MultiHeadDotProductAttention(num_heads=N, attention_fn=make_attention_fn())
  params = stock.init(jax.random.key(2), x)
  f = lambda m: jax.jit(lambda p, x_: m.apply(p, x_, mask=mask))
  assert rel_err(f(ours)(params, x), f(stock)(params, x)) < 1e-5
  g = lambda m: jax.grad(lambda x_: jnp.sum(m.apply(params, x_, mask=mask) ** 2))(x)
  assert rel_err(g(ours), g(stock)) < 1e-5


def test_nnx_attention_fn_with_is_causal():
  x = _x(3)
  kw = dict(num_heads=N, in_features=D, decode=False)
  stock = nnx.MultiHeadAttention(**kw, rngs=nnx.Rngs(0))
  ours = nnx.MultiHeadAttention(**kw, attention_fn=make_attention_fn(), rngs=nnx.Rngs(0))
  mask = nnx.make_causal_mask(jnp.ones((B, T)))
  ref = stock(x, mask=mask)
  assert rel_err(ours(x, is_causal=True), ref) < 1e-5
  assert rel_err(ours(x, mask=mask), ref) < 1e-5
  grad = lambda m: nnx.grad(lambda m_: (m_(x, mask=mask) ** 2).sum())(m)
  g_ours, g_ref = grad(ours), grad(stock)
  assert rel_err(_flat(nnx.state(g_ours)), _flat(nnx.state(g_ref))) < 1e-5


def test_attention_fn_names_every_flax_keyword():
  import inspect
  params = inspect.signature(make_attention_fn()).parameters
  for kw in ("mask", "dropout_rng", "dropout_rate", "broadcast_dropout", "deterministic", "dtype",
             "precision", "module", "force_fp32_for_softmax", "qk_attn_weights_einsum",
             "attn_weights_value_einsum", "is_causal", "bias"):
    assert kw in params, kw


def test_unsupported_features_raise_with_the_fix():
  x = _x(4)
  m = nn.MultiHeadDotProductAttention(num_heads=N, attention_fn=make_attention_fn())
  params = m.init(jax.random.key(0), x)
  with pytest.raises(NotImplementedError, match="sow_weights=False"):
    m.apply(params, x, sow_weights=True, mutable=["intermediates"])
  with pytest.raises(NotImplementedError, match="sow_weights=False"):
    RingAttention(num_heads=N).init(jax.random.key(0), x, sow_weights=True)
  with pytest.raises(NotImplementedError, match="custom einsums"):
    RingAttention(num_heads=N, qk_attn_weights_einsum_cls=lambda: jnp.einsum).init(
        jax.random.key(0), x)
  fn = make_attention_fn()
  q = jnp.ones((1, 8, 2, 4))
  with pytest.raises(ValueError, match="needs a `dropout_rng`"):
    fn(q, q, q, dropout_rate=0.1, deterministic=False)


@pytest.mark.parametrize("broadcast", [True, False])
def test_attention_fn_dropout_and_bias_match_the_reference(broadcast):
  """Flax's keywords: dropout (broadcast over batch and heads as Flax's default, or not) and an
  additive bias, against the reference with ``dropout_keep_mask``'s mask."""
  r = np.random.default_rng(0)
  q, k, v = (jnp.asarray(r.standard_normal((B, T, N, 8)), jnp.float32) for _ in range(3))
  bias = jnp.asarray(r.standard_normal((B, N, T, T)), jnp.float32)
  key = jax.random.key(1)
  fn = make_attention_fn(mask=masks.Causal())
  out = fn(q, k, v, bias=bias, dropout_rng=key, dropout_rate=0.25, deterministic=False,
           broadcast_dropout=broadcast)
  keep = pallas_ring.dropout_keep_mask(key, 0.25, B, N, jnp.arange(T), jnp.arange(T),
                                       broadcast=broadcast)
  ref = reference.attention(q, k, v, mask=masks.Causal(), bias=bias, dropout_rate=0.25,
                            dropout_mask=keep)[0]
  assert rel_err(out, ref) < 1e-5
  # Evaluation (deterministic=True) is dropout-free and equals Flax's own attention.
  evaluated = fn(q, k, v, bias=bias, dropout_rng=key, dropout_rate=0.25, deterministic=True)
  stock = nn.dot_product_attention(q, k, v, bias=bias, mask=nn.make_causal_mask(jnp.ones((B, T))))
  assert rel_err(evaluated, stock) < 1e-5


def test_ring_attention_module_trains_with_dropout():
  """RingAttention(dropout_rate=...) with deterministic=False and a 'dropout' rng: different
  keys give different outputs, the same key the same one, and gradients are finite."""
  x = _x(5)
  m = RingAttention(num_heads=N, dropout_rate=0.3, mask=masks.Causal())
  params = m.init(jax.random.key(0), x, deterministic=True)
  run = lambda p, seed: m.apply(p, x, deterministic=False,
                                rngs={"dropout": jax.random.key(seed)})
  a, b, a2 = run(params, 1), run(params, 2), run(params, 1)
  assert rel_err(a, b) > 1e-2 and rel_err(a, a2) == 0.0
  g = jax.grad(lambda p: (run(p, 1) ** 2).sum())(params)
  assert all(np.isfinite(np.asarray(l)).all() for l in jax.tree.leaves(g))


FIELD_COMBOS = [
    dict(),
    dict(normalize_qk=True),
    dict(use_bias=False, qkv_features=64, out_features=8),
    dict(normalize_qk=True, dtype=jnp.bfloat16, param_dtype=jnp.float32),
    dict(precision=jax.lax.Precision.HIGHEST, force_fp32_for_softmax=True,
         out_kernel_init=nn.initializers.ones, bias_init=nn.initializers.normal(0.1)),
    dict(dropout_rate=0.3, deterministic=True),
    dict(kernel_init=nn.initializers.lecun_normal(), out_bias_init=nn.initializers.ones,
         broadcast_dropout=False, qkv_dot_general=jax.lax.dot_general,
         out_dot_general=jax.lax.dot_general),
]


@pytest.mark.parametrize("fields", FIELD_COMBOS, ids=lambda f: ",".join(f) or "defaults")
def test_ring_attention_is_a_drop_in_for_every_field(fields):
  """Same parameter tree (names, shapes, dtypes, initial values) and the same outputs as the stock
  module, for each field combination; the stock checkpoint loads unchanged."""
  x = _x(6)
  stock = nn.MultiHeadDotProductAttention(num_heads=N, **fields)
  ours = RingAttention(num_heads=N, mask=masks.Causal(), **fields)
  p_stock, p_ours = stock.init(jax.random.key(0), x), ours.init(jax.random.key(0), x)
  assert jax.tree.structure(p_stock) == jax.tree.structure(p_ours)
  for a, b in zip(jax.tree.leaves(p_stock), jax.tree.leaves(p_ours)):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(a, b)
  mask = nn.make_causal_mask(jnp.ones((B, T)))
  ref = stock.apply(p_stock, x, mask=mask)
  out = ours.apply(p_stock, x)
  assert out.dtype == ref.dtype and out.shape == ref.shape
  tol = 2e-2 if fields.get("dtype") == jnp.bfloat16 else 1e-5
  assert rel_err(out, ref) < tol


def test_ring_attention_inputs_kv_and_cross_attention():
  xq, xkv = _x(7), _x(8, t=24)
  stock = nn.MultiHeadDotProductAttention(num_heads=N)
  ours = RingAttention(num_heads=N)
  params = stock.init(jax.random.key(0), xq, xkv)
  assert rel_err(ours.apply(params, xq, xkv), stock.apply(params, xq, xkv)) < 1e-5
  with pytest.warns(DeprecationWarning):
    out = ours.apply(params, xq, inputs_kv=xkv)
  assert rel_err(out, stock.apply(params, xq, xkv)) < 1e-5


def test_ring_attention_decode_matches_stock():
  """decode=True keeps Flax's cache; each step attends its one query (at the cache index) to the
  cached keys, with the module's mask spec on those positions."""
  x = _x(9, t=8)
  stock = nn.MultiHeadDotProductAttention(num_heads=N, decode=True)
  ours = RingAttention(num_heads=N, decode=True, mask=masks.Causal())
  params = stock.init(jax.random.key(0), x)["params"]
  cache_s = stock.init(jax.random.key(0), x)["cache"]
  cache_o = ours.init(jax.random.key(0), x)["cache"]
  assert jax.tree.map(jnp.shape, cache_s) == jax.tree.map(jnp.shape, cache_o)
  for t in range(8):
    ref, vs = stock.apply({"params": params, "cache": cache_s}, x[:, t:t + 1], mutable=["cache"])
    out, vo = ours.apply({"params": params, "cache": cache_o}, x[:, t:t + 1], mutable=["cache"])
    cache_s, cache_o = vs["cache"], vo["cache"]
    assert rel_err(out, ref) < 1e-5, t


@pytest.mark.parametrize("heads_sharded", [False, True], ids=["sp8", "hp2_sp4"])
def test_ring_attention_decodes_a_cache_sharded_along_its_slots(heads_sharded):
  """Under a mesh holding ``config.axis_name``, decode=True keeps the cache sharded along its
  slots (a constraint that survives jit; its heads over ``head_axis``) and each step equals
  stock Flax's, token by token; the step runs decode_attention over the shards (a shard_map),
  not a dense mask."""
  x = _x(12, t=16)
  if heads_sharded:
    mesh = jax.make_mesh((2, 4), ("hp", "sp"), axis_types=(AxisType.Auto,) * 2)
    cfg = SequenceParallelConfig(axis_name="sp", head_axis="hp", backend="xla")
  else:
    mesh = jax.make_mesh((8,), ("sp",), axis_types=(AxisType.Auto,))
    cfg = SequenceParallelConfig(axis_name="sp", backend="xla")
  stock = nn.MultiHeadDotProductAttention(num_heads=N, decode=True)
  ours = RingAttention(num_heads=N, decode=True, mask=masks.Causal(), config=cfg, mesh=mesh)
  init = stock.init(jax.random.key(0), x)
  params, cache_s = init["params"], init["cache"]
  cache_o = ours.init(jax.random.key(0), x)["cache"]
  step = lambda m: jax.jit(lambda c, xt: m.apply({"params": params, "cache": c}, xt,
                                                  mutable=["cache"]))
  ours_step, stock_step = step(ours), step(stock)
  spec = lambda c: (*c["cached_key"].sharding.spec, None, None)[1:3]  # [B, S, K, H]: S, K
  want = ("sp", "hp" if heads_sharded else None)
  assert spec(cache_o) == want
  for t in range(16):
    ref, vs = stock_step(cache_s, x[:, t:t + 1])
    out, vo = ours_step(cache_o, x[:, t:t + 1])
    cache_s, cache_o = vs["cache"], vo["cache"]
    assert rel_err(out, ref) < 1e-5, t
    assert spec(cache_o) == want, t
  text = ours_step.trace(cache_o, x[:, :1]).lower().as_text()
  assert "manual_computation" in text or "shard_map" in text


def _stock_token_by_token(stock, params, cache, x):
  """Stock Flax decoding ``x [B, T, D]`` one token per call: ``([B, T, F], final cache)``."""
  outs = []
  for t in range(x.shape[1]):
    out, v = stock.apply({"params": params, "cache": cache}, x[:, t:t + 1], mutable=["cache"])
    outs.append(out)
    cache = v["cache"]
  return jnp.concatenate(outs, axis=1), cache


@pytest.mark.parametrize("sharded", [False, True])
def test_ring_attention_decode_appends_a_chunk_in_one_call(sharded):
  """decode=True with T > 1 tokens (a prompt, then a speculative chunk, then single tokens)
  writes them at cache_index and attends causally: the outputs and the cache equal stock Flax
  fed the same tokens one by one; under a mesh the cache stays sharded along its slots."""
  x = _x(13, t=16)
  stock = nn.MultiHeadDotProductAttention(num_heads=N, decode=True)
  kw = {}
  if sharded:
    kw = dict(config=SequenceParallelConfig(axis_name="sp", backend="xla"),
              mesh=jax.make_mesh((8,), ("sp",), axis_types=(AxisType.Auto,)))
  ours = RingAttention(num_heads=N, decode=True, **kw)
  init = stock.init(jax.random.key(0), x)
  params, cache_s = init["params"], init["cache"]
  cache_o = ours.init(jax.random.key(0), x)["cache"]
  step = jax.jit(lambda c, xt: ours.apply({"params": params, "cache": c}, xt, mutable=["cache"]))
  outs = []
  for lo, hi in ((0, 9), (9, 13), (13, 14), (14, 16)):
    out, v = step(cache_o, x[:, lo:hi])
    outs.append(out)
    cache_o = v["cache"]
    if sharded:
      assert tuple(cache_o["cached_key"].sharding.spec)[1] == "sp"
  ref, cache_s = _stock_token_by_token(stock, params, cache_s, x)
  assert rel_err(jnp.concatenate(outs, axis=1), ref) < 1e-5
  assert int(cache_o["cache_index"]) == int(cache_s["cache_index"]) == 16
  for name in ("cached_key", "cached_value"):
    assert rel_err(cache_o[name], cache_s[name]) < 1e-6, name


@pytest.mark.ci_cases("mesh-None", "set_mesh-float8_e4m3fn")
@pytest.mark.parametrize("cache_dtype", [None, jnp.float8_e4m3fn],
                         ids=lambda d: jnp.dtype(d).name if d else "None")
@pytest.mark.parametrize("via", ["mesh", "set_mesh"])
def test_ring_attention_decodes_on_a_mesh_with_explicit_axes(via, cache_dtype):
  """On the mesh the README builds (``jax.make_mesh``: Explicit axes, batch over "dp", slots over
  "sp"), decode=True prefills in one call and then decodes token by token (with and without a
  dense mask), given as ``mesh=`` or active through ``jax.set_mesh``: outputs and cache equal
  stock Flax's and the cache stays sharded along its slots. (The cache write was a
  ``dynamic_update_slice`` of a replicated chunk into the sharded cache: a ShardingTypeError.)"""
  x = _x(16, t=16)
  mesh = jax.make_mesh((2, 4), ("dp", "sp"), axis_types=(AxisType.Explicit,) * 2)
  cfg = SequenceParallelConfig(axis_name="sp", batch_axes=("dp",), backend="xla")
  stock = nn.MultiHeadDotProductAttention(num_heads=N, decode=True)
  init = stock.init(jax.random.key(0), x)
  params, cache_s = init["params"], init["cache"]
  ours = RingAttention(num_heads=N, decode=True, config=cfg, cache_dtype=cache_dtype,
                       **({"mesh": mesh} if via == "mesh" else {}))
  step = jax.jit(lambda c, xt, m: ours.apply({"params": params, "cache": c}, xt, mask=m,
                                             mutable=["cache"]))
  ones = jnp.ones((B, 1, 1, 16), bool)
  # (start, stop, dense mask): a prompt in one call, then single tokens.
  calls = ((0, 9, None), (9, 10, None), (10, 11, None), (11, 12, ones), (12, 16, None))
  with jax.set_mesh(mesh) if via == "set_mesh" else contextlib.nullcontext():
    cache_o = ours.init(jax.random.key(0), x)["cache"]
    outs = []
    for lo, hi, m in calls:
      out, v = step(cache_o, x[:, lo:hi], m)
      outs.append(out)
      cache_o = v["cache"]
      assert tuple(cache_o["cached_key"].sharding.spec)[:2] == ("dp", "sp"), (lo, hi)
  ref, cache_s = _stock_token_by_token(stock, params, cache_s, x)
  tol = 1e-5 if cache_dtype is None else 0.05  # (FP8: quantized, see the test above)
  assert rel_err(jnp.concatenate(outs, axis=1), ref) < tol
  assert int(cache_o["cache_index"]) == 16
  for name in ("cached_key", "cached_value"):
    got = cache_o[name].astype(jnp.float32)
    if cache_dtype is not None:
      got = got * cache_o[f"{name}_descale"][:, None, :, None]
    assert rel_err(got, cache_s[name]) < (1e-6 if cache_dtype is None else 0.04), name


def test_an_fp8_cache_decodes_with_its_heads_sharded():
  """``config.head_axis``: an FP8 cache's slots over "sp", its heads and their descales over
  "hp" (Explicit axes), decoding as stock Flax within FP8's error."""
  x = _x(17, t=16)
  mesh = jax.make_mesh((2, 4), ("hp", "sp"), axis_types=(AxisType.Explicit,) * 2)
  cfg = SequenceParallelConfig(axis_name="sp", head_axis="hp", backend="xla")
  stock = nn.MultiHeadDotProductAttention(num_heads=N, decode=True)
  init = stock.init(jax.random.key(0), x)
  params, cache_s = init["params"], init["cache"]
  ours = RingAttention(num_heads=N, decode=True, config=cfg, mesh=mesh,
                       cache_dtype=jnp.float8_e4m3fn)
  step = jax.jit(lambda c, xt: ours.apply({"params": params, "cache": c}, xt, mutable=["cache"]))
  cache_o = ours.init(jax.random.key(0), x)["cache"]
  outs = []
  for lo, hi in ((0, 9), (9, 10), (10, 16)):
    out, v = step(cache_o, x[:, lo:hi])
    outs.append(out)
    cache_o = v["cache"]
  assert tuple(cache_o["cached_key"].sharding.spec)[1:3] == ("sp", "hp")
  assert tuple(cache_o["cached_key_descale"].sharding.spec)[-1] == "hp"
  ref, _ = _stock_token_by_token(stock, params, cache_s, x)
  assert rel_err(jnp.concatenate(outs, axis=1), ref) < 0.05


@pytest.mark.ci_cases(every=True)
@pytest.mark.parametrize("sharded", [False, True])
def test_ring_attention_keeps_an_fp8_decode_cache(sharded):
  """cache_dtype=float8_e4m3fn: the cache is FP8 with a float32 descale per batch row and head,
  fixed by the first write (the prompt: its absolute maximum times cache_headroom maps to the
  dtype's largest value); dequantized it holds the projected keys and values within FP8
  rounding, and every step's output is within FP8 error of the default cache's (a prompt, then
  single tokens and a chunk; under a mesh the cache stays sharded along its slots)."""
  x = _x(17, t=16)
  kw = {}
  if sharded:
    kw = dict(config=SequenceParallelConfig(axis_name="sp", backend="xla"),
              mesh=jax.make_mesh((8,), ("sp",), axis_types=(AxisType.Auto,)))
  wide = RingAttention(num_heads=N, decode=True, **kw)
  f8 = RingAttention(num_heads=N, decode=True, cache_dtype=jnp.float8_e4m3fn, **kw)
  params = wide.init(jax.random.key(0), x)["params"]
  cache_w, cache_f = (m.init(jax.random.key(0), x)["cache"] for m in (wide, f8))
  assert cache_f["cached_key"].dtype == jnp.float8_e4m3fn
  assert cache_f["cached_value"].shape == cache_w["cached_value"].shape
  assert cache_f["cached_key_descale"].shape == (B, N)
  step = lambda m: jax.jit(lambda c, xt: m.apply({"params": params, "cache": c}, xt,
                                                 mutable=["cache"]))
  step_w, step_f = step(wide), step(f8)
  for lo, hi in ((0, 9), (9, 10), (10, 13), (13, 16)):
    out_w, v = step_w(cache_w, x[:, lo:hi])
    cache_w = v["cache"]
    out_f, v = step_f(cache_f, x[:, lo:hi])
    cache_f = v["cache"]
    assert 1e-4 < rel_err(out_f, out_w) < 0.05, (lo, hi)  # quantized, within FP8 error
    if lo == 0:
      descale = cache_f["cached_key_descale"]
      amax = jnp.max(jnp.abs(cache_w["cached_key"][:, :9]), axis=(1, 3))  # the prompt's [B, N]
      np.testing.assert_allclose(descale, amax * 4.0 / 448.0, rtol=1e-6)
    if sharded:
      assert tuple(cache_f["cached_key"].sharding.spec)[1] == "sp"
  assert np.array_equal(cache_f["cached_key_descale"], descale)  # fixed by the first write
  for name in ("cached_key", "cached_value"):
    got = cache_f[name].astype(jnp.float32) * cache_f[f"{name}_descale"][:, None, :, None]
    assert rel_err(got, cache_w[name]) < 0.04, name


def test_ring_attention_keeps_a_bfloat16_cache_for_a_float32_model():
  x = _x(19, t=8)
  wide = RingAttention(num_heads=N, decode=True)
  narrow = RingAttention(num_heads=N, decode=True, cache_dtype=jnp.bfloat16)
  params = wide.init(jax.random.key(0), x)["params"]
  cache_w, cache_n = (m.init(jax.random.key(0), x)["cache"] for m in (wide, narrow))
  assert cache_n["cached_value"].dtype == jnp.bfloat16 and "cached_key_descale" not in cache_n
  for lo, hi in ((0, 5), (5, 6)):
    out_w, v = wide.apply({"params": params, "cache": cache_w}, x[:, lo:hi], mutable=["cache"])
    cache_w = v["cache"]
    out_n, v = narrow.apply({"params": params, "cache": cache_n}, x[:, lo:hi],
                            mutable=["cache"])
    cache_n = v["cache"]
    assert out_n.dtype == jnp.float32 and 1e-5 < rel_err(out_n, out_w) < 2e-2, (lo, hi)


def test_ring_attention_cache_dtype_errors_name_the_fix():
  x = _x(18, t=8)
  bad = ((dict(cache_dtype=jnp.int8), "not a float dtype"),
         (dict(cache_dtype=jnp.float8_e4m3fn, attention_fn=make_attention_fn()),
          "needs attention_fn=None"),
         (dict(cache_dtype=jnp.float8_e4m3fn, cache_headroom=0.5), "finite number >= 1"),
         (dict(cache_dtype=jnp.float8_e4m3fnuz), "8-bit float the attention kernels do not"),
         (dict(cache_dtype="int4-ish"), "not a float dtype"))
  for fields, match in bad:
    with pytest.raises(ValueError, match=match):
      RingAttention(num_heads=N, decode=True, **fields).init(jax.random.key(0), x)
  # A cache made by another module (no FP8, no descales) is refused, not silently used.
  f8 = RingAttention(num_heads=N, decode=True, cache_dtype=jnp.float8_e4m3fn)
  v = RingAttention(num_heads=N, decode=True).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="cached_key is float32: it was made by another module"):
    f8.apply(v, x[:, :1], mutable=["cache"])


def test_ring_attention_decode_chunk_errors_name_the_fix():
  x = _x(14, t=8)
  ours = RingAttention(num_heads=N, decode=True)
  v = ours.init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="needs mask=None"):
    ours.apply(v, x[:, :3], mask=jnp.ones((B, 1, 3, 8), bool), mutable=["cache"])
  with pytest.raises(ValueError, match="at most S=8 tokens"):
    ours.apply(v, _x(15, t=9), mutable=["cache"])


def test_a_decode_call_past_the_cache_end_raises_or_is_nan():
  """A chunk (or token) that runs past the cache's slots is refused where the index is concrete
  and makes the output NaN under jit (Flax's write clamps its start: silently wrong)."""
  x = _x(16, t=8)
  ours = RingAttention(num_heads=N, mask=masks.Causal(), decode=True)
  params, cache = ours.init(jax.random.key(0), x).values()
  step = lambda c, xt: ours.apply({"params": params, "cache": c}, xt, mutable=["cache"])
  _, c6 = step(cache, x[:, :6])
  with pytest.raises(ValueError, match=r"slots up to 9, past the cache's 8 slots"):
    step(c6["cache"], x[:, 4:8])
  out, _ = jax.jit(step)(c6["cache"], x[:, 4:8])
  assert bool(jnp.all(jnp.isnan(out)))
  out, _ = jax.jit(step)(c6["cache"], x[:, 4:6])  # (fits: slots 6, 7)
  assert bool(jnp.all(jnp.isfinite(out)))


def test_make_attention_fn_with_a_spec_refuses_decode_steps():
  """A mask spec compares arange(T) with arange(S): a stock module's decode step (T=1 against
  the cache) would see slot 0 only. It raises naming the fix; without a spec decoding matches
  the stock module."""
  x = _x(17, t=8)
  stock = nn.MultiHeadDotProductAttention(num_heads=N, decode=True)
  params, cache = stock.init(jax.random.key(0), x).values()
  ref = nn.MultiHeadDotProductAttention(num_heads=N).apply(
      {"params": params}, x, mask=nn.make_causal_mask(jnp.ones((B, 8))))
  spec = nn.MultiHeadDotProductAttention(num_heads=N, decode=True,
                                         attention_fn=make_attention_fn(mask=masks.Causal()))
  with pytest.raises(ValueError, match=r"T=1 != S=8.*make_attention_fn\(\) without a mask spec"):
    spec.apply({"params": params, "cache": cache}, x[:, :1], mutable=["cache"])
  plain = nn.MultiHeadDotProductAttention(num_heads=N, decode=True,
                                          attention_fn=make_attention_fn())
  outs = []
  for t in range(8):
    o, upd = plain.apply({"params": params, "cache": cache}, x[:, t:t + 1], mutable=["cache"])
    cache = upd["cache"]
    outs.append(o)
  assert rel_err(jnp.concatenate(outs, axis=1), ref) < 1e-5


def test_masks_broadcast_over_several_batch_dims_as_in_flax():
  """Inputs ``[2, 3, T, D]`` with masks and biases broadcasting over some batch dims."""
  x = jnp.asarray(np.random.default_rng(18).standard_normal((2, 3, 8, D)), jnp.float32)
  stock = nn.MultiHeadDotProductAttention(num_heads=N)
  params = stock.init(jax.random.key(0), x)
  causal = jnp.tril(jnp.ones((8, 8), bool))
  key_ok = jnp.arange(8) < jnp.asarray([8, 5, 3])[:, None]  # [3, S]: per second batch dim
  for mask in (jnp.broadcast_to(causal, (2, 1, 1, 8, 8)),
               causal & key_ok[:, None, None, :],  # [3, 1, T, S]
               causal & key_ok[None, :, None, None, :]):  # [1, 3, 1, T, S]
    ref = stock.apply(params, x, mask=mask)
    assert rel_err(RingAttention(num_heads=N).apply(params, x, mask=mask), ref) < 1e-5
  with pytest.raises(ValueError, match=r"`mask` has shape \(4, 1, 8, 8\).*batch dims \(2, 3\)"):
    RingAttention(num_heads=N).apply(params, x, mask=jnp.ones((4, 1, 8, 8), bool))


def test_module_misuse_names_the_fix():
  """Cross-attention with segment ids or on a ring, and a decode cache the ring does not divide,
  raise naming the module's arguments."""
  x, y = _x(19, t=16), _x(20, t=8)
  ours = RingAttention(num_heads=N)
  params = ours.init(jax.random.key(0), x)
  with pytest.raises(ValueError, match=r"segment_ids=...\) is for self-attention.*dense `mask`"):
    ours.apply(params, x, y, segment_ids=jnp.zeros((B, 16), jnp.int32))
  cfg = SequenceParallelConfig(axis_name="sp")
  mesh = jax.make_mesh((4,), ("sp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
  with pytest.raises(ValueError, match=r"for cross-attention use a RingAttention without"):
    RingAttention(num_heads=N, config=cfg, mesh=mesh).apply(params, x, y)
  with pytest.raises(ValueError, match=r"cache's 14 slots over the 4 devices.*initialise with 16"):
    RingAttention(num_heads=N, decode=True, config=cfg, mesh=mesh).init(
        jax.random.key(0), _x(21, t=14))


def test_a_precision_the_gpu_kernels_do_not_take_warns(monkeypatch):
  """Flax passes the module's ``precision`` to attention_fn: above the default, for float32 on a
  GPU (TF32 in the kernels), it warns at the user's line; not where it holds (CPU, float64,
  ``backend="xla"`` under ``jax.default_matmul_precision("highest")``)."""
  import warnings
  from pallas_ring import nn as pr_nn
  f32, f64 = np.zeros((1, 4, 2, 8), np.float32), np.zeros((1, 4, 2, 8), np.float64)
  xla = SequenceParallelConfig(backend="xla")
  monkeypatch.setattr(pr_nn.jax, "default_backend", lambda: "gpu")
  with pytest.warns(UserWarning, match=r"precision='highest' is applied to the module's proj"):
    pr_nn._note_precision("highest", f32, None)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for precision, x, cfg in [(None, f32, None), (jax.lax.Precision.DEFAULT, f32, None),
                              (("default", "default"), f32, None), ("highest", f64, None)]:
      pr_nn._note_precision(precision, x, cfg)
    with jax.default_matmul_precision("highest"):
      pr_nn._note_precision("highest", f32, xla)
    monkeypatch.setattr(pr_nn.jax, "default_backend", lambda: "cpu")
    pr_nn._note_precision("highest", f32, None)


def test_a_mesh_field_with_explicit_axes_trains_without_set_mesh():
  """``RingAttention(mesh=jax.make_mesh(...))`` (Explicit axes) outside ``jax.set_mesh``: the
  output's type carries no sharding, so Flax's projections differentiate under jit (they
  raised "Contracting dimensions are sharded")."""
  x = _x(22)
  cfg = SequenceParallelConfig(axis_name="sp", layout="zigzag", batch_axes=("dp",))
  mesh = jax.make_mesh((2, 4), ("dp", "sp"), axis_types=(AxisType.Explicit,) * 2)
  single = RingAttention(num_heads=N, mask=masks.Causal())
  params = single.init(jax.random.key(0), x)
  want = jax.grad(lambda p: jnp.sum(single.apply(p, x) ** 2))(params)
  ring = RingAttention(num_heads=N, mask=masks.Causal(), config=cfg, mesh=mesh)
  xz = layouts.permute(x, "zigzag", 4)
  got = jax.jit(jax.grad(lambda p: jnp.sum(ring.apply(p, xz) ** 2)))(params)
  assert rel_err(_flat(got), _flat(want)) < 1e-5


def test_ring_attention_under_a_mesh_without_its_axis_raises():
  x = _x(10)
  cfg = SequenceParallelConfig(axis_name="sp", layout="zigzag")
  ours = RingAttention(num_heads=N, mask=masks.Causal(), config=cfg)
  params = ours.init(jax.random.key(0), x)
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  with jax.set_mesh(mesh):
    with pytest.raises(ValueError, match=r"axis_name='sp' is not an axis of the active mesh.*"
                                         r"\('data',\)"):
      ours.apply(params, x)
  with pytest.raises(ValueError, match=r"not an axis of the `mesh` given"):
    RingAttention(num_heads=N, config=cfg, mesh=mesh).apply(params, x)
  with pytest.raises(ValueError, match=r"not an axis of the active mesh"):
    with jax.set_mesh(mesh):
      nn.MultiHeadDotProductAttention(num_heads=N, attention_fn=make_attention_fn(cfg)).apply(
          params, x)


def test_attention_fn_output_dtype_follows_flax_promotion():
  rng = np.random.default_rng(11)
  q = jnp.asarray(rng.standard_normal((B, T, N, 8)), jnp.bfloat16)
  k = jnp.asarray(rng.standard_normal((B, T, N, 8)), jnp.float32)
  ours = make_attention_fn()(q, k, k)
  ref = nn.dot_product_attention(q, k, k)
  assert ours.dtype == ref.dtype == jnp.float32
  assert rel_err(ours, ref) < 1e-5
  assert make_attention_fn()(q, k, k, dtype=jnp.bfloat16).dtype == jnp.bfloat16


def _mesh():
  return jax.make_mesh((2, 4), ("dp", "sp"), axis_types=(AxisType.Auto,) * 2)


def test_ring_attention_module_on_a_mesh_matches_and_uses_ppermute_in_scan():
  mesh = _mesh()
  cfg = SequenceParallelConfig(axis_name="sp", layout="zigzag", batch_axes=("dp",), backend="xla")
  x = _x(5)
  single = RingAttention(num_heads=N, mask=masks.Causal())
  ring = RingAttention(num_heads=N, mask=masks.Causal(), config=cfg, mesh=mesh)
  params = single.init(jax.random.key(5), x)
  xz = jax.device_put(layouts.permute(x, "zigzag", 4), NamedSharding(mesh, P("dp", "sp")))
  out = layouts.unpermute(jax.jit(ring.apply)(params, xz), "zigzag", 4)
  assert rel_err(out, single.apply(params, x)) < 1e-5
  jaxpr = str(jax.make_jaxpr(ring.apply)(params, xz))
  assert any("ppermute" in part for part in jaxpr.split("scan[")[1:])
  # The active mesh (jax.set_mesh) is picked up when no mesh is given.
  with jax.set_mesh(mesh):
    ctx = RingAttention(num_heads=N, mask=masks.Causal(), config=cfg)
    g = jax.jit(jax.grad(lambda p: jnp.sum(ctx.apply(p, xz) ** 2)))(params)
  g_ref = jax.grad(lambda p: jnp.sum(single.apply(p, x) ** 2))(params)
  assert rel_err(_flat(g), _flat(g_ref)) < 1e-5


@pytest.mark.ci
def test_transformer_trains_identically_single_device():
  stock = train(TransformerLM(), steps=50)
  ours = train(TransformerLM(attention_fn=make_attention_fn(mask=masks.Causal())), steps=50)
  assert stock[-1] < 0.9 * stock[0]  # it learns
  np.testing.assert_allclose(ours, stock, rtol=1e-3)


@pytest.mark.ci
def test_transformer_trains_identically_on_a_zigzag_mesh():
  mesh = _mesh()
  cfg = SequenceParallelConfig(axis_name="sp", layout="zigzag", batch_axes=("dp",), backend="xla")
  shard = lambda a: jax.device_put(a, NamedSharding(mesh, P("dp", "sp")))
  stock = train(TransformerLM(), steps=50)
  with jax.set_mesh(mesh):
    ring = train(TransformerLM(attention_fn=make_attention_fn(cfg, mask=masks.Causal())),
                 steps=50, layout="zigzag", ring_size=4, shard=shard)
  np.testing.assert_allclose(ring, stock, rtol=1e-3)


@pytest.mark.ci
def test_transformer_trains_with_attention_dropout():
  """Flax's MultiHeadDotProductAttention(dropout_rate=0.1) with our attention_fn: the example LM
  trains (finite, falling loss), on one device and on a zigzag ring."""
  from pallas_ring.examples.transformer import LMConfig
  lm = lambda cfg=None: TransformerLM(LMConfig(dropout_rate=0.1),
                                      attention_fn=make_attention_fn(cfg, mask=masks.Causal()))
  losses = train(lm(), steps=50)
  assert np.isfinite(losses).all() and np.mean(losses[-5:]) < 0.85 * np.mean(losses[:5])
  mesh = _mesh()
  cfg = SequenceParallelConfig(axis_name="sp", layout="zigzag", batch_axes=("dp",), backend="xla")
  shard = lambda a: jax.device_put(a, NamedSharding(mesh, P("dp", "sp")))
  with jax.set_mesh(mesh):
    ring = train(lm(cfg), steps=50, layout="zigzag", ring_size=4, shard=shard)
  # The same keys and global positions: the ring drops exactly what one device drops.
  np.testing.assert_allclose(ring, losses, rtol=1e-3)


def test_nn_is_reachable_from_the_package():
  import pallas_ring
  assert pallas_ring.nn.RingAttention is RingAttention
  assert pallas_ring.nn.make_attention_fn is make_attention_fn


def test_an_auto_named_ring_attention_loads_a_stock_checkpoint():
  """Inside a parent module, an unnamed RingAttention takes the stock module's auto name
  (MultiHeadDotProductAttention_<i>, counted with stock ones), so the stock parameter tree loads
  unchanged."""
  class Model(nn.Module):
    ring: bool

    @nn.compact
    def __call__(self, x):
      cls = RingAttention if self.ring else nn.MultiHeadDotProductAttention
      x = nn.MultiHeadDotProductAttention(num_heads=N)(x)  # a stock one first: one counter
      return cls(num_heads=N)(x) + cls(num_heads=N)(x)

  x = _x(13)
  stock = Model(False).init(jax.random.key(0), x)
  ours = Model(True).init(jax.random.key(0), x)
  assert jax.tree.structure(stock) == jax.tree.structure(ours)
  assert sorted(stock["params"]) == ["MultiHeadDotProductAttention_0",
                                     "MultiHeadDotProductAttention_1",
                                     "MultiHeadDotProductAttention_2"]
  assert rel_err(Model(True).apply(stock, x), Model(False).apply(stock, x)) < 1e-5


def test_ring_attention_under_nn_remat_is_named_as_the_stock_module_is():
  """``nn.remat(RingAttention)`` takes the name of ``nn.remat`` of the stock module
  (CheckpointMultiHeadDotProductAttention_<i>); a user's subclass keeps Flax's own naming."""
  class Model(nn.Module):
    cls: type

    @nn.compact
    def __call__(self, x):
      return nn.remat(self.cls)(num_heads=N)(x)

  x = _x(23)
  stock = Model(nn.MultiHeadDotProductAttention).init(jax.random.key(0), x)
  assert list(stock["params"]) == ["CheckpointMultiHeadDotProductAttention_0"]
  ref = Model(nn.MultiHeadDotProductAttention).apply(stock, x)
  assert rel_err(Model(RingAttention).apply(stock, x), ref) < 1e-5

  class Mine(RingAttention):
    pass

  class User(nn.Module):
    @nn.compact
    def __call__(self, x):
      return Mine(num_heads=N)(x)

  assert list(User().init(jax.random.key(0), x)["params"]) == ["Mine_0"]


@pytest.mark.ci
def test_example_prints_both_losses_at_every_step(capsys):
  """The README says the example's two runs match at every step: it prints every step."""
  from pallas_ring.examples import transformer
  worst = transformer.main(steps=50)
  out = capsys.readouterr().out.splitlines()
  assert "50 Adam steps" in out[0] and "relative difference" in out[1] and len(out) == 53
  rows = [[float(x) for x in line.split()] for line in out[2:52]]
  assert [int(r[0]) for r in rows] == list(range(1, 51))
  for _, stock, ours, rel in rows:
    assert abs(stock - ours) <= 1e-3 * stock and rel < 1e-3
  assert rows[-1][1] < rows[0][1] - 0.5  # it learns
  assert worst < 1e-3 and f"{worst:.1e}" in out[52]


@pytest.mark.parametrize("cache_dtype, axis_type", [(None, AxisType.Auto),
                                                    (jnp.float8_e4m3fn, AxisType.Explicit)],
                         ids=["None-Auto", "float8_e4m3fn-Explicit"])
def test_unbatched_inputs_decode_on_a_mesh(cache_dtype, axis_type):
  """Inputs without a batch axis (``[T, D]``, as Flax takes them): the cache ``[S, K, H]`` is
  sharded along its slots (its spec had a batch entry too many) and decoding matches stock."""
  x = _x(19, t=16)[0]  # [T, D]
  mesh = jax.make_mesh((8,), ("sp",), axis_types=(axis_type,))
  cfg = SequenceParallelConfig(axis_name="sp", backend="xla")
  stock = nn.MultiHeadDotProductAttention(num_heads=N, decode=True)
  init = stock.init(jax.random.key(0), x)
  params, cache_s = init["params"], init["cache"]
  ours = RingAttention(num_heads=N, decode=True, config=cfg, mesh=mesh, cache_dtype=cache_dtype)
  cache_o = ours.init(jax.random.key(0), x)["cache"]
  step = jax.jit(lambda c, xt: ours.apply({"params": params, "cache": c}, xt, mutable=["cache"]))
  for t in range(4):
    ref, vs = stock.apply({"params": params, "cache": cache_s}, x[t:t + 1], mutable=["cache"])
    out, vo = step(cache_o, x[t:t + 1])
    cache_s, cache_o = vs["cache"], vo["cache"]
    assert rel_err(out, ref) < (1e-5 if cache_dtype is None else 0.05), t
  assert tuple(cache_o["cached_key"].sharding.spec)[:1] == ("sp",)
