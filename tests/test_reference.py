"""The dense reference against an independent NumPy float64 implementation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_ring import masks, reference
from conftest import rel_err


def numpy_attention(q, k, v, vis, sinks=None, softcap=None, scale=None):
  """Loop-free float64 NumPy attention over a dense visibility [B, N, T, S]."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  b, t, n, h = q.shape
  g = n // k.shape[2]
  k = np.repeat(k, g, axis=2)
  v = np.repeat(v, g, axis=2)
  scale = h ** -0.5 if scale is None else scale
  s = np.einsum("btnh,bsnh->bnts", q, k) * scale
  if softcap:
    s = softcap * np.tanh(s / softcap)
  s = np.where(vis, s, -np.inf)
  cols = [s]
  if sinks is not None:
    cols.append(np.broadcast_to(np.asarray(sinks, np.float64)[None, :, None, None], (b, n, t, 1)))
  full = np.concatenate(cols, axis=-1)
  m = full.max(-1, keepdims=True)
  m = np.where(np.isfinite(m), m, 0)
  e = np.exp(full - m)
  d = e.sum(-1, keepdims=True)
  w = np.where(d > 0, e / np.where(d > 0, d, 1), 0)[..., :s.shape[-1]]
  out = np.einsum("bnts,bsnh->btnh", w, v)
  lse = np.where(d[..., 0] > 0, m[..., 0] + np.log(np.where(d[..., 0] > 0, d[..., 0], 1)), -np.inf)
  return out, lse


CASES = [
    dict(mask=masks.Causal()),
    dict(mask=masks.SlidingWindow(3, 2), softcap=5.0),
    dict(mask=masks.ChunkedCausal(4) | masks.PrefixLM(3), sinks=True),
    dict(mask=masks.Full(), segments=True),
    dict(mask=masks.Causal(), segments=True, dense=True, sinks=True, softcap=3.0),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: repr(c["mask"]))
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)])
def test_reference_matches_numpy(case, heads):
  rng = np.random.default_rng(1)
  b, t, s, h = 2, 12, 16, 8
  n, kh = heads
  q = rng.standard_normal((b, t, n, h)).astype(np.float32)
  k = rng.standard_normal((b, s, kh, h)).astype(np.float32)
  v = rng.standard_normal((b, s, kh, h)).astype(np.float32)
  qpos = np.arange(t) + 4  # queries are the last 12 of 16 keys
  kpos = np.arange(s)
  seg = kseg = None
  if case.get("segments"):
    seg = np.repeat([[0, 1, 1, 2]], 3, axis=1).astype(np.int32).repeat(b, 0)
    kseg = np.repeat([[0, 0, 1, 2]], 4, axis=1).astype(np.int32).repeat(b, 0)
  dense = rng.random((b, 1, t, s)) > 0.3 if case.get("dense") else None
  sinks = rng.standard_normal(n).astype(np.float32) if case.get("sinks") else None
  kw = dict(mask=case["mask"], segment_ids=seg, kv_segment_ids=kseg, q_positions=qpos,
            kv_positions=kpos, dense_mask=dense, sinks=sinks, softcap=case.get("softcap"))
  out, lse = reference.attention(q, k, v, **kw)
  vis = np.asarray(reference.visibility(case["mask"], qpos, kpos, seg, kseg, dense))
  vis = np.broadcast_to(vis, (b, n, t, s))
  ref_out, ref_lse = numpy_attention(q, k, v, vis, sinks, case.get("softcap"))
  assert rel_err(out, ref_out) < 1e-5
  np.testing.assert_allclose(np.asarray(lse), ref_lse, rtol=1e-5, atol=1e-5)

  # Gradients against central finite differences of the NumPy implementation on a projection.
  do = rng.standard_normal(out.shape)
  loss = lambda q_, k_, v_: jnp.sum(reference.attention(q_, k_, v_, **kw)[0] * do)
  grads = jax.grad(loss, argnums=(0, 1, 2))(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
  eps = 1e-4
  for i, (x, gx) in enumerate(zip((q, k, v), grads)):
    d = rng.standard_normal(x.shape)
    args = [q, k, v]
    hi = list(args); hi[i] = x.astype(np.float64) + eps * d
    lo = list(args); lo[i] = x.astype(np.float64) - eps * d
    fd = (np.sum(numpy_attention(*hi, vis, sinks, case.get("softcap"))[0] * do)
          - np.sum(numpy_attention(*lo, vis, sinks, case.get("softcap"))[0] * do)) / (2 * eps)
    np.testing.assert_allclose(float(np.sum(np.asarray(gx) * d)), fd, rtol=2e-3, atol=2e-3)


def test_empty_rows_zero_output_and_gradient():
  rng = np.random.default_rng(2)
  q = jnp.asarray(rng.standard_normal((1, 4, 2, 8)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((1, 4, 2, 8)), jnp.float32)
  # queries at positions 0..3, keys at 10..13: causal sees nothing.
  kw = dict(mask=masks.Causal(), q_positions=jnp.arange(4), kv_positions=jnp.arange(10, 14))
  out, lse = reference.attention(q, k, k, **kw)
  assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(np.asarray(lse)))
  g = jax.grad(lambda q_, k_: jnp.sum(reference.attention(q_, k_, k_, **kw)[0]), argnums=(0, 1))(q, k)
  for x in g:
    assert np.all(np.isfinite(np.asarray(x))) and np.all(np.asarray(x) == 0)


def test_float64_when_x64_enabled():
  with jax.enable_x64(True):
    q = jnp.ones((1, 3, 1, 4), jnp.float64) * 0.3
    out, lse = reference.attention(q, q, q, mask=masks.Causal())
    assert out.dtype == jnp.float64 and lse.dtype == jnp.float64
