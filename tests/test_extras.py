"""Additive bias, ALiBi, attention dropout and packed sequences (cu_seqlens), in every lowering
and the ring, against the float64 reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import pallas_ring
from pallas_ring import (SequenceParallelConfig, dropout_keep_mask, flash_attention, layouts,
                         masks, reference, segment_ids_from_cu_seqlens, sharded_attention)
from conftest import rel_err, small_blocks

RATE = 0.2
# On a GPU float32 matmuls run as TF32 (relative error near 3e-4).
TF32 = jax.default_backend() == "gpu"


def _tol(cpu_tol):
  return max(cpu_tol, 2e-3) if TF32 else cpu_tol


def _qkv(seed, b=2, t=200, n=4, kh=2, h=32):
  r = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(r.standard_normal(s), jnp.float32)
  return f(b, t, n, h), f(b, t, kh, h), f(b, t, kh, h), f(b, t, n, h)


def _ref64(args, **kw):
  """The float64 reference output and its vjp at float32 inputs."""
  with jax.enable_x64(True):
    args64 = [None if a is None else jnp.asarray(a, jnp.float64) for a in args]
    kw = {k: (jnp.asarray(v, jnp.float64) if isinstance(v, jax.Array) and
              jnp.issubdtype(v.dtype, jnp.floating) else v) for k, v in kw.items()}
    out, vjp = jax.vjp(lambda q, k, v, bias: reference.attention(q, k, v, bias=bias, **kw)[0],
                       *args64)
    return np.asarray(out), vjp


def _check(f, args, do, ref_kw, fwd_tol=2e-6, grad_tol=2e-5):
  """``f(q, k, v, bias)`` against the float64 reference: output and all four gradients."""
  fwd_tol, grad_tol = _tol(fwd_tol), _tol(grad_tol) * (2.5 if TF32 else 1)
  out, vjp = jax.vjp(f, *args)
  ref, ref_vjp = _ref64(args, **ref_kw)
  assert rel_err(out, ref) < fwd_tol
  grads = vjp(do)
  with jax.enable_x64(True):
    ref_grads = ref_vjp(jnp.asarray(do, jnp.float64))
  for name, g, rg in zip("qkvb", grads, ref_grads):
    if rg is None:  # no bias
      continue
    assert g.shape == rg.shape, name
    assert rel_err(g, rg) < grad_tol, name


@pytest.mark.parametrize("n,kh", [(16, 2), (16, 8), (12, 4)],
                         ids=["in-place-q-lane-kv", "in-place-group2", "lanes-hb12"])
def test_tpu_head_blocks_match_reference(n, kh):
  """The TPU kernels serve 8 heads per program (all N when N % 8) and share one schedule per
  head block: per-head dense masks that differ inside a block (merged plan classes), per-head
  bias, ALiBi and dropout, GQA groups whose kv head depends on the block's rank, operands read
  in place (heads % 8 == 0) or as lane blocks, and a head count that is
  not a multiple of 8."""
  q, k, v, do = _qkv(5, b=1, t=136, n=n, kh=kh, h=32)
  b, t = q.shape[:2]
  r = np.random.default_rng(6)
  bias = jnp.asarray(r.standard_normal((1, n, t, t)), jnp.float32)
  # Head-dependent windows: some heads see a tile fully, others partly or not at all.
  qi, ki = np.arange(t)[:, None], np.arange(t)[None]
  dense = jnp.asarray(np.stack([ki >= qi - 16 * (hd % 5) for hd in range(n)])[None])
  seg = jnp.asarray((np.arange(t) >= 100).astype(np.int32)[None])
  slopes = jnp.asarray(np.geomspace(0.3, 0.01, n), jnp.float32)
  rng = jax.random.key(7)
  keep = dropout_keep_mask(rng, RATE, b, n, jnp.arange(t), jnp.arange(t))
  common = dict(mask=masks.Causal(), segment_ids=seg, dense_mask=dense, alibi_slopes=slopes)
  f = lambda q, k, v, bias: flash_attention(
      q, k, v, bias=bias, dropout_rate=RATE, dropout_rng=rng, backend="pallas_tpu",
      block_sizes=small_blocks("pallas_tpu"), **common)
  _check(f, (q, k, v, bias), do, dict(dropout_rate=RATE, dropout_mask=keep, **common))


def test_kept_fraction_is_one_minus_rate_within_three_standard_errors():
  rng = jax.random.key(0)
  pos = jnp.arange(256)
  for rate in (0.1, 0.5):
    keep = np.asarray(dropout_keep_mask(rng, rate, 2, 4, pos, pos))
    se = np.sqrt(rate * (1 - rate) / keep.size)
    assert abs(keep.mean() - (1 - rate)) < 3 * se, (rate, keep.mean())
  keep = np.asarray(dropout_keep_mask(rng, 0.5, 2, 4, pos, pos))
  # Batch rows, heads, rows and columns get different masks; another key another mask.
  assert (keep[0, 0] != keep[1, 0]).mean() > 0.4 and (keep[0, 0] != keep[0, 1]).mean() > 0.4
  assert (keep[0, 0, 0] != keep[0, 0, 1]).mean() > 0.4
  assert (keep[..., 0] != keep[..., 1]).mean() > 0.4
  other = np.asarray(dropout_keep_mask(jax.random.key(1), 0.5, 2, 4, pos, pos))
  assert (keep != other).mean() > 0.4
  same = np.asarray(dropout_keep_mask(rng, 0.5, 2, 4, pos, pos, broadcast=True))
  assert (same == same[:1, :1]).all()
  assert np.asarray(dropout_keep_mask(rng, 0.0, 1, 1, pos, pos)).all()


def test_dropout_is_a_function_of_global_positions_not_tiles_or_backends():
  """Same key: identical outputs for every backend and tile size (the mask is positional)."""
  q, k, v, _ = _qkv(2, t=256)
  rng = jax.random.key(5)
  run = lambda backend, bs: flash_attention(q, k, v, mask=masks.Causal(), dropout_rate=0.3,
                                            dropout_rng=rng, backend=backend, block_sizes=bs)
  base = run("xla", None)
  for backend, bs in (("xla", dict(block_q=32, block_kv=64)), ("pallas_triton", None),
                      ("pallas_tpu", dict(block_q=64, block_kv=128))):
    assert rel_err(run(backend, bs), base) < _tol(1e-6), backend
  # Shifting every position shifts the mask: positions, not array indices, are hashed.
  shifted = flash_attention(q, k, v, mask=masks.Causal(), dropout_rate=0.3, dropout_rng=rng,
                            q_positions=jnp.arange(256) + 1, kv_positions=jnp.arange(256) + 1)
  assert rel_err(shifted, base) > 1e-2


@pytest.mark.ci_cases("shape0-xla", "shape1-pallas_triton")
@pytest.mark.parametrize("backend", ["xla", "pallas_triton"])
@pytest.mark.parametrize("shape", [(200, 200), (4, 1, 200), (2, 1, 1, 200), (2, 4, 200, 200)])
def test_bias_and_its_gradient_match_jax_nn(backend, shape):
  """A bias broadcast like jax.nn.dot_product_attention's; its gradient has its shape."""
  q, k, v, do = _qkv(4, n=4, kh=4)
  bias = jnp.asarray(np.random.default_rng(5).standard_normal(shape), jnp.float32)
  ours = lambda q, k, v, bias: flash_attention(q, k, v, bias=bias, backend=backend)
  theirs = lambda q, k, v, bias: jax.nn.dot_product_attention(q, k, v, bias=bias,
                                                              implementation="xla")
  out, vjp = jax.vjp(ours, q, k, v, bias)
  ref, ref_vjp = jax.vjp(theirs, q, k, v, bias)
  assert rel_err(out, ref) < _tol(1e-5)
  for name, g, rg in zip("qkvb", vjp(do), ref_vjp(do)):
    assert g.shape == rg.shape, name
    assert rel_err(g, rg) < _tol(1e-4), name


def test_bias_of_minus_inf_masks_and_empty_rows_are_zero():
  q, k, v, do = _qkv(6, t=64)
  bias = jnp.where(jnp.arange(64)[None, :] < 8, 0.0, -jnp.inf) * jnp.ones((64, 1))
  bias = bias.at[:4].set(-jnp.inf)  # rows 0..3 see nothing
  out, vjp = jax.vjp(lambda q, bias: flash_attention(q, k, v, bias=bias), q, bias)
  ref = reference.attention(q, k, v, dense_mask=jnp.isfinite(bias))[0]
  assert np.isfinite(np.asarray(out)).all() and rel_err(out, ref) < _tol(1e-5)
  assert not np.asarray(out[:, :4]).any()
  dq, dbias = vjp(do)
  assert np.isfinite(np.asarray(dq)).all() and np.isfinite(np.asarray(dbias)).all()


def test_kv_cu_seqlens_for_cross_attention():
  q, _, _, _ = _qkv(11, b=1, t=40)
  _, k, v, _ = _qkv(12, b=1, t=60)
  cu_q, cu_k = jnp.asarray([0, 10, 40]), jnp.asarray([0, 25, 50])
  out = flash_attention(q, k, v, cu_seqlens=cu_q, kv_cu_seqlens=cu_k)
  seg_q = jnp.asarray(np.repeat([0, 1], [10, 30])[None], jnp.int32)
  seg_k = jnp.asarray(np.repeat([0, 1, -2], [25, 25, 10])[None], jnp.int32)
  ref = reference.attention(q, k, v, segment_ids=seg_q, kv_segment_ids=seg_k)[0]
  assert rel_err(out, ref) < _tol(1e-5)
  # (Python lists, as segment_ids_from_cu_seqlens takes them)
  np.testing.assert_array_equal(flash_attention(q, k, v, cu_seqlens=[0, 10, 40],
                                                kv_cu_seqlens=[0, 25, 50]), out)


# ------------------------------------------------------------------------------------- ring --

@functools.lru_cache(maxsize=None)
def _mesh(r):
  return jax.make_mesh((2, r), ("dp", "sp"), devices=jax.devices()[:2 * r],
                       axis_types=(AxisType.Auto,) * 2)


@pytest.mark.ci_cases("contiguous-1-ring", "zigzag-4-ring", "striped-2-all_gather")
@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
@pytest.mark.parametrize("r", [1, 2, 4])
@pytest.mark.parametrize("layout", layouts.LAYOUTS)
def test_ring_bias_alibi_dropout_match_reference(layout, r, strategy):
  """Every layout and ring size, batch over a dp axis: the global batch index, head and
  positions decide each dropout keep, so all agree with the unsharded reference."""
  q, k, v, do = _qkv(13, t=64)
  b, t, n, _ = q.shape
  bias = jnp.asarray(np.random.default_rng(14).standard_normal((b, 1, t, t)), jnp.float32)
  slopes = jnp.asarray(np.geomspace(0.3, 0.01, n), jnp.float32)
  rng = jax.random.key(15)
  keep = dropout_keep_mask(rng, RATE, b, n, jnp.arange(t), jnp.arange(t))
  cfg = SequenceParallelConfig(axis_name="sp", layout=layout, strategy=strategy,
                               batch_axes=("dp",), backend="xla")
  perm = lambda x, axis=1: layouts.permute(x, layout, r, axis=axis)

  def f(q, k, v, bias):
    out = sharded_attention(perm(q), perm(k), perm(v), mesh=_mesh(r), config=cfg,
                            mask=masks.Causal(), bias=perm(perm(bias, 2), 3),
                            alibi_slopes=slopes, dropout_rate=RATE, dropout_rng=rng)
    return layouts.unpermute(out, layout, r, axis=1)

  _check(f, (q, k, v, bias), do, dict(mask=masks.Causal(), alibi_slopes=slopes,
                                      dropout_rate=RATE, dropout_mask=keep))


@pytest.mark.parametrize("backend", ["pallas_triton", "pallas_tpu"])
def test_ring_extras_on_pallas_backends(backend):
  q, k, v, do = _qkv(16, t=256, n=2, kh=1)
  b, t, n, _ = q.shape
  bias = jnp.asarray(np.random.default_rng(17).standard_normal((1, n, t, t)), jnp.float32)
  rng = jax.random.key(18)
  keep = dropout_keep_mask(rng, RATE, b, n, jnp.arange(t), jnp.arange(t))
  cfg = SequenceParallelConfig(axis_name="sp", layout="zigzag", batch_axes=("dp",),
                               backend=backend)
  perm = lambda x, axis=1: layouts.permute(x, "zigzag", 2, axis=axis)

  def f(q, k, v, bias):
    out = sharded_attention(perm(q), perm(k), perm(v), mesh=_mesh(2), config=cfg,
                            mask=masks.Causal(), bias=perm(perm(bias, 2), 3),
                            alibi_slopes=jnp.full((n,), 0.05), dropout_rate=RATE,
                            dropout_rng=rng, interpret=True)
    return layouts.unpermute(out, "zigzag", 2, axis=1)

  _check(f, (q, k, v, bias), do, dict(mask=masks.Causal(), alibi_slopes=jnp.full((n,), 0.05),
                                      dropout_rate=RATE, dropout_mask=keep))


@pytest.mark.parametrize("layout", layouts.LAYOUTS)
def test_ring_cu_seqlens_follow_the_natural_order(layout):
  q, k, v, _ = _qkv(19, b=2, t=64)
  cu = jnp.asarray([0, 10, 40, 50], jnp.int32)
  cfg = SequenceParallelConfig(axis_name="sp", layout=layout, batch_axes=(), backend="xla")
  mesh = jax.make_mesh((4,), ("sp",), devices=jax.devices()[:4], axis_types=(AxisType.Auto,))
  out = sharded_attention(layouts.permute(q[:1], layout, 4), layouts.permute(k[:1], layout, 4),
                          layouts.permute(v[:1], layout, 4), mesh=mesh, config=cfg,
                          mask=masks.Causal(), cu_seqlens=cu)
  out = layouts.unpermute(out, layout, 4, axis=1)
  ref = flash_attention(q[:1], k[:1], v[:1], mask=masks.Causal(), cu_seqlens=cu)
  assert rel_err(out, ref) < 1e-5 and not np.asarray(out[:, 50:]).any()


# ------------------------------------------------------------------------------- validation --

def test_bad_extras_raise_with_the_fix():
  q, k, v, _ = _qkv(20, b=1, t=32)
  key = jax.random.key(0)
  with pytest.raises(ValueError, match=r"`dropout_rate`=1.0 is invalid.*\[0, 1\)"):
    flash_attention(q, k, v, dropout_rate=1.0, dropout_rng=key)
  with pytest.raises(ValueError, match=r"`dropout_rate`=-0.1"):
    flash_attention(q, k, v, dropout_rate=-0.1, dropout_rng=key)
  with pytest.raises(ValueError, match="needs `dropout_rng`"):
    flash_attention(q, k, v, dropout_rate=0.1)
  with pytest.raises(TypeError, match="must be a JAX PRNG key"):
    flash_attention(q, k, v, dropout_rate=0.1, dropout_rng=42)
  with pytest.raises(ValueError, match=r"`bias` has shape \(3, 32\).*axis T is 3"):
    flash_attention(q, k, v, bias=jnp.zeros((3, 32)))
  with pytest.raises(TypeError, match="`bias` has dtype int32"):
    flash_attention(q, k, v, bias=jnp.zeros((32, 32), jnp.int32))
  with pytest.raises(ValueError, match=r"`alibi_slopes` has shape \(3,\)"):
    flash_attention(q, k, v, alibi_slopes=jnp.ones(3))
  with pytest.raises(ValueError, match="never decrease"):
    flash_attention(q, k, v, cu_seqlens=jnp.asarray([0, 20, 10]))
  with pytest.raises(ValueError, match="end at most at the sequence length 32"):
    flash_attention(q, k, v, cu_seqlens=jnp.asarray([0, 20, 40]))
  with pytest.raises(ValueError, match="must start at 0"):
    flash_attention(q, k, v, cu_seqlens=jnp.asarray([5, 20]))
  with pytest.raises(ValueError, match="needs batch size 1"):
    flash_attention(*(jnp.concatenate([x, x]) for x in (q, k, v)),
                    cu_seqlens=jnp.asarray([0, 20]))
  with pytest.raises(ValueError, match="either `cu_seqlens` or `segment_ids`"):
    flash_attention(q, k, v, cu_seqlens=jnp.asarray([0, 20]),
                    segment_ids=jnp.zeros((1, 32), jnp.int32))
  with pytest.raises(TypeError, match="must be an integer"):
    flash_attention(q, k, v, cu_seqlens=jnp.asarray([0.0, 20.0]))
  # Traced cu_seqlens cannot be checked for values, but they work.
  out = jax.jit(lambda cu: flash_attention(q, k, v, cu_seqlens=cu))(jnp.asarray([0, 20, 32]))
  assert np.isfinite(np.asarray(out)).all()


def test_public_names():
  assert pallas_ring.dropout_keep_mask is dropout_keep_mask
  assert pallas_ring.segment_ids_from_cu_seqlens is segment_ids_from_cu_seqlens


class ExtrasCases:
  """Bias, ALiBi, dropout and packed sequences in one backend (``conformance``)."""

  def test_bias_alibi_dropout_softcap_gqa_match_reference(self):
    """All extras at once on an odd length (padding), GQA, causal + soft-cap, every lowering
    (float32 inputs against the float64 reference)."""
    backend = self.backend
    if not self.requires("bias", "alibi", "dropout", "float32"):
      return
    q, k, v, do = _qkv(0)
    b, t, n, _ = q.shape
    bias = jnp.asarray(np.random.default_rng(1).standard_normal((1, n, t, t)), jnp.float32)
    slopes = jnp.asarray(np.geomspace(0.3, 0.01, n), jnp.float32)
    rng = jax.random.key(3)
    keep = dropout_keep_mask(rng, RATE, b, n, jnp.arange(t), jnp.arange(t))
    f = lambda q, k, v, bias: flash_attention(
        q, k, v, mask=masks.Causal(), softcap=10.0, bias=bias, alibi_slopes=slopes,
        dropout_rate=RATE, dropout_rng=rng, backend=backend)
    _check(f, (q, k, v, bias), do, dict(mask=masks.Causal(), softcap=10.0, alibi_slopes=slopes,
                                        dropout_rate=RATE, dropout_mask=keep))

  @pytest.mark.parametrize("mask", [masks.Causal(), masks.SlidingWindow(300, 200)],
                           ids=["causal", "bidirectional"])
  def test_alibi_per_batch_slopes_on_caller_positions(self, mask):
    """Far from 0 (positions near 10**6), per-batch slopes; causal masks take the Triton
    kernel's split of the ALiBi term into column and row parts, others the direct form."""
    backend = self.backend
    if not self.requires("alibi", "float32"):
      return
    q, k, v, do = _qkv(7, t=96)
    slopes = jnp.asarray(np.random.default_rng(8).uniform(0.01, 0.5, (2, 4)), jnp.float32)
    qpos = np.sort(np.random.default_rng(9).integers(0, 1000, (2, 96))) + 10**6
    qpos = jnp.asarray(qpos, jnp.int32)
    f = lambda q, k, v, bias: flash_attention(q, k, v, mask=mask, alibi_slopes=slopes,
                                              q_positions=qpos, kv_positions=qpos, backend=backend)
    # ALiBi terms reach ~500 here: float32 rounds them to ~3e-5.
    _check(f, (q, k, v, None), do, dict(mask=mask, alibi_slopes=slopes, q_positions=qpos,
                                        kv_positions=qpos), fwd_tol=1e-5, grad_tol=5e-5)

  def test_cu_seqlens_equals_segment_ids_and_padding_is_zero(self):
    backend = self.backend
    if not self.requires("float32"):
      return
    q, k, v, do = _qkv(10, b=1, t=130)
    cu = jnp.asarray([0, 17, 64, 64, 100], jnp.int32)  # an empty sequence; 30 tokens of padding
    seg = segment_ids_from_cu_seqlens(cu, 130)
    assert seg.shape == (1, 130) and int(seg[0, 16]) == 0 and int(seg[0, 17]) == 1
    assert int(seg[0, 64]) == 3 and int(seg[0, 129]) == 4
    f = lambda q, k, v: flash_attention(q, k, v, mask=masks.Causal(), cu_seqlens=cu,
                                        backend=backend)
    out, vjp = jax.vjp(f, q, k, v)
    by_ids = flash_attention(q, k, v, mask=masks.Causal(), segment_ids=seg, backend=backend)
    np.testing.assert_allclose(out[:, :100], by_ids[:, :100], rtol=1e-6, atol=1e-6)
    assert not np.asarray(out[:, 100:]).any()  # padding: output 0 ...
    dq, dk, dv = vjp(do)
    assert not np.asarray(dq[:, 100:]).any()  # ... and gradients 0
    assert not np.asarray(dk[:, 100:]).any() and not np.asarray(dv[:, 100:]).any()
