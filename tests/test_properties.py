"""Property tests: random mask expressions x positions x segment ids x layouts x ring sizes x GQA
against the dense reference, forward and gradients (deterministic: 60 + 24 examples in ``make
test-all``, fewer in CI, see ``examples``).

Mask expressions come from a fixed pool so compiled programs are reused across examples; the
data (positions, segment ids, inputs) is fresh in every example.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import AxisType

from pallas_ring import SequenceParallelConfig, flash_attention, layouts, masks, reference
from pallas_ring import sharded_attention
from conftest import examples, rel_err

POOL = [
    masks.Causal(),
    masks.SlidingWindow(5, 2),
    masks.ChunkedCausal(6) | masks.PrefixLM(4),
    masks.Causal() & masks.SlidingWindow(9),
    masks.Full(),
    masks.SlidingWindow(0, 7) | masks.PrefixLM(3),
]
MESHES = {r: jax.make_mesh((r,), ("sp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:r])
          for r in (1, 2, 4, 8)}


def _data(seed, t, n, kh, docs):
  rng = np.random.default_rng(seed)
  h = 16
  q = jnp.asarray(rng.standard_normal((1, t, n, h)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((1, t, kh, h)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((1, t, kh, h)), jnp.float32)
  seg = jnp.asarray(np.sort(rng.integers(0, docs, (1, t)), axis=1), jnp.int32) if docs else None
  return rng, q, k, v, seg


def _grads(fn, q, k, v, w):
  return jax.grad(lambda *a: jnp.sum(fn(*a) * w), argnums=(0, 1, 2))(q, k, v)


@pytest.mark.ci
@settings(max_examples=examples(ci=12, all=60))  # all: ~3 minutes of a core
@given(mask=st.sampled_from(POOL), heads=st.sampled_from([(4, 4), (4, 2), (4, 1)]),
       docs=st.sampled_from([0, 3]), offset=st.integers(-20, 20), shuffle=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_flash_attention_equals_reference(mask, heads, docs, offset, shuffle, seed):
  t = 40
  rng, q, k, v, seg = _data(seed, t, *heads, docs)
  qpos = np.arange(t) + offset
  kpos = rng.permutation(t) if shuffle else np.arange(t)  # non-contiguous key positions
  kw = dict(mask=mask, segment_ids=seg, q_positions=jnp.asarray(qpos, jnp.int32),
            kv_positions=jnp.asarray(kpos, jnp.int32))
  out = flash_attention(q, k, v, backend="xla", **kw)
  ref = reference.attention(q, k, v, **kw)[0]
  assert rel_err(out, ref) < 1e-5
  w = jnp.asarray(rng.standard_normal(q.shape[-1]), jnp.float32)
  g1 = _grads(lambda *a: flash_attention(*a, backend="xla", **kw), q, k, v, w)
  g2 = _grads(lambda *a: reference.attention(*a, **kw)[0], q, k, v, w)
  for a, b in zip(g1, g2):
    assert np.all(np.isfinite(np.asarray(a)))
    assert rel_err(a, b) < 1e-5


@pytest.mark.ci
@settings(max_examples=examples(ci=6, all=24))  # all: ~5 minutes of a core
@given(mask=st.sampled_from(POOL[:3]), layout=st.sampled_from(layouts.LAYOUTS),
       ring=st.sampled_from([1, 2, 4, 8]), strategy=st.sampled_from(["ring", "all_gather"]),
       docs=st.integers(1, 4), seed=st.integers(0, 2**31 - 1))
def test_sharded_attention_equals_reference(mask, layout, ring, strategy, docs, seed):
  t = 32
  rng, q, k, v, seg = _data(seed, t, 4, 2, docs)
  cfg = SequenceParallelConfig(axis_name="sp", layout=layout, strategy=strategy, backend="xla")
  perm = lambda x: layouts.permute(x, layout, ring)

  @jax.jit
  def ours(q_, k_, v_):
    out = sharded_attention(perm(q_), perm(k_), perm(v_), mesh=MESHES[ring], config=cfg,
                            mask=mask, segment_ids=perm(seg))
    return layouts.unpermute(out, layout, ring)

  ref = lambda *a: reference.attention(*a, mask=mask, segment_ids=seg)[0]
  assert rel_err(ours(q, k, v), ref(q, k, v)) < 1e-5
  w = jnp.asarray(rng.standard_normal(q.shape[-1]), jnp.float32)
  for a, b in zip(_grads(ours, q, k, v, w), _grads(ref, q, k, v, w)):
    assert rel_err(a, b) < 1e-5
