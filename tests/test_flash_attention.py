"""Conformance suite: every backend against the dense reference, forward, lse and gradients.

On CPU the Pallas backends run in interpret mode; on a GPU (PALLAS_RING_TEST_GPU=1) the Triton
kernels run natively (``PALLAS_RING_BACKENDS=pallas_mosaic_gpu`` for the Hopper kernels: float32
cases run in bfloat16 there, and a dense mask must be refused with the reason).
"""

import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_ring import BlockSizes, flash_attention, masks, reference
from conftest import kernel_dtype, rel_err, small_blocks

BACKENDS = os.environ.get("PALLAS_RING_BACKENDS", "xla,pallas_triton,pallas_tpu").split(",")
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
}


def _inputs(name, seed=0, backend=None):
  mask, t, s, n, kh, h, dtype, ex = CASES[name]
  dtype = kernel_dtype(backend, dtype)
  rng = np.random.default_rng(zlib.crc32(name.encode()) + seed)  # (str hash() is salted)
  b = 2
  q = jnp.asarray(rng.standard_normal((b, t, n, h)), dtype)
  k = jnp.asarray(rng.standard_normal((b, s, kh, h)), dtype)
  v = jnp.asarray(rng.standard_normal((b, s, kh, h)), dtype)
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


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CASES))
def test_conformance(backend, name):
  q, k, v, kw, dtype = _inputs(name, backend=backend)
  bs = small_blocks(backend, q.shape[-1])
  tol = TOL[dtype]
  if backend == "pallas_mosaic_gpu" and "dense_mask" in kw:
    with pytest.raises(ValueError, match="cannot serve this call: a dense mask"):
      flash_attention(q, k, v, backend=backend, block_sizes=bs, **kw)
    return
  out, lse = flash_attention(q, k, v, backend=backend, block_sizes=bs, return_lse=True, **kw)
  ref_out, ref_lse = reference.attention(q, k, v, **kw)
  assert out.dtype == q.dtype and out.shape == q.shape
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_with_no_visible_key(backend):
  """Whole rows, whole blocks: output 0, lse -inf, gradients 0, nothing NaN."""
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_token_and_default_blocks(backend):
  rng = np.random.default_rng(4)
  dt = kernel_dtype(backend, jnp.float32)
  q = jnp.asarray(rng.standard_normal((1, 1, 4, 64)), dt)
  k = jnp.asarray(rng.standard_normal((1, 1, 2, 64)), dt)
  out = flash_attention(q, k, k, mask=masks.Causal(), backend=backend)
  tol = 2e-3 if dt == jnp.float32 else 1e-2  # TF32 on GPU
  np.testing.assert_allclose(np.asarray(out, np.float32)[0, 0],
                             np.repeat(np.asarray(k, np.float32)[0, 0], 2, 0), rtol=tol, atol=tol)


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


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_takes_delta_as_array_or_row_term(backend):
  """The contract's ``delta`` comes as the ``[B, N, Tp]`` array (the ring) or as a
  ``common.RowTerm`` of o and dlse (flash_attention; ``pallas_mosaic_gpu`` computes it in its dQ
  kernel): the same gradients either way, with and without an lse cotangent. ``parts`` asks for
  dq alone or dk and dv alone: the same results as the full call."""
  from pallas_ring import block_sparse, kernels, pair
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
  o, lse = lowering.forward(q, k, v, ops, pair.make_plan(ops, cfg), cfg)
  plan = pair.make_plan(ops, cfg, backward=True)
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
  with pytest.raises(ValueError, match="parts='dk'"):
    lowering.backward(q, k, v, do, lse, delta, ops, plan, cfg, parts="dk")
