"""Regression tests for the silent defects found by outside suites (issue 11): differentiable lse,
``-inf`` sinks, positions at the int32 limits, float64 and x64 index arithmetic."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from pallas_ring import (BlockSizes, SequenceParallelConfig, flash_attention, layouts, masks,
                         reference, sharded_attention)
from conftest import rel_err

BACKENDS = ["xla", "pallas_triton", "pallas_tpu"]


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


@pytest.mark.parametrize("backend", BACKENDS)
def test_lse_cotangent_reaches_q_k_v_and_sinks(backend):
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_minus_inf_sink_on_empty_row_is_zero_not_nan(backend):
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


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", range(len(EDGE_CASES)))
def test_positions_at_int32_limits(backend, case):
  """Attention depends on position differences only (for these masks, away from chunk/prefix
  boundaries it is checked against the reference on the same positions, whose mask is exact)."""
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


@pytest.mark.parametrize("make", [lambda: masks.SlidingWindow(2**31),
                                  lambda: masks.SlidingWindow(4, 2**40),
                                  lambda: masks.PrefixLM(2**31),
                                  lambda: masks.ChunkedCausal(2**33)])
def test_mask_sizes_must_fit_int32(make):
  with pytest.raises(ValueError, match=r"must be <= 2\*\*31 - 1"):
    make()


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


@pytest.mark.parametrize("backend", ["pallas_triton", "pallas_tpu"])
def test_float64_refused_by_pallas_backends(backend):
  with jax.enable_x64(True):
    q, k, v = _qkv(7, dtype=jnp.float64)
    with pytest.raises(TypeError, match=r"float64.*backend=\"xla\""):
      flash_attention(q, k, v, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_x64_mode_with_float32_inputs(backend):
  """Index arithmetic stays int32 under x64: dense masks, segments, positions, gradients."""
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
