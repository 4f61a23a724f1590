"""layouts.balance: balanced placement of packed documents over a contiguous ring."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st
from jax.sharding import AxisType

from pallas_ring import SequenceParallelConfig, layouts, masks, reference, sharded_attention
from pallas_ring import balance as balance_lib
from conftest import rel_err

# Long-tail document lengths (the pack of 12, summing to 2048).
LONG_TAIL = [700, 420, 260, 180, 130, 100, 80, 60, 40, 32, 28, 18]


def _segments(lengths):
  return np.repeat(np.arange(len(lengths)), lengths)[None].astype(np.int32)  # [1, T]


def _work_by_shard(seg, perm, r, mask):
  """Each shard's work recounted elementwise from the permuted tokens (not the balancer's)."""
  t = seg.shape[1]
  pos = np.arange(t)
  vis = np.asarray(mask.visible(pos[:, None], pos[None, :])) & (seg[0][:, None] == seg[0][None])
  per_token = vis.sum(axis=1)  # [T] keys each query sees
  return per_token[perm[0]].reshape(r, t // r).sum(axis=1)


@pytest.mark.ci_cases(every=True)
@pytest.mark.parametrize("r", [2, 4, 8])
@pytest.mark.parametrize("mask", [masks.Causal(), masks.SlidingWindow(64)])
def test_long_tail_pack_is_balanced(r, mask):
  seg = _segments(LONG_TAIL)
  p = layouts.balance(seg, r, mask=mask)
  work = _work_by_shard(seg, p.perm, r, mask)
  np.testing.assert_allclose(p.work[0], work)
  assert work.max() / work.mean() <= 1.05
  zigzag = balance_lib.contiguous_work(seg, r, "zigzag", mask)
  if isinstance(mask, masks.Causal):  # what zigzag gives this pack (the 1.23 .. 1.69)
    assert zigzag.max() / zigzag.mean() > 1.2


@pytest.mark.parametrize("lengths", [[128] * 16, [100] * 20 + [48], [256] * 8, [512] * 4])
def test_uniform_documents_are_balanced_and_kept_whole_where_they_fit(lengths):
  seg = _segments(lengths)
  p = layouts.balance(seg, 8)
  assert p.imbalance[0] <= 1.05
  if lengths[0] <= 256 and 256 % lengths[0] == 0:  # whole documents fit: none is split
    shards = p.perm[0].reshape(8, -1)
    docs_per_shard = [set(seg[0][s].tolist()) for s in shards]
    assert sum(len(d) for d in docs_per_shard) == len(lengths)


@st.composite
def _packs(draw):
  r = draw(st.sampled_from([1, 2, 4, 8]))
  c = draw(st.sampled_from([1, 2, 8, 32]))
  t = r * c
  cuts = sorted(set(draw(st.lists(st.integers(1, t - 1), max_size=12)))) if t > 1 else []
  lengths = np.diff([0, *cuts, t])
  b = draw(st.sampled_from([1, 2]))
  rows = [_segments(lengths)[0]]
  if b == 2:  # a second row: one token per document, ids shuffled (ids need not be sorted)
    rows.append(np.random.default_rng(len(cuts)).permutation(t).astype(np.int32))
  return np.stack(rows), r


@given(_packs())
def test_balance_properties(pack):
  """A permutation of every row, exactly T / R tokens a shard, shards in original order,
  positions = original indices, permute / unpermute inverse, work recounted exactly."""
  seg, r = pack
  b, t = seg.shape
  p = layouts.balance(seg, r)
  assert p.perm.shape == p.positions.shape == (b, t) and p.ring_size == r
  for row in range(b):
    np.testing.assert_array_equal(np.sort(p.perm[row]), np.arange(t))
    shards = p.perm[row].reshape(r, t // r)
    assert np.all(np.diff(shards, axis=1) > 0)  # each shard keeps its tokens' order
    np.testing.assert_allclose(p.work[row], _work_by_shard(seg[row:row + 1], p.perm[row:row + 1],
                                                           r, masks.Causal()))
  np.testing.assert_array_equal(p.positions, p.perm)
  x = np.arange(b * t * 3).reshape(b, t, 3)
  np.testing.assert_array_equal(p.unpermute(p.permute(x)), x)
  np.testing.assert_array_equal(p.permute(x)[..., 0] // 3 % t, p.perm)
  np.testing.assert_array_equal(p.permute(seg), np.take_along_axis(seg, p.perm, axis=1))


@pytest.mark.parametrize("r", [2, 8])
def test_one_document_row_is_split_zigzag_and_balanced(r):
  p = layouts.balance(np.zeros((1, 64 * r), np.int32), r)
  np.testing.assert_allclose(p.work[0], p.work[0].mean())  # exactly equal (classic zigzag)
  np.testing.assert_array_equal(p.perm[0], np.asarray(layouts.global_order(64 * r, "zigzag", r)))


def test_documents_of_one_token_stay_whole():
  seg = np.arange(64, dtype=np.int32)[None]  # every token its own document
  p = layouts.balance(seg, 8)
  np.testing.assert_array_equal(p.work[0], 8.0)
  np.testing.assert_array_equal(np.sort(p.perm[0]), np.arange(64))


def test_permute_keeps_jax_arrays_and_other_axes():
  seg = _segments([10, 6])
  p = layouts.balance(seg, 2)
  x = jnp.arange(2 * 16).reshape(1, 2, 16)  # tokens at axis 2
  y = p.permute(x, axis=2)
  assert isinstance(y, jax.Array)
  np.testing.assert_array_equal(y[0, 0], p.perm[0])
  np.testing.assert_array_equal(p.unpermute(y, axis=2), x)
  with pytest.raises(ValueError, match=r"shape \(1, 2, 16\).*B=1 rows of T=16"):
    p.permute(x, axis=1)


@pytest.mark.parametrize("kwargs, match", [
    (dict(segment_ids=np.zeros((1, 30), np.int32), ring_size=8), "multiple of ring_size=8"),
    (dict(segment_ids=np.zeros(32, np.int32), ring_size=8), r"shape \(32,\).*\[B, T\]"),
    (dict(segment_ids=np.zeros((1, 32), np.int32), ring_size=0), "`ring_size`=0"),
])
def test_balance_errors(kwargs, match):
  with pytest.raises(ValueError, match=match):
    layouts.balance(**kwargs)


def _problem(seed, b, t, n=2, kh=1, h=16):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.standard_normal((b, t, m, h)), jnp.float32) for m in (n, kh, kh)]


@pytest.mark.parametrize("mask", [masks.Causal(), masks.SlidingWindow(9) | masks.PrefixLM(3)])
def test_sharded_attention_on_a_placement_equals_the_packed_reference(mask):
  """8 devices, contiguous layout, the placement's segment ids and positions: unpermuted, the
  output and the gradients are the packed row's (dense reference)."""
  mesh = jax.make_mesh((8,), ("sp",), axis_types=(AxisType.Auto,))
  cfg = SequenceParallelConfig(axis_name="sp", backend="xla")
  lengths = [50, 30, 20, 10, 8, 5, 3, 1, 1]  # 128 tokens, long tail
  seg = np.concatenate([_segments(lengths), _segments(lengths[::-1])])  # [2, 128]
  p = layouts.balance(seg, 8, mask=mask)
  assert p.imbalance.max() <= 1.1
  q, k, v = _problem(3, 2, 128)
  pseg = p.permute(seg)

  def ours(q_, k_, v_):
    out = sharded_attention(p.permute(q_), p.permute(k_), p.permute(v_), mesh=mesh, config=cfg,
                            mask=mask, segment_ids=pseg, positions=p.positions)
    return p.unpermute(out)

  ref = lambda q_, k_, v_: reference.attention(q_, k_, v_, mask=mask, segment_ids=seg)[0]
  assert rel_err(ours(q, k, v), ref(q, k, v)) < 2e-5
  w = jnp.cos(jnp.arange(16.0))
  loss = lambda f: lambda *a: jnp.sum(f(*a) * w)
  for a, b_ in zip(jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2)))(q, k, v),
                   jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v)):
    assert rel_err(a, b_) < 2e-5


@pytest.mark.parametrize("layout, devices, match", [
    ("zigzag", 8, "layout='contiguous'.*call's layout is 'zigzag'"),
    ("contiguous", 4, "built for a ring of 8 shards, but the ring has 4"),
])
def test_placement_used_with_another_layout_or_ring_raises(layout, devices, match):
  mesh = jax.make_mesh((devices,), ("sp",), axis_types=(AxisType.Auto,),
                       devices=jax.devices()[:devices])
  cfg = SequenceParallelConfig(axis_name="sp", layout=layout, backend="xla")
  seg = _segments([40, 24])
  p = layouts.balance(seg, 8)
  q, k, v = _problem(4, 1, 64)
  for positions in (p.positions, p):  # its positions, or the placement itself
    with pytest.raises(ValueError, match=match):
      sharded_attention(q, k, v, mesh=mesh, config=cfg, mask=masks.Causal(),
                        segment_ids=p.permute(seg), positions=positions)


@pytest.mark.parametrize("strategy", ["ring", "all_gather", "ulysses"])
def test_cu_seqlens_on_a_placement_pack_the_original_order(strategy):
  """``cu_seqlens`` with a placement's positions: each token's sequence is found at its original
  index, not its index in layout order (it was, silently), and the padding tail is invisible;
  positions of one's own beside ``cu_seqlens`` raise."""
  from pallas_ring import packing
  mesh = jax.make_mesh((8,), ("sp",), axis_types=(AxisType.Auto,))
  cfg = SequenceParallelConfig(axis_name="sp", strategy=strategy, backend="xla")
  cu = np.array([0, 60, 90, 110, 120], np.int32)  # 8 tokens of padding
  p = layouts.balance(np.asarray(packing.segment_ids_from_cu_seqlens(cu, 128)), 8,
                      mask=masks.Causal())
  q, k, v = _problem(5, 1, 128, n=8)
  out = sharded_attention(*(p.permute(x) for x in (q, k, v)), mesh=mesh, config=cfg,
                          mask=masks.Causal(), cu_seqlens=jnp.asarray(cu), positions=p)
  ids = lambda pad: packing.packed_segment_ids(cu, jnp.arange(128), pad)
  ref = reference.attention(q, k, v, mask=masks.Causal(), segment_ids=ids(-1),
                            kv_segment_ids=ids(-2))[0]
  assert rel_err(p.unpermute(out), ref) < 2e-5
  with pytest.raises(ValueError, match="`cu_seqlens` and `positions` together"):
    sharded_attention(q, k, v, mesh=mesh, config=cfg, mask=masks.Causal(),
                      cu_seqlens=jnp.asarray(cu), positions=jnp.arange(128) + 7)
