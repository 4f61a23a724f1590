"""``flash_attention``: the dense-reference conformance cases every backend runs, its edge cases
(the lse cotangent, ``-inf`` sinks, positions at the int32 limits, float64 and x64 mode) and the
numerical pitfalls seen in other libraries (PRIOR_ART). The per-backend cases are mixins that
``conformance.Conformance`` gathers; ``test_backend_*`` run them for each backend."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from pallas_ring import (BlockSizes, SequenceParallelConfig, flash_attention, layouts, masks,
                         reference, sharded_attention)
from pallas_ring.kernels.common import merge
from conftest import kernel_dtype, rel_err, small_blocks

TOL = {jnp.float32: 2e-3, jnp.bfloat16: 2e-2, jnp.float16: 2e-2}


CASES = {
    # name: (mask, T, S, N, K, H, dtype, extras)
    "causal_mha_f32": (masks.Causal(), 64, 64, 2, 2, 64, jnp.float32, {}),
    "causal_gqa_bf16_odd": (masks.Causal(), 75, 75, 4, 2, 64, jnp.bfloat16, {}),
    "full_mqa_f16": (masks.Full(), 40, 72, 4, 1, 32, jnp.float16, {}),
    "window_softcap": (masks.SlidingWindow(9, 3), 70, 70, 2, 1, 64, jnp.float32, {"softcap": 4.0}),
    "chunked_sinks": (masks.ChunkedCausal(24), 64, 64, 4, 2, 64, jnp.float32, {"sinks": True}),
    "prefix_or_window": (masks.PrefixLM(20) | masks.SlidingWindow(5), 50, 50, 2, 2, 128,
                         jnp.float32, {}),
    "documents_causal_bf16": (masks.Causal(), 96, 96, 4, 4, 64, jnp.bfloat16, {"segments": True}),
    # FULL blocks that are not consecutive (prefix blocks, then a gap, then the window): only the
    # leading run is directly addressed, the rest go through the masked loop.
    "prefix_or_wide_window": (masks.PrefixLM(32) | masks.SlidingWindow(40), 128, 128, 2, 1, 32,
                              jnp.float32, {}),
    "dense_and_causal": (masks.Causal(), 48, 48, 2, 2, 64, jnp.float32, {"dense": True}),
    "custom_positions_sinks_softcap": (
        masks.Custom(lambda q, k: (q - k) % 3 != 1), 33, 65, 2, 1, 32, jnp.float32,
        {"positions": True, "sinks": True, "softcap": 2.0}),
    "head_dim_80_causal": (masks.Causal(), 40, 40, 2, 2, 80, jnp.float32, {}),
    "head_dim_256_window": (masks.SlidingWindow(16), 64, 64, 2, 1, 256, jnp.bfloat16, {}),
    # DeepSeek-style MLA: v has its own head dim (192 / 128), and one wider than q/k's.
    "mla_192_128_causal_bf16": (masks.Causal(), 64, 64, 2, 1, 192, jnp.bfloat16, {"hv": 128}),
    "value_head_dim_wider_documents": (masks.Full(), 40, 40, 2, 2, 32, jnp.float32,
                                       {"hv": 64, "segments": True}),
}


def _inputs(name, seed=0, backend=None):
  mask, t, s, n, kh, h, dtype, ex = CASES[name]
  dtype = kernel_dtype(backend, dtype)
  rng = np.random.default_rng(zlib.crc32(name.encode()) + seed)  # (str hash() is salted)
  b = 2
  q = jnp.asarray(rng.standard_normal((b, t, n, h)), dtype)
  k = jnp.asarray(rng.standard_normal((b, s, kh, h)), dtype)
  v = jnp.asarray(rng.standard_normal((b, s, kh, ex.get("hv", h))), dtype)
  kw = dict(mask=mask, softcap=ex.get("softcap"))
  if ex.get("sinks"):
    kw["sinks"] = jnp.asarray(rng.standard_normal(n), jnp.float32)
  if ex.get("segments"):
    bounds = np.sort(rng.integers(0, t, size=(b, 3)), axis=1)
    seg = (np.arange(t)[None, :, None] >= bounds[:, None, :]).sum(-1).astype(np.int32)
    kw["segment_ids"] = jnp.asarray(seg)
  if ex.get("dense"):
    kw["dense_mask"] = jnp.asarray(rng.random((b, 1, t, s)) > 0.3)
  if ex.get("positions"):
    kw["q_positions"] = jnp.asarray(np.arange(t) * 2 + 5, jnp.int32)
    kw["kv_positions"] = jnp.asarray(np.arange(s), jnp.int32)
  return q, k, v, kw, dtype


def test_jit_vmap_checkpoint_xla():
  rng = np.random.default_rng(5)
  q = jnp.asarray(rng.standard_normal((3, 2, 24, 2, 32)), jnp.float32)
  f = lambda x: flash_attention(x, x, x, mask=masks.Causal(), block_sizes=BlockSizes(8, 8, 8, 8),
                                backend="xla")
  ref = jax.vmap(lambda x: reference.attention(x, x, x, mask=masks.Causal())[0])(q)
  tol = 1e-5 if jax.default_backend() == "cpu" else 2e-3  # GPU float32 dots run as TF32
  assert rel_err(jax.jit(jax.vmap(f))(q), ref) < tol
  g1 = jax.grad(lambda x: jnp.sum(jax.checkpoint(f)(x) ** 2))(q[0])
  g2 = jax.grad(lambda x: jnp.sum(reference.attention(x, x, x, mask=masks.Causal())[0] ** 2))(q[0])
  assert rel_err(g1, g2) < tol


def test_backward_jaxpr_has_no_t_by_s_array():
  t = 512
  q = jax.ShapeDtypeStruct((1, t, 2, 64), jnp.float32)
  f = lambda x: jnp.sum(flash_attention(x, x, x, mask=masks.Causal(), backend="pallas_triton",
                                        interpret=True))
  jaxpr = jax.make_jaxpr(jax.grad(f))(q)

  def sizes(jx):
    for eq in jx.eqns:
      for var in eq.outvars:
        yield int(np.prod(var.aval.shape)) if hasattr(var.aval, "shape") else 0
      for val in eq.params.values():
        sub = getattr(val, "jaxpr", val)
        if hasattr(sub, "eqns"):
          yield from sizes(sub)

  assert max(sizes(jaxpr.jaxpr)) < t * t


class FlashCases:
  """Every backend against the dense reference: forward, lse, gradients (``conformance``)."""

  @pytest.mark.ci_cases("causal_mha_f32", "full_mqa_f16", "chunked_sinks", "prefix_or_wide_window",
                        "documents_causal_bf16", "dense_and_causal",
                        "custom_positions_sinks_softcap")
  @pytest.mark.parametrize("name", list(CASES))
  def test_conformance(self, name):
    backend = self.backend
    q, k, v, kw, dtype = _inputs(name, backend=backend)
    bs = small_blocks(backend, max(q.shape[-1], v.shape[-1]))
    tol = TOL[dtype]
    if "dense_mask" in kw and not self.dense_mask:
      with pytest.raises(ValueError, match="cannot serve this call: a dense mask"):
        flash_attention(q, k, v, backend=backend, block_sizes=bs, **kw)
      return
    out, lse = flash_attention(q, k, v, backend=backend, block_sizes=bs, return_lse=True, **kw)
    ref_out, ref_lse = reference.attention(q, k, v, **kw)
    assert out.dtype == q.dtype and out.shape == q.shape[:3] + v.shape[3:]
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    assert rel_err(out, ref_out) < tol, rel_err(out, ref_out)
    finite = np.isfinite(np.asarray(ref_lse))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
    assert rel_err(np.asarray(lse)[finite], np.asarray(ref_lse)[finite]) < tol

    rng = np.random.default_rng(7)
    do = jnp.asarray(rng.standard_normal(out.shape), dtype)
    args = (q, k, v) + ((kw.pop("sinks"),) if "sinks" in kw else ())

    def loss(fn):
      def f(q_, k_, v_, *sk):
        extra = {"sinks": sk[0]} if sk else {}
        return jnp.sum(fn(q_, k_, v_, **kw, **extra).astype(jnp.float32) * do.astype(jnp.float32))
      return f

    ours = loss(lambda *a, **k_: flash_attention(*a, backend=backend, block_sizes=bs, **k_))
    ref = loss(lambda *a, **k_: reference.attention(*a, **k_)[0])
    argnums = tuple(range(len(args)))
    g_ours = jax.grad(ours, argnums=argnums)(*args)
    g_ref = jax.grad(ref, argnums=argnums)(*args)
    for which, a, r in zip("qkvs", g_ours, g_ref):
      assert a.dtype == r.dtype
      assert np.all(np.isfinite(np.asarray(a, np.float32))), which
      assert rel_err(a, r) < tol, (which, rel_err(a, r))

  def test_rows_with_no_visible_key(self):
    """Whole rows, whole blocks: output 0, lse -inf, gradients 0, nothing NaN."""
    backend = self.backend
    rng = np.random.default_rng(3)
    t = 40
    dt = kernel_dtype(backend, jnp.float32)
    q = jnp.asarray(rng.standard_normal((1, t, 2, 32)), dt)
    k = jnp.asarray(rng.standard_normal((1, t, 2, 32)), dt)
    # Keys sit at positions 20..59: queries 0..19 see nothing under a causal mask.
    kw = dict(mask=masks.Causal(), q_positions=jnp.arange(t), kv_positions=jnp.arange(t) + 20)
    bs = small_blocks(backend)
    out, lse = flash_attention(q, k, k, backend=backend, block_sizes=bs, return_lse=True, **kw)
    assert np.all(np.asarray(out)[:, :20] == 0)
    assert np.all(np.isneginf(np.asarray(lse)[:, :, :20]))
    ref = reference.attention(q, k, k, **kw)[0]
    assert rel_err(out, ref) < TOL[dt]
    g = jax.grad(lambda q_: jnp.sum(flash_attention(q_, k, k, backend=backend, block_sizes=bs,
                                                    **kw).astype(jnp.float32)))(q)
    g = np.asarray(g, np.float32)
    assert np.all(np.isfinite(g)) and np.all(g[:, :20] == 0)

  def test_one_token_and_default_blocks(self):
    backend = self.backend
    rng = np.random.default_rng(4)
    dt = kernel_dtype(backend, jnp.float32)
    q = jnp.asarray(rng.standard_normal((1, 1, 4, 64)), dt)
    k = jnp.asarray(rng.standard_normal((1, 1, 2, 64)), dt)
    out = flash_attention(q, k, k, mask=masks.Causal(), backend=backend)
    tol = 2e-3 if dt == jnp.float32 else 1e-2  # TF32 on GPU
    np.testing.assert_allclose(np.asarray(out, np.float32)[0, 0],
                               np.repeat(np.asarray(k, np.float32)[0, 0], 2, 0), rtol=tol, atol=tol)

  def test_backward_takes_delta_as_array_or_row_term(self):
    """The contract's ``delta`` comes as the ``[B, N, Tp]`` array (the ring) or as a
    ``common.RowTerm`` of o and dlse (flash_attention; ``pallas_mosaic_gpu`` computes it in its dQ
    kernel): the same gradients either way, with and without an lse cotangent. ``parts`` asks for
    dq alone or dk and dv alone: the same results as the full call; `dkv_acc` is added to dk, dv."""
    backend = self.backend
    from pallas_ring import block_sparse, kernels, pair, plans
    from pallas_ring.kernels import common, tuning
    b, t, n, kh, h = 2, 128, 4, 2, 64
    dt = kernel_dtype(backend, jnp.float32)
    rng = np.random.default_rng(11)
    q, k, v, do = (jnp.asarray(rng.standard_normal(s), dt)
                   for s in ((b, t, n, h), (b, t, kh, h), (b, t, kh, h), (b, t, n, h)))
    dlse = jnp.asarray(rng.standard_normal((b, n, t)), jnp.float32)
    tiles = tuning.resolve(backend, small_blocks(backend, h), t, t, h)
    cfg = pair.kernel_config(
        tiles, mask=masks.Causal(), scale=h ** -0.5, softcap=None, q_len=t, kv_len=t,
        out_dtype=dt, interpret=backend != "xla" and jax.default_backend() == "cpu")
    seg = jnp.asarray(np.arange(t)[None].repeat(b, 0) // 48, jnp.int32)  # masked tiles
    info = block_sparse.make_token_info(t, b, segment_ids=seg)
    ops = common.Operands(info, info)
    lowering = kernels.get(backend)
    o, lse = lowering.forward(q, k, v, ops, plans.on_device(ops, cfg), cfg)
    plan = plans.on_device(ops, cfg, backward=True)
    tol = TOL[dt] / 10
    for d in (None, dlse):
      want = lowering.backward(q, k, v, do, lse, common.row_delta(o, do, d), ops, plan, cfg)
      got = lowering.backward(q, k, v, do, lse, common.RowTerm(o, d), ops, plan, cfg)
      for which, a, r in zip(("dq", "dk", "dv"), got, want):
        assert rel_err(a, r) < tol, (which, d is None, rel_err(a, r))
    # ``parts``: only dq (added to a running dq), or only dk and dv, each as in the full call.
    dq_acc = jnp.asarray(rng.standard_normal(q.shape), dt)
    delta = common.RowTerm(o, dlse)
    full = lowering.backward(q, k, v, do, lse, delta, ops, plan, cfg, dq_acc)
    dq, none_k, none_v = lowering.backward(q, k, v, do, lse, delta, ops, plan, cfg, dq_acc,
                                           parts=common.DQ)
    none_q, dk, dv = lowering.backward(q, k, v, do, lse, delta, ops, plan, cfg, parts=common.DKV)
    assert none_q is None and none_k is None and none_v is None
    for a, r in zip((dq, dk, dv), full):  # (Mosaic GPU: delta from XLA instead of its dQ kernel)
      assert rel_err(a, r) < tol
    # ``dkv_acc``: the dK/dV received with the shard, added (in the kernels on TPU).
    dkv_acc = tuple(jnp.asarray(rng.standard_normal(k.shape), dt) for _ in range(2))
    _, dk_sum, dv_sum = lowering.backward(q, k, v, do, lse, delta, ops, plan, cfg,
                                          parts=common.DKV, dkv_acc=dkv_acc)
    for a, r, acc in zip((dk_sum, dv_sum), (dk, dv), dkv_acc):
      assert rel_err(a, r + acc) < tol
    with pytest.raises(ValueError, match="parts='dk'"):
      lowering.backward(q, k, v, do, lse, delta, ops, plan, cfg, parts="dk")


# ---------------------------------------------------------------------------- edge cases --

def _blocks(backend):
  if backend == "pallas_tpu":
    return BlockSizes(32, 128, 32, 128)
  return BlockSizes(16, 16, 16, 16)


def _qkv(seed, b=1, t=40, n=2, kh=1, h=32, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  mk = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)
  return mk(b, t, n, h), mk(b, t, kh, h), mk(b, t, kh, h)


def _mesh(r=4):
  return jax.make_mesh((r,), ("sp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:r])


# --------------------------------------------------------------- 1. the lse is differentiable --

def _lse_loss(out, lse):
  """A loss with an output term and a z-loss on the lse (finite rows only)."""
  w = jnp.cos(jnp.arange(out.shape[-1], dtype=jnp.float32))
  z = jnp.where(jnp.isfinite(lse), lse, 0.0)
  return jnp.sum(out.astype(jnp.float32) * w) + 0.3 * jnp.sum(z * z)


def test_unused_lse_passes_no_cotangent_to_the_kernels(monkeypatch):
  """The lse's cotangent reaches the kernels only when the lse was used: otherwise the
  backward gets ``RowTerm(o, dlse=None)``, not a materialized zero ``[B, N, T]`` array."""
  from pallas_ring.kernels import xla as xla_kernels
  seen = []
  backward = xla_kernels.backward

  def spy(q, k, v, do, lse, delta, *rest):
    seen.append(delta.dlse)
    return backward(q, k, v, do, lse, delta, *rest)

  monkeypatch.setattr(xla_kernels.BACKEND, "backward", spy)
  jax.clear_caches()  # so the spy is traced whatever ran before
  q, k, v = _qkv(5, t=24)
  attend = lambda q, **kw: flash_attention(q, k, v, mask=masks.Causal(), backend="xla", **kw)
  jax.grad(lambda q: _lse_loss(*attend(q, return_lse=True)))(q)
  jax.grad(lambda q: jnp.sum(attend(q)))(q)
  assert len(seen) == 2 and seen[0] is not None and seen[1] is None


def test_lse_gradient_matches_finite_differences():
  """An independent check of the lse gradient, in float64 (x64), against central differences."""
  with jax.enable_x64(True):
    q, k, v = _qkv(1, t=12, h=8, dtype=jnp.float64)
    f = lambda q: jnp.sum(jnp.sin(flash_attention(q, k, v, mask=masks.Causal(), backend="xla",
                                                  return_lse=True)[1]))
    g = jax.grad(f)(q)
    d = jnp.asarray(np.random.default_rng(2).standard_normal(q.shape))
    eps = 1e-6
    fd = (f(q + eps * d) - f(q - eps * d)) / (2 * eps)
    np.testing.assert_allclose(float(jnp.sum(g * d)), float(fd), rtol=1e-7)


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_ring_lse_is_differentiable(strategy):
  q, k, v = _qkv(3, t=64, n=4, kh=2)
  sinks = jnp.asarray([0.1, -0.2, 0.3, 0.0], jnp.float32)
  cfg = SequenceParallelConfig(axis_name="sp", layout="zigzag", strategy=strategy, backend="xla")
  mesh, r = _mesh(), 4
  perm = lambda x: layouts.permute(x, "zigzag", r)

  def ours(q, k, v, s):
    out, lse = sharded_attention(perm(q), perm(k), perm(v), mesh=mesh, config=cfg,
                                 mask=masks.Causal(), sinks=s, return_lse=True)
    return _lse_loss(layouts.unpermute(out, "zigzag", r), layouts.unpermute(lse, "zigzag", r, 2))

  def ref(q, k, v, s):
    return _lse_loss(*reference.attention(q, k, v, mask=masks.Causal(), sinks=s))

  got = jax.jit(jax.grad(ours, argnums=(0, 1, 2, 3)))(q, k, v, sinks)
  want = jax.grad(ref, argnums=(0, 1, 2, 3))(q, k, v, sinks)
  for name, a, b in zip("qkvs", got, want):
    assert rel_err(a, b) < 1e-4, (name, rel_err(a, b))


# ------------------------------------------------------- 2. a sink of -inf means "no sink" --

def _empty_row_case():
  """Row 0 of batch 0 sees no key (segment 7 exists only among the queries)."""
  q, k, v = _qkv(4, t=32)
  seg = jnp.zeros((1, 32), jnp.int32)
  return q, k, v, seg.at[0, 0].set(7), seg


def test_minus_inf_sink_in_the_ring():
  q, k, v, qseg, _ = _empty_row_case()
  q, k, v = (jnp.concatenate([x, x]) for x in (q, k, v))  # B=2
  seg = jnp.zeros((2, 32), jnp.int32).at[0, 0].set(7)  # query 0 has no key of its segment...
  seg = seg.at[0, 1:].set(1)  # ...and neither do keys of other segments see it
  sinks = jnp.asarray([-jnp.inf, -jnp.inf], jnp.float32)
  cfg = SequenceParallelConfig(axis_name="sp", backend="xla")
  out = sharded_attention(q, k, v, mesh=_mesh(), config=cfg, mask=masks.Causal(),
                          segment_ids=seg, sinks=sinks)
  ref = reference.attention(q, k, v, mask=masks.Causal(), segment_ids=seg, sinks=sinks)[0]
  assert np.all(np.isfinite(np.asarray(out)))
  assert rel_err(out, ref) < 1e-5


# ------------------------------------------------------ 3. positions at the int32 limits --

EDGE_CASES = [
    # (mask, offset of arange(T) positions)
    (masks.SlidingWindow(1000), -2**31 + 8),
    (masks.SlidingWindow(3, 1000), 2**31 - 30),
    (masks.SlidingWindow(2**31 - 1, 2**31 - 1), -2**31),
    (masks.ChunkedCausal(5) | masks.SlidingWindow(2, 7), 2**31 - 24),
    (masks.PrefixLM(2**31 - 1), -2**31),
]


def test_block_test_is_sound_at_int32_limits():
  from pallas_ring.masks import BlockBounds
  lo, hi = -2**31, 2**31 - 1
  w = masks.SlidingWindow(10, 10)
  q = BlockBounds(jnp.asarray([lo], jnp.int32), jnp.asarray([lo + 3], jnp.int32))
  k = BlockBounds(jnp.asarray([hi - 3], jnp.int32), jnp.asarray([hi], jnp.int32))
  any_, all_ = w.block_test(q, k)  # the blocks are 2**32 - 4 apart: nothing visible
  assert not bool(any_[0]) and not bool(all_[0])
  any_, all_ = w.block_test(q, q)
  assert bool(any_[0]) and bool(all_[0])


@pytest.mark.ci_cases(every=True)
@pytest.mark.parametrize("make", [lambda: masks.SlidingWindow(2**31),
                                  lambda: masks.SlidingWindow(4, 2**40),
                                  lambda: masks.PrefixLM(2**31),
                                  lambda: masks.ChunkedCausal(2**33)])
def test_mask_sizes_must_fit_int32(make):
  with pytest.raises(ValueError, match=r"must be <= 2\*\*31 - 1"):
    make()


def test_wide_token_arrays_must_fit_int32():
  """Under x64, int64 segment ids and positions beyond int32 raise where they are concrete and
  make the output NaN under jit: the kernels compare int32 values, and wrapping would merge
  documents or reorder tokens."""
  with jax.enable_x64(True):
    q, k, v = _qkv(12, t=12, h=16)
    ok = flash_attention(q, k, v, segment_ids=np.array([[0] * 6 + [5] * 6], np.int64),
                         backend="xla")
    assert ok.shape == q.shape
    with pytest.raises(ValueError, match=r"`segment_ids` holds values from 0 to 4294967296"):
      flash_attention(q, k, v, segment_ids=np.array([[0] * 6 + [2**32] * 6], np.int64))
    pos = np.arange(12, dtype=np.int64) + 2**31 - 6
    with pytest.raises(ValueError, match=r"`q_positions` holds values .* outside int32"):
      flash_attention(q, k, v, mask=masks.Causal(), q_positions=pos, kv_positions=pos)
    # Under jit the values cannot be read: the output is NaN rather than silently wrong.
    f = jax.jit(lambda seg: flash_attention(q, k, v, segment_ids=seg))
    assert jnp.all(jnp.isnan(f(np.array([[0] * 6 + [2**32] * 6], np.int64))))
    assert not jnp.any(jnp.isnan(f(np.array([[0] * 6 + [7] * 6], np.int64))))
    # Concrete int64 arrays closed over by a jitted function are read too (np.min staged them
    # into the trace: a ConcretizationTypeError).
    seg = jnp.asarray(np.array([[0] * 6 + [7] * 6], np.int64))
    g = jax.jit(lambda q_: flash_attention(q_, k, v, segment_ids=seg, backend="xla"))
    assert rel_err(g(q), flash_attention(q, k, v, segment_ids=seg, backend="xla")) == 0


# --------------------------------------------------------------- 5/6. float64 and x64 mode --

def test_float64_is_computed_in_float64_by_xla():
  with jax.enable_x64(True):
    q, k, v = _qkv(6, t=33, h=16, dtype=jnp.float64)
    out, lse = flash_attention(q, k, v, mask=masks.Causal(), backend="xla", return_lse=True)
    ref, ref_lse = reference.attention(q, k, v, mask=masks.Causal())
    assert out.dtype == jnp.float64 and lse.dtype == jnp.float64
    assert rel_err(out, ref) < 1e-12  # float32 math would give ~1e-7
    g = jax.grad(lambda q: jnp.sum(flash_attention(q, k, v, backend="xla") ** 2))(q)
    g_ref = jax.grad(lambda q: jnp.sum(reference.attention(q, k, v)[0] ** 2))(q)
    assert g.dtype == jnp.float64 and rel_err(g, g_ref) < 1e-12
    # ALiBi slopes stay float64 there (they were rounded to float32: ~1e-8)
    slopes = jnp.asarray([0.1, 0.7], jnp.float64)  # [N]
    out = flash_attention(q, k, v, mask=masks.Causal(), alibi_slopes=slopes, backend="xla")
    ref, _ = reference.attention(q, k, v, mask=masks.Causal(), alibi_slopes=slopes)
    assert rel_err(out, ref) < 1e-12


@pytest.mark.ci_cases(every=True)
@pytest.mark.parametrize("backend", ["pallas_triton", "pallas_tpu"])
def test_float64_refused_by_pallas_backends(backend):
  with jax.enable_x64(True):
    q, k, v = _qkv(7, dtype=jnp.float64)
    with pytest.raises(TypeError, match=r"float64.*backend=\"xla\""):
      flash_attention(q, k, v, backend=backend)


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_x64_mode_ring(strategy):
  with jax.enable_x64(True):
    q, k, v = _qkv(10, t=64, n=2, kh=2)
    dense = jnp.asarray(np.random.default_rng(11).random((1, 1, 64, 64)) > 0.2)
    cfg = SequenceParallelConfig(axis_name="sp", strategy=strategy, backend="xla")
    f = lambda q: sharded_attention(q, k, v, mesh=_mesh(), config=cfg, mask=masks.Causal(),
                                    dense_mask=dense)
    ref = lambda q: reference.attention(q, k, v, mask=masks.Causal(), dense_mask=dense)[0]
    assert rel_err(jax.jit(f)(q), ref(q)) < 1e-5
    g = jax.jit(jax.grad(lambda q: jnp.sum(f(q))))(q)
    assert rel_err(g, jax.grad(lambda q: jnp.sum(ref(q)))(q)) < 1e-5


class EdgeCases:
  """The lse cotangent, ``-inf`` sinks, positions at the int32 limits, x64 mode
  (``conformance``)."""

  def test_lse_cotangent_reaches_q_k_v_and_sinks(self):
    backend = self.backend
    if not self.requires("float32"):
      return
    q, k, v = _qkv(0)
    sinks = jnp.asarray([0.3, -0.7], jnp.float32)
    kw = dict(mask=masks.Causal(), softcap=5.0)

    def ours(q, k, v, s):
      return _lse_loss(*flash_attention(q, k, v, sinks=s, backend=backend,
                                        block_sizes=_blocks(backend), return_lse=True, **kw))

    def ref(q, k, v, s):
      return _lse_loss(*reference.attention(q, k, v, sinks=s, **kw))

    got = jax.grad(ours, argnums=(0, 1, 2, 3))(q, k, v, sinks)
    want = jax.grad(ref, argnums=(0, 1, 2, 3))(q, k, v, sinks)
    for name, a, b in zip("qkvs", got, want):
      assert rel_err(a, b) < 2e-3, (name, rel_err(a, b))
    # The z-loss term alone must give a non-zero gradient (it was exactly 0 before).
    z_only = jax.grad(lambda q: jnp.sum(flash_attention(q, k, v, backend=backend,
                                                        block_sizes=_blocks(backend),
                                                        return_lse=True)[1]))(q)
    assert float(jnp.abs(z_only).max()) > 1e-3

  def test_minus_inf_sink_on_empty_row_is_zero_not_nan(self):
    backend = self.backend
    if not self.requires("float32"):
      return
    q, k, v, qseg, kseg = _empty_row_case()
    sinks = jnp.asarray([-jnp.inf, 0.5], jnp.float32)
    kw = dict(mask=masks.Causal(), segment_ids=qseg, kv_segment_ids=kseg, sinks=sinks)
    f = lambda q, s: flash_attention(q, k, v, backend=backend, block_sizes=_blocks(backend), **kw
                                     | dict(sinks=s))
    out = f(q, sinks)
    ref = reference.attention(q, k, v, **kw)[0]
    assert np.all(np.isfinite(np.asarray(out)))
    np.testing.assert_array_equal(np.asarray(out)[0, 0], 0.0)
    assert rel_err(out, ref) < 2e-3
    gq, gs = jax.grad(lambda q, s: jnp.sum(f(q, s)), argnums=(0, 1))(q, sinks)
    assert np.all(np.isfinite(np.asarray(gq))) and np.all(np.isfinite(np.asarray(gs)))

  @pytest.mark.parametrize("case", range(len(EDGE_CASES)))
  def test_positions_at_int32_limits(self, case):
    """Attention depends on position differences only (for these masks, away from chunk/prefix
    boundaries it is checked against the reference on the same positions, whose mask is exact)."""
    backend = self.backend
    if not self.requires("float32"):
      return
    mask, offset = EDGE_CASES[case]
    q, k, v = _qkv(5, t=24)
    pos = jnp.asarray(np.arange(24, dtype=np.int64) + offset, jnp.int32)
    out = flash_attention(q, k, v, mask=mask, q_positions=pos, kv_positions=pos, backend=backend,
                          block_sizes=_blocks(backend))
    # The exact visibility, computed in int64 with numpy.
    p = np.arange(24, dtype=np.int64) + offset
    qq, kk = p[:, None], p[None, :]
    exact = {0: (kk >= qq - 1000) & (kk <= qq),
             1: (kk >= qq - 3) & (kk <= qq + 1000),
             2: np.ones((24, 24), bool),
             3: (((qq // 5) == (kk // 5)) & (kk <= qq)) | ((kk >= qq - 2) & (kk <= qq + 7)),
             4: (kk < 2**31 - 1) | (kk <= qq)}[case]
    ref = reference.attention(q, k, v, dense_mask=jnp.asarray(exact))[0]
    assert rel_err(out, ref) < 2e-3

  def test_x64_mode_with_float32_inputs(self):
    """Index arithmetic stays int32 under x64: dense masks, segments, positions, gradients."""
    backend = self.backend
    if not self.requires("float32", "dense_mask"):
      return
    with jax.enable_x64(True):
      q, k, v = _qkv(8, t=40)
      rng = np.random.default_rng(9)
      kw = dict(mask=masks.Causal(), dense_mask=jnp.asarray(rng.random((1, 1, 40, 40)) > 0.2),
                segment_ids=jnp.asarray(np.repeat([[0, 1]], 20, axis=1)),
                q_positions=jnp.arange(40), kv_positions=jnp.arange(40))
      f = lambda q: flash_attention(q, k, v, backend=backend, block_sizes=_blocks(backend), **kw)
      out = f(q)
      assert out.dtype == jnp.float32
      assert rel_err(out, reference.attention(q, k, v, **kw)[0]) < 2e-3
      g = jax.grad(lambda q: jnp.sum(f(q)))(q)
      g_ref = jax.grad(lambda q: jnp.sum(reference.attention(q, k, v, **kw)[0]))(q)
      assert rel_err(g, g_ref) < 2e-3


# -------------------------------------------------------------------------------- numerics --

def test_merge_with_minus_inf_lse_is_not_nan():
  o = jnp.ones((1, 3, 1, 2), jnp.float32)
  lse_a = jnp.asarray([[[-jnp.inf, -jnp.inf, 0.5]]])
  lse_b = jnp.asarray([[[-jnp.inf, 1.0, -jnp.inf]]])
  out, lse = merge(o, lse_a, 2 * o, lse_b)
  assert np.all(np.isfinite(np.asarray(out)))
  np.testing.assert_array_equal(np.asarray(out)[0, :, 0, 0], [0.0, 2.0, 1.0])
  np.testing.assert_array_equal(np.asarray(lse)[0, 0], [-np.inf, 1.0, 0.5])


def test_lse_is_natural_log():
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.standard_normal((1, 8, 1, 16)), jnp.float32)
  _, lse = flash_attention(q, q, q, return_lse=True, backend="pallas_triton")
  logits = jnp.einsum("bqnh,bknh->bnqk", q, q) / 4.0
  np.testing.assert_allclose(lse, jax.nn.logsumexp(logits, axis=-1), rtol=1e-5)


class NumericsCases:
  """Huge logits, half precision near its limits, bitwise determinism (``conformance``)."""

  def test_huge_logits_and_sinks_stay_finite(self):
    """|q.k| near 1e5 (no mask value is ever added to another), with and without softcap, with very
    negative and very large sinks."""
    backend = self.backend
    rng = np.random.default_rng(0)
    dt = kernel_dtype(backend, jnp.float32)
    q = jnp.asarray(rng.standard_normal((1, 40, 2, 32)) * 130, dt)  # |q.k| ~ 1e5
    k = jnp.asarray(rng.standard_normal((1, 40, 2, 32)) * 130, dt)
    bs = small_blocks(backend)
    for kw in (dict(), dict(softcap=20.0), dict(sinks=jnp.asarray([-1e4, 1e4], jnp.float32))):
      out = flash_attention(q, k, k, mask=masks.Causal(), backend=backend, block_sizes=bs, **kw)
      ref = reference.attention(q, k, k, mask=masks.Causal(), **kw)[0]
      assert np.all(np.isfinite(np.asarray(out, np.float32)))
      assert rel_err(out, ref) < (2e-3 if dt == jnp.float32 else 2e-2)
      g = jax.grad(lambda x: jnp.sum(flash_attention(x, k, k, mask=masks.Causal(), backend=backend,
                                                     block_sizes=bs, **kw).astype(jnp.float32)))(q)
      assert np.all(np.isfinite(np.asarray(g, np.float32)))

  def test_deterministic_bitwise(self):
    """Forward and gradients the same bits twice (the Mosaic GPU backward asked to be
    reproducible: its default fused kernel adds dQ in no fixed order)."""
    backend = self.backend
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((1, 64, 2, 32)), jnp.bfloat16)
    bs = small_blocks(backend, reproducible=True)
    f = jax.jit(jax.value_and_grad(lambda x: jnp.sum(flash_attention(
        x, x, x, mask=masks.SlidingWindow(9), backend=backend,
        block_sizes=bs).astype(jnp.float32))))
    a, ga = f(q)
    b, gb = f(q)
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert np.asarray(ga).tobytes() == np.asarray(gb).tobytes()

  @pytest.mark.parametrize("dtype, big", [(jnp.float16, 200.0), (jnp.bfloat16, 1e4)])
  def test_half_precision_near_its_limits(self, dtype, big):
    """q.k would overflow float16 (max 65504) or lose all bits in bfloat16 if accumulated in the
    input dtype; the kernels accumulate in float32, judged against 2x a same-precision reference."""
    backend = self.backend
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((1, 48, 2, 64)) * big / 8, dtype)
    k = jnp.asarray(rng.standard_normal((1, 48, 2, 64)) * 8, dtype)
    v = jnp.asarray(rng.standard_normal((1, 48, 2, 64)) * big, dtype)
    out = flash_attention(q, k, v, mask=masks.Causal(), backend=backend,
                          block_sizes=small_blocks(backend))
    ref64 = reference.attention(*(x.astype(jnp.float32) for x in (q, k, v)), mask=masks.Causal())[0]
    same_precision = reference.attention(q, k, v, mask=masks.Causal())[0]  # f32 math, cast to dtype
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    assert rel_err(out, ref64) <= 2 * rel_err(same_precision, ref64) + 1e-3
    g = jax.grad(lambda x: jnp.sum(flash_attention(x, k, v, mask=masks.Causal(), backend=backend,
                                                   block_sizes=small_blocks(backend)
                                                   ).astype(jnp.float32)))(q)
    assert np.all(np.isfinite(np.asarray(g, np.float32)))
