"""Halo exchange: a reach-limited ring step sends only the slice of a shard the mask can see.

``halo.halo_runs`` per mask x layout; the ring on 8 CPU devices against the reference (forward
and gradients, GQA, segment ids, a bias) for windows narrower and wider than a shard, with right
context and combined with ``&`` and ``|``; the bytes it sends against whole shards
(``RingVariants(halo=False)``, the ring before halos)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from pallas_ring import SequenceParallelConfig, layouts, masks, reference, ring_attention
from pallas_ring import halo_gather, sharded_attention
from pallas_ring.halo import RingVariants, halo_runs
from pallas_ring.reach import ring_reach
from conftest import jaxpr_eqns, rel_err
from test_reach import sent_bytes

C = 16  # tokens per device (T = 128 over 8 devices)
BLOCKS = {"block_q": 4, "block_kv": 4, "block_q_bwd": 4, "block_kv_bwd": 4}


def _chains(mask, layout, t=8 * C, r=8):
  f, b = ring_reach(mask, t, layout, r)
  return [halo_runs(mask, t, layout, r, d, n) for d, n in ((1, f), (-1, b)) if n]


def test_halo_runs_table():
  """The slices each chain sends, shards of 16 tokens on 8 (zigzag: two chunks of 8)."""
  assert _chains(masks.SlidingWindow(2), "contiguous") == [((14, 16),)]
  assert _chains(masks.SlidingWindow(2, 3), "contiguous") == [((14, 16),), ((0, 3),)]
  # zigzag: the first chunk's tail goes up, the second chunk's tail goes down
  assert _chains(masks.SlidingWindow(2), "zigzag") == [((6, 8),), ((14, 16),)]
  # with right context, each also needs the other chunk's head
  assert _chains(masks.SlidingWindow(2, 1), "zigzag") == [((6, 9),), ((0, 1), (14, 16))]
  # combined masks: the tighter bound (&), the looser (|)
  assert _chains(masks.Causal() & masks.SlidingWindow(3, 5), "contiguous") == [((13, 16),)]
  assert _chains(masks.SlidingWindow(1) | masks.SlidingWindow(3), "contiguous") == [((13, 16),)]
  # wider than a shard: the first step needs all of it (the ring then sends whole shards)
  assert _chains(masks.SlidingWindow(20), "contiguous") == [((0, 16),)]
  # zigzag, wider than a chunk: all of the first chunk up, 12 of 16 tokens down
  assert _chains(masks.SlidingWindow(12), "zigzag") == [((0, 8),), ((4, 16),)]
  # chunks ending on shard edges: no chain at all
  assert _chains(masks.ChunkedCausal(C), "contiguous") == []


@functools.lru_cache(maxsize=None)
def _mesh():
  return jax.make_mesh((8,), ("sp",), axis_types=(AxisType.Auto,))


def _problem(seed, t=8 * C, n=4, kh=2, h=16):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.standard_normal((1, t, m, h)), jnp.float32) for m in (n, kh, kh)]


CASES = {  # name: (mask, layout, documents, bias)
    "narrow_contiguous": (masks.SlidingWindow(C // 8), "contiguous", False, False),
    "narrow_zigzag_docs": (masks.SlidingWindow(C // 8), "zigzag", True, False),
    "right_zigzag": (masks.SlidingWindow(3, 2), "zigzag", False, False),
    "and_contiguous_bias": (masks.Causal() & masks.SlidingWindow(5, 4), "contiguous", False,
                            True),
    "or_zigzag": (masks.SlidingWindow(2) | masks.SlidingWindow(1, 3), "zigzag", False, False),
    "wide_zigzag_docs": (masks.SlidingWindow(C + C // 2), "zigzag", True, False),
    "wide_contiguous": (masks.SlidingWindow(C + 3, 1), "contiguous", False, False),
}


RING = RingVariants(gather_halos=False)  # halos through ring steps (not gathered at once)


@pytest.mark.parametrize("name,variants", [(name, RING) for name in CASES] + [
    ("narrow_contiguous", None), ("narrow_zigzag_docs", None), ("right_zigzag", None)])
def test_halo_ring_matches_the_reference(name, variants):
  """Output and gradients (q, k, v; the bias where given) against the dense reference; GQA.
  ``variants=None``: the defaults, which gather the narrow halos and attend once
  (``halo_gather``)."""
  mask, layout, docs, with_bias = CASES[name]
  cfg = SequenceParallelConfig(axis_name="sp", layout=layout, backend="xla", block_sizes=BLOCKS,
                               ring_variants=variants)
  if variants is None:
    assert halo_gather.pieces(masks.as_spec(mask), 8 * C, layout, 8, RingVariants())
  q, k, v = _problem(3)
  t = q.shape[1]
  rng = np.random.default_rng(4)
  seg = (jnp.asarray(np.sort(rng.integers(0, 5, (1, t))), jnp.int32) if docs else None)
  bias = jnp.asarray(rng.standard_normal((1, 1, t, t)), jnp.float32) if with_bias else None
  perm = lambda x, axis=1: None if x is None else layouts.permute(x, layout, 8, axis)

  def ours(q_, k_, v_, b_):
    out = sharded_attention(perm(q_), perm(k_), perm(v_), mesh=_mesh(), config=cfg, mask=mask,
                            segment_ids=perm(seg),
                            bias=None if b_ is None else perm(perm(b_, 2), 3))
    return layouts.unpermute(out, layout, 8)

  ref = lambda q_, k_, v_, b_: reference.attention(q_, k_, v_, mask=mask, segment_ids=seg,
                                                   bias=b_)[0]
  w = jnp.cos(jnp.arange(16.0))
  nums = (0, 1, 2, 3) if with_bias else (0, 1, 2)
  both = lambda f: lambda *a: (f(*a), jax.grad(lambda *b: jnp.sum(f(*b) * w), argnums=nums)(*a))
  out, grads = jax.jit(both(ours))(q, k, v, bias)
  out_ref, grads_ref = both(ref)(q, k, v, bias)
  assert rel_err(out, out_ref) < 2e-5
  for name_, a, b_ in zip("qkvb", grads, grads_ref):
    assert rel_err(a, b_) < 2e-5, (name_, rel_err(a, b_))


def _permutes(jaxpr) -> int:
  """The ``ppermute`` ops of a jaxpr and its inner jaxprs (each counted once)."""
  return sum(eqn.primitive.name == "ppermute" for eqn in jaxpr_eqns(jaxpr))


def _ring_bytes(layout, mask, variants, c=64, h=32, count=False):
  """(forward, forward+backward) bytes one device sends through ``ring_attention`` under
  ``shard_map`` (8 devices, ``c`` tokens each, N = K = 2, float32, 8-token tiles); ``count``:
  the number of ``ppermute`` ops instead."""
  spec = P(None, "sp")
  blocks = {key: 8 for key in BLOCKS}

  def f(q, k, v):
    return ring_attention(q, k, v, axis_name="sp", mask=mask, layout=layout, backend="xla",
                          block_sizes=blocks, ring_variants=variants)

  f = jax.shard_map(f, mesh=_mesh(), in_specs=(spec,) * 3, out_specs=spec, check_vma=False)
  x = jax.ShapeDtypeStruct((1, 8 * c, 2, h), jnp.float32)
  grad = jax.grad(lambda *a: jnp.sum(f(*a)), argnums=(0, 1, 2))
  measure = _permutes if count else sent_bytes
  return (measure(jax.make_jaxpr(f)(x, x, x).jaxpr), measure(jax.make_jaxpr(grad)(x, x, x).jaxpr))


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_window_of_an_eighth_sends_an_eighth_of_a_shard(layout):
  """SlidingWindow(C/8), C = 64: each neighbour gets 1/8 of a shard's K/V (forward) and sends
  back 1/8 of its dK/dV; whole shards with ``RingVariants(halo=False)``."""
  mask = masks.SlidingWindow(8)
  halo = _ring_bytes(layout, mask, RING)
  whole = _ring_bytes(layout, mask, RingVariants(halo=False))
  gathered = _ring_bytes(layout, mask, None)  # the defaults: halos received once (halo_gather)
  shard = 64 * 2 * 32 * 4  # one K (or V) shard, float32
  neighbours = 1 if layout == "contiguous" else 2
  assert whole[0] == neighbours * 2 * shard
  assert halo[0] == gathered[0] == neighbours * 2 * shard // 8, (halo, whole)
  assert halo[1] * 8 == whole[1], (halo, whole)
  # the backward sends only the halos' dK/dV back (the ring's steps also send K/V again)
  assert gathered[1] == 2 * gathered[0] < halo[1], (gathered, halo)
  # one collective per neighbour for K and V together (XLA:GPU runs one at a time), and one
  # for their dK/dV
  assert _ring_bytes(layout, mask, None, count=True) == (neighbours, 2 * neighbours)


def test_ring_variants_errors():
  with pytest.raises(ValueError, match="halo_max_share"):
    RingVariants(halo_max_share=1.5)
  with pytest.raises(ValueError, match="RingVariants.halo"):
    RingVariants(halo=1)
  with pytest.raises(ValueError, match="RingVariants.gather_halos"):
    RingVariants(gather_halos="yes")
  with pytest.raises(ValueError, match="RingVariants.forward_received"):
    RingVariants(forward_received=None)
  with pytest.raises(ValueError, match="ring_variants"):
    SequenceParallelConfig(axis_name="sp", ring_variants=3)


def test_gathered_halos_pieces():
  """What ``halo_gather`` receives: each hop's slice, lower ranks first; None where the mask is
  unbounded, a slice is most of a shard, or gathering is off."""
  pieces = lambda mask, layout="contiguous", v=RingVariants(): halo_gather.pieces(
      masks.as_spec(mask), 8 * C, layout, 8, v)
  assert pieces(masks.SlidingWindow(2)) == ((1, ((14, 16),)),)
  assert pieces(masks.SlidingWindow(2, 3)) == ((1, ((14, 16),)), (-1, ((0, 3),)))
  assert pieces(masks.SlidingWindow(2), "zigzag") == ((1, ((6, 8),)), (-1, ((14, 16),)))
  assert pieces(masks.Causal()) is None
  assert pieces(masks.SlidingWindow(C + 3)) is None  # a whole shard and more
  assert pieces(masks.SlidingWindow(2), v=RING) is None


def test_halo_equals_whole_shards_with_dense_mask_dropout_and_alibi():
  """A dense mask's and a bias's columns, dropout keys and ALiBi of a slice: the halo ring equals
  whole shards (``RingVariants(halo=False)``), output and gradients, both chains halos."""
  q, k, v = _problem(5)
  t = q.shape[1]
  rng = np.random.default_rng(6)
  dense = jnp.asarray(rng.random((1, 1, t, t)) > 0.2)
  bias = jnp.asarray(rng.standard_normal((1, 1, t, t)), jnp.float32)
  spec, rows = P(None, "sp"), P(None, None, "sp", None)

  def make(variants):
    def f(q_, k_, v_, dense_, bias_):
      return ring_attention(q_, k_, v_, axis_name="sp", mask=masks.SlidingWindow(2, 1),
                            backend="xla", block_sizes=BLOCKS, dense_mask=dense_, bias=bias_,
                            alibi_slopes=jnp.asarray([0.5, 0.25, 0.125, 0.0625]),
                            dropout_rate=0.2, dropout_rng=jax.random.key(4),
                            ring_variants=variants)
    f = jax.shard_map(f, mesh=_mesh(), in_specs=(spec,) * 3 + (rows,) * 2, out_specs=spec,
                      check_vma=False)
    w = jnp.cos(jnp.arange(16.0))
    loss = lambda *a: jnp.sum(f(*a) * w)
    return jax.jit(lambda *a: (f(*a), jax.grad(loss, argnums=(0, 1, 2, 4))(*a)))

  out, grads = make(None)(q, k, v, dense, bias)
  out_w, grads_w = make(RingVariants(halo=False))(q, k, v, dense, bias)
  assert rel_err(out, out_w) < 1e-6
  for name, a, b_ in zip("qkvb", grads, grads_w):
    assert rel_err(a, b_) < 1e-6, (name, rel_err(a, b_))


@pytest.mark.parametrize("layout,mask,packed", [
    ("contiguous", masks.SlidingWindow(2), True), ("zigzag", masks.SlidingWindow(3, 2), False)])
def test_gathered_halos_equal_the_ring_steps_with_every_extra(layout, mask, packed):
  """Sinks, ALiBi, dropout, the lse and packed sequences (``cu_seqlens``) through the gathered
  halos (``halo_gather``) equal the ring's halo steps: output, lse and gradients (q, k, v,
  sinks)."""
  assert halo_gather.pieces(masks.as_spec(mask), 8 * C, layout, 8, RingVariants())
  q, k, v = _problem(7)
  rng = np.random.default_rng(8)
  sinks = jnp.asarray(rng.standard_normal(4), jnp.float32)
  cu = jnp.asarray([0, 40, 90, 120], jnp.int32) if packed else None
  spec = P(None, "sp")

  def make(variants):
    def f(q_, k_, v_, s_):
      return ring_attention(q_, k_, v_, axis_name="sp", mask=mask, layout=layout, backend="xla",
                            block_sizes=BLOCKS, sinks=s_, alibi_slopes=jnp.asarray(
                                [0.5, 0.25, 0.125, 0.0625]), dropout_rate=0.2,
                            dropout_rng=jax.random.key(3), return_lse=True, cu_seqlens=cu,
                            ring_variants=variants)
    f = jax.shard_map(f, mesh=_mesh(), in_specs=(spec,) * 3 + (P(),),
                      out_specs=(spec, P(None, None, "sp")), check_vma=False)
    w = jnp.cos(jnp.arange(16.0))
    loss = lambda *a: jnp.sum(f(*a)[0] * w) + jnp.sum(jnp.where(jnp.isfinite(f(*a)[1]),
                                                                f(*a)[1], 0.0))
    return jax.jit(lambda *a: (f(*a), jax.grad(loss, argnums=(0, 1, 2, 3))(*a)))

  (out, lse), grads = make(None)(q, k, v, sinks)
  (out_r, lse_r), grads_r = make(RING)(q, k, v, sinks)
  live = jnp.isfinite(lse_r)
  assert rel_err(out, out_r) < 1e-5
  assert rel_err(jnp.where(live, lse, 0.0), jnp.where(live, lse_r, 0.0)) < 1e-5
  for name, a, b_ in zip(("q", "k", "v", "sinks"), grads, grads_r):
    assert rel_err(a, b_) < 1e-5, (name, rel_err(a, b_))
