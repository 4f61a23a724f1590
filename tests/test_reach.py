"""A ring as long as the mask reaches: ``reach.ring_reach``, its soundness, the ring over 8 CPU
devices against the reference for every mask class x layout, and the bytes it sends."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st
from jax.sharding import AxisType

from pallas_ring import SequenceParallelConfig, layouts, masks, reference, sharded_attention
from pallas_ring.reach import ring_reach
from conftest import rel_err

C = 8  # tokens per device in the ring tests (T = 64 over 8 devices)
COLLECTIVES = ("ppermute", "all_gather", "all_to_all", "psum_scatter", "reduce_scatter")


def sent_bytes(jaxpr, mult=1) -> int:
  """Bytes one device sends: collective operands times the lengths of their enclosing scans."""
  total = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in COLLECTIVES:
      total += mult * sum(int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize for v in eqn.invars)
    inner = mult * (eqn.params["length"] if eqn.primitive.name == "scan" else 1)
    for param in eqn.params.values():
      for sub in (param if isinstance(param, (tuple, list)) else (param,)):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          total += sent_bytes(sub, inner)
  return total


@pytest.mark.ci_cases(every=True)
@pytest.mark.parametrize("mask, expected", [
    (masks.Causal(), [(7, 0), (7, 0), (7, 0)]),
    (masks.Full(), [(7, 0), (7, 0), (7, 0)]),
    (masks.PrefixLM(4), [(7, 0), (7, 0), (7, 0)]),
    (masks.SlidingWindow(C // 2), [(1, 0), (1, 1), (4, 0)]),
    (masks.SlidingWindow(3 * C // 2), [(2, 0), (3, 3), (7, 0)]),  # wider than a shard
    (masks.SlidingWindow(C // 2, 2), [(1, 1), (1, 1), (4, 2)]),  # right context
    (masks.ChunkedCausal(C), [(0, 0), (1, 1), (7, 0)]),
    (masks.ChunkedCausal(2 * C), [(1, 0), (3, 3), (7, 0)]),
    (masks.Causal() & masks.SlidingWindow(2), [(1, 0), (1, 1), (2, 0)]),
    (masks.SlidingWindow(1) | masks.ChunkedCausal(C), [(1, 0), (1, 1), (7, 0)]),
    (masks.Causal() | masks.SlidingWindow(1), [(7, 0), (7, 0), (7, 0)]),
    (masks.Custom(jnp.greater_equal), [(7, 0), (7, 0), (7, 0)]),
])
def test_ring_reach_table(mask, expected):
  """(forward, backward) hops for contiguous, zigzag and striped shards of 8 tokens on 8."""
  assert [ring_reach(mask, 8 * C, lay, 8) for lay in layouts.LAYOUTS] == expected


_primitive = st.one_of(
    st.builds(masks.SlidingWindow, st.integers(0, 40), st.integers(0, 12)),
    st.builds(masks.ChunkedCausal, st.integers(1, 40)),
    st.builds(masks.PrefixLM, st.integers(0, 20)),
    st.just(masks.Causal()))
_specs = st.recursive(_primitive, lambda s: st.one_of(
    st.builds(lambda a, b: a & b, s, s), st.builds(lambda a, b: a | b, s, s)), max_leaves=3)


@given(_specs, st.sampled_from(layouts.LAYOUTS), st.sampled_from([2, 3, 4, 8]),
       st.sampled_from([2, 4, 6]))
def test_reach_is_sound(mask, layout, r, half):
  """Every (query shard, key shard) pair with a visible position pair is within the reach."""
  t = 2 * half * r
  fwd, bwd = ring_reach(mask, t, layout, r)
  order = np.asarray(layouts.global_order(t, layout, r)).reshape(r, -1)
  for dst in range(r):
    for src in range(r):
      vis = np.asarray(mask.visible(order[dst][:, None], order[src][None, :]))
      if vis.any():
        s = (dst - src) % r
        assert s == 0 or s <= fwd or r - s <= bwd, (dst, src, fwd, bwd)


def _problem(seed, t=8 * C, n=2, kh=1, h=16):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.standard_normal((1, t, m, h)), jnp.float32) for m in (n, kh, kh)]


@functools.lru_cache(maxsize=None)
def _mesh():
  return jax.make_mesh((8,), ("sp",), axis_types=(AxisType.Auto,))


def _check_against_reference(mask, layout, seg=None, tol=2e-5, strategy="ring"):
  cfg = SequenceParallelConfig(axis_name="sp", layout=layout, backend="xla", strategy=strategy,
                               block_sizes={"block_q": 4, "block_kv": 4, "block_q_bwd": 4,
                                            "block_kv_bwd": 4})
  q, k, v = _problem(7)
  perm = lambda x: None if x is None else layouts.permute(x, layout, 8)
  w = jnp.cos(jnp.arange(16.0))

  def ours(q_, k_, v_):
    out = sharded_attention(perm(q_), perm(k_), perm(v_), mesh=_mesh(), config=cfg, mask=mask,
                            segment_ids=perm(seg))
    return layouts.unpermute(out, layout, 8)

  ref = lambda q_, k_, v_: reference.attention(q_, k_, v_, mask=mask, segment_ids=seg)[0]
  both = lambda f: lambda *a: (f(*a), jax.grad(lambda *b: jnp.sum(f(*b) * w),
                                               argnums=(0, 1, 2))(*a))
  out, grads = jax.jit(both(ours))(q, k, v)
  out_ref, grads_ref = both(ref)(q, k, v)
  assert rel_err(out, out_ref) < tol
  for name, a, b_ in zip("qkv", grads, grads_ref):
    assert rel_err(a, b_) < tol, (name, rel_err(a, b_))


REACH_MASKS = {
    "window": masks.SlidingWindow(C // 2),
    "wide_window": masks.SlidingWindow(3 * C // 2),  # wider than a shard
    "window_right": masks.SlidingWindow(C // 2, 3),  # right context
    "chunked": masks.ChunkedCausal(C),
    "causal_and_window": masks.Causal() & masks.SlidingWindow(C + 1),
    "window_or_chunked": masks.SlidingWindow(2) | masks.ChunkedCausal(2 * C),
}


# The mask x layout cases whose ring is shorter than the whole ring (the rest run today's ring,
# which test_ring covers).
REACH_CASES = [(name, lay) for name, mask in REACH_MASKS.items() for lay in layouts.LAYOUTS
               if sum(ring_reach(mask, 8 * C, lay, 8)) < 7]


@pytest.mark.ci_cases("window-contiguous", "window_or_chunked-zigzag")
@pytest.mark.parametrize("mask_name, layout", REACH_CASES)
def test_reach_ring_matches_the_reference(mask_name, layout):
  _check_against_reference(REACH_MASKS[mask_name], layout)


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_reach_ring_with_documents(strategy):
  seg = jnp.asarray(np.sort(np.random.default_rng(2).integers(0, 6, (1, 8 * C))), jnp.int32)
  _check_against_reference(masks.SlidingWindow(C + 3, 1), "zigzag", seg=seg, strategy=strategy)


def _bytes(layout, mask, c=64, strategy="ring"):
  mesh = _mesh()
  cfg = SequenceParallelConfig(axis_name="sp", layout=layout, backend="xla", strategy=strategy)
  q = jax.ShapeDtypeStruct((1, 8 * c, 2, 32), jnp.float32)
  f = lambda q_, k_, v_: sharded_attention(q_, k_, v_, mesh=mesh, config=cfg, mask=mask)
  grad = jax.grad(lambda *a: jnp.sum(f(*a)), argnums=(0, 1, 2))
  return (sent_bytes(jax.make_jaxpr(f)(q, q, q).jaxpr),
          sent_bytes(jax.make_jaxpr(grad)(q, q, q).jaxpr))


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_window_ring_sends_at_most_a_third_of_the_causal_ring(layout):
  """8 devices, C = 64 tokens each: SlidingWindow(C/2) sends <= 1/3 of the causal ring's bytes
  (forward, forward+backward); ChunkedCausal(C) on contiguous shards sends nothing."""
  causal = _bytes(layout, masks.Causal())
  window = _bytes(layout, masks.SlidingWindow(32))
  shard = 64 * 2 * 32 * 4  # one K (or V) shard, float32
  assert causal[0] == 7 * 2 * shard  # the whole ring: 7 steps of K and V
  assert window[0] <= causal[0] / 3 and window[1] <= causal[1] / 3, (window, causal)
  if layout == "contiguous":
    assert window[0] == shard  # the previous shard's last 32 K and V tokens (halo_gather)
    assert _bytes(layout, masks.ChunkedCausal(64)) == (0, 0)
    # all_gather gathers only the slices the mask reaches, too (a causal mask: every shard)
    assert _bytes(layout, masks.SlidingWindow(32), strategy="all_gather") == window
    assert _bytes(layout, masks.Causal(), strategy="all_gather")[0] > window[0]
