"""One test per failure mode in PRIOR_ART's "Pitfalls seen in the wild", plus determinism."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from pallas_ring import SequenceParallelConfig, flash_attention, masks, reference
from pallas_ring import sharded_attention
from pallas_ring.ring import merge
from conftest import ON_GPU, kernel_dtype, rel_err, small_blocks

# Natively on a GPU the Mosaic GPU kernels join (on CPU they would only emulate Triton's).
BACKENDS = ["xla", "pallas_triton", "pallas_tpu"] + (["pallas_mosaic_gpu"] if ON_GPU else [])


def test_merge_with_minus_inf_lse_is_not_nan():
  o = jnp.ones((1, 3, 1, 2), jnp.float32)
  lse_a = jnp.asarray([[[-jnp.inf, -jnp.inf, 0.5]]])
  lse_b = jnp.asarray([[[-jnp.inf, 1.0, -jnp.inf]]])
  out, lse = merge(o, lse_a, 2 * o, lse_b)
  assert np.all(np.isfinite(np.asarray(out)))
  np.testing.assert_array_equal(np.asarray(out)[0, :, 0, 0], [0.0, 2.0, 1.0])
  np.testing.assert_array_equal(np.asarray(lse)[0, 0], [-np.inf, 1.0, 0.5])


@pytest.mark.parametrize("backend", BACKENDS)
def test_huge_logits_and_sinks_stay_finite(backend):
  """|q.k| near 1e5 (no mask value is ever added to another), with and without softcap, with very
  negative and very large sinks."""
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


def test_lse_is_natural_log():
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.standard_normal((1, 8, 1, 16)), jnp.float32)
  _, lse = flash_attention(q, q, q, return_lse=True, backend="pallas_triton")
  logits = jnp.einsum("bqnh,bknh->bnqk", q, q) / 4.0
  np.testing.assert_allclose(lse, jax.nn.logsumexp(logits, axis=-1), rtol=1e-5)


def _ring_jaxpr(dtype):
  mesh = jax.make_mesh((4,), ("sp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
  cfg = SequenceParallelConfig(axis_name="sp", backend="xla")
  q = jnp.zeros((1, 64, 2, 32), dtype)
  f = lambda q_, k_, v_: sharded_attention(q_, k_, v_, mesh=mesh, config=cfg, mask=masks.Causal())
  fwd = jax.make_jaxpr(lambda *a: jax.vjp(f, *a))(q, q, q)
  return str(fwd), fwd


def test_ring_residuals_are_local_and_kv_rotates_in_its_own_dtype():
  """The whole ring is one custom_vjp (no per-step K/V saved for autodiff), and K/V are
  rotated as bf16, not upcast to f32 first."""
  text, closed = _ring_jaxpr(jnp.bfloat16)
  # Residuals of the vjp are the local q, the K/V pair (one stacked buffer), lse, positions:
  # every one is at most two [R=4, T/R=16, heads, H] stacks of shards, never R ring steps of K/V
  # per device.
  res = [v.aval for v in closed.jaxpr.outvars[1:]]
  assert all(np.prod(a.shape) <= 2 * 4 * 16 * 2 * 32 for a in res if hasattr(a, "shape"))
  permutes = [line for line in text.splitlines() if "ppermute" in line]
  assert permutes and all("bf16[2,1,16,2,32]" in line or "i32" in line for line in permutes
                          if "[2,1,16" in line)
  assert any("bf16[2,1,16,2,32]" in line for line in permutes)


@pytest.mark.parametrize("backend", BACKENDS)
def test_deterministic_bitwise(backend):
  rng = np.random.default_rng(2)
  q = jnp.asarray(rng.standard_normal((1, 64, 2, 32)), jnp.bfloat16)
  bs = small_blocks(backend)
  f = jax.jit(jax.value_and_grad(lambda x: jnp.sum(flash_attention(
      x, x, x, mask=masks.SlidingWindow(9), backend=backend, block_sizes=bs).astype(jnp.float32))))
  a, ga = f(q)
  b, gb = f(q)
  assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
  assert np.asarray(ga).tobytes() == np.asarray(gb).tobytes()


@pytest.mark.parametrize("dtype, big", [(jnp.float16, 200.0), (jnp.bfloat16, 1e4)])
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "pallas_tpu"])
def test_half_precision_near_its_limits(dtype, big, backend):
  """q.k would overflow float16 (max 65504) or lose all bits in bfloat16 if accumulated in the
  input dtype; the kernels accumulate in float32, judged against 2x a same-precision reference."""
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
