import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from pallas_ring import block_sparse as bs, layouts, masks, reference


def _plan(spec, qpos, kpos, bq, bk, qseg=None, kseg=None, dense=None):
  t, s = qpos.shape[-1], kpos.shape[-1]
  tp, sp = -(-t // bq) * bq, -(-s // bk) * bk
  qi = bs.pad_token_info(bs.make_token_info(t, 1, qpos, qseg), tp)
  ki = bs.pad_token_info(bs.make_token_info(s, 1, kpos, kseg), sp)
  return bs.make_plan(spec, qi, ki, block_q=bq, block_kv=bk, q_len=t, kv_len=s, dense_mask=dense)


def _dense_classes(vis, bq, bk):
  """Brute-force per-block classes from a dense [T, S] visibility (padding: masked)."""
  t, s = vis.shape
  tp, sp = -(-t // bq) * bq, -(-s // bk) * bk
  v = np.zeros((tp, sp), bool)
  v[:t, :s] = vis
  valid = np.zeros((tp, sp), bool)
  valid[:t, :s] = True
  v = v.reshape(tp // bq, bq, sp // bk, bk)
  valid = valid.reshape(tp // bq, bq, sp // bk, bk)
  any_ = v.any(axis=(1, 3))
  all_ = (v | ~valid).all(axis=(1, 3))
  kv_pad = np.arange(sp).reshape(-1, bk).max(axis=1) >= s
  all_ &= ~kv_pad[None, :]
  return any_, all_


mask_strategy = st.deferred(lambda: st.one_of(
    st.just(masks.Full()), st.just(masks.Causal()),
    st.builds(masks.SlidingWindow, st.integers(0, 12), st.integers(0, 6)),
    st.builds(masks.ChunkedCausal, st.integers(1, 12)),
    st.builds(masks.PrefixLM, st.integers(0, 20)),
    st.builds(lambda a, b: a & b, mask_strategy, mask_strategy),
    st.builds(lambda a, b: a | b, mask_strategy, mask_strategy)))


@given(spec=mask_strategy, layout=st.sampled_from(layouts.LAYOUTS), ring=st.sampled_from([1, 2, 4]),
       q_rank=st.integers(0, 3), k_rank=st.integers(0, 3), docs=st.integers(0, 4),
       bq=st.sampled_from([4, 8]), bk=st.sampled_from([4, 8]), seed=st.integers(0, 2**16))
def test_plan_is_sound(spec, layout, ring, q_rank, k_rank, docs, bq, bk, seed):
  """Never EMPTY with a visible pair, never FULL with a masked pair (any positions, any layout)."""
  t = 32
  q_rank, k_rank = q_rank % ring, k_rank % ring
  qpos = np.asarray(layouts.positions(t, layout, ring, q_rank))
  kpos = np.asarray(layouts.positions(t, layout, ring, k_rank))
  rng = np.random.default_rng(seed)
  qseg = kseg = None
  if docs:
    seg = np.sort(rng.integers(0, docs + 1, size=t)).astype(np.int32)  # packed documents
    seg_l = layouts.global_order(t, layout, ring)
    seg_l = seg[seg_l].reshape(ring, -1)
    qseg, kseg = jnp.asarray(seg_l[q_rank][None]), jnp.asarray(seg_l[k_rank][None])
  plan = _plan(spec, jnp.asarray(qpos), jnp.asarray(kpos), bq, bk, qseg, kseg)
  vis = np.asarray(reference.visibility(spec, qpos, kpos, qseg, kseg))[0, 0]
  any_, all_ = _dense_classes(vis, bq, bk)
  cls = np.asarray(plan.block_class)[0, 0]
  assert not np.any((cls == bs.EMPTY) & any_), "EMPTY block with a visible pair"
  assert not np.any((cls == bs.FULL) & ~all_), "FULL block with a masked pair"


@given(spec=st.one_of(st.just(masks.Causal()), st.builds(masks.SlidingWindow, st.integers(0, 9), st.integers(0, 9)),
                      st.builds(masks.ChunkedCausal, st.integers(1, 9)), st.builds(masks.PrefixLM, st.integers(0, 20))),
       t=st.sampled_from([1, 13, 32]), s=st.sampled_from([5, 32]), bq=st.sampled_from([1, 4, 8]), bk=st.sampled_from([4, 8]),
       offset=st.integers(-8, 8))
def test_plan_is_exact_for_contiguous_positions(spec, t, s, bq, bk, offset):
  qpos = jnp.arange(t, dtype=jnp.int32) + offset
  kpos = jnp.arange(s, dtype=jnp.int32)
  plan = _plan(spec, qpos, kpos, bq, bk)
  vis = np.asarray(reference.visibility(spec, qpos, kpos))[0, 0]
  any_, all_ = _dense_classes(vis, bq, bk)
  expected = np.where(any_, np.where(all_, bs.FULL, bs.PARTIAL), bs.EMPTY)
  np.testing.assert_array_equal(np.asarray(plan.block_class)[0, 0], expected)


def _live(plan):
  return int(np.sum(np.asarray(plan.block_class) > 0))


@pytest.mark.parametrize("n", [1, 4, 7])
def test_causal_counts_closed_form(n):
  b = 8
  pos = jnp.arange(n * b)
  plan = _plan(masks.Causal(), pos, pos, b, b)
  cls = np.asarray(plan.block_class)[0, 0]
  assert _live(plan) == n * (n + 1) // 2
  assert int(np.sum(cls == bs.FULL)) == n * (n - 1) // 2
  assert int(np.sum(cls == bs.PARTIAL)) == n
  np.testing.assert_array_equal(np.asarray(plan.kv_count)[0, 0], np.arange(1, n + 1))
  np.testing.assert_array_equal(np.asarray(plan.q_count)[0, 0], np.arange(n, 0, -1))


@pytest.mark.parametrize("n, wb", [(8, 1), (8, 3), (5, 7)])
def test_window_counts_closed_form(n, wb):
  b = 4
  pos = jnp.arange(n * b)
  plan = _plan(masks.SlidingWindow(wb * b), pos, pos, b, b)
  assert _live(plan) == sum(min(i, wb) + 1 for i in range(n))
  full = sum(i if i < wb else wb - 1 for i in range(n))
  assert int(np.sum(np.asarray(plan.block_class) == bs.FULL)) == full


@pytest.mark.parametrize("docs, m", [(4, 2), (3, 3), (1, 5)])
def test_documents_counts_closed_form(docs, m):
  b = 4
  t = docs * m * b
  seg = jnp.repeat(jnp.arange(docs, dtype=jnp.int32), m * b)[None]
  pos = jnp.arange(t)
  plan = _plan(masks.Causal(), pos, pos, b, b, seg, seg)
  assert _live(plan) == docs * m * (m + 1) // 2
  plan_full = _plan(masks.Full(), pos, pos, b, b, seg, seg)
  assert _live(plan_full) == docs * m * m
  assert int(np.sum(np.asarray(plan_full.block_class) == bs.FULL)) == docs * m * m


def test_lists_and_flags():
  pos = jnp.arange(16)
  plan = _plan(masks.SlidingWindow(4), pos, pos, 4, 4)
  np.testing.assert_array_equal(np.asarray(plan.kv_index)[0, 0],
                                [[0, 0, 0, 0], [0, 1, 1, 1], [1, 2, 2, 2], [2, 3, 3, 3]])
  # Causal: FULL blocks first, then the PARTIAL diagonal.
  causal = _plan(masks.Causal(), pos, pos, 4, 4)
  np.testing.assert_array_equal(np.asarray(causal.kv_index)[0, 0][3], [0, 1, 2, 3])
  np.testing.assert_array_equal(np.asarray(causal.kv_full)[0, 0], [0, 1, 2, 3])
  np.testing.assert_array_equal(np.asarray(causal.q_index)[0, 0][0], [1, 2, 3, 0])
  np.testing.assert_array_equal(np.asarray(causal.q_full)[0, 0], [3, 2, 1, 0])
  np.testing.assert_array_equal(np.asarray(plan.kv_class)[0, 0],
                                [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0]])
  np.testing.assert_array_equal(np.asarray(plan.q_index)[0, 0],
                                [[0, 1, 1, 1], [1, 2, 2, 2], [2, 3, 3, 3], [3, 3, 3, 3]])
  assert bool(plan.any_live) and not np.all(np.asarray(plan.block_class) == bs.FULL)
  # A ring step where keys are all in the future: nothing live.
  none = _plan(masks.Causal(), pos, pos + 100, 4, 4)
  assert not bool(none.any_live)
  # Keys all in the past: everything full.
  past = _plan(masks.Causal(), pos + 100, pos, 4, 4)
  assert np.all(np.asarray(past.block_class) == bs.FULL)


def test_padding_makes_blocks_partial_and_dense_mask_blocks():
  pos = jnp.arange(10)
  plan = _plan(masks.Full(), pos, pos, 4, 4)
  np.testing.assert_array_equal(np.asarray(plan.block_class)[0, 0][0], [2, 2, 1])
  dense = np.zeros((2, 1, 8, 8), bool)
  dense[0, 0, :4, :4] = True
  dense[1, 0, 4:, :] = True
  plan = _plan(masks.Full(), jnp.arange(8), jnp.arange(8), 4, 4, dense=jnp.asarray(dense))
  np.testing.assert_array_equal(np.asarray(plan.block_class)[:, 0],
                                [[[2, 0], [0, 0]], [[0, 0], [2, 2]]])


def test_plan_cost_is_blockwise():
  """A 1M-token causal plan never builds T x S: jaxpr has no array with T*S elements."""
  t, b = 2**20, 512
  qi = bs.make_token_info(t, 1)
  jaxpr = jax.make_jaxpr(lambda a, c: bs.make_plan(masks.Causal(), a, c, block_q=b, block_kv=b,
                                                   q_len=t, kv_len=t))(qi, qi)
  biggest = max(int(np.prod(v.aval.shape)) for eq in jaxpr.eqns for v in eq.outvars)
  assert biggest <= max(2 * t, (t // b) ** 2)  # O(T + nq*nk), never T*S = 2**40


def test_full_run_is_the_leading_consecutive_full_blocks():
  dense = np.ones((1, 1, 16, 16), bool)
  dense[0, 0, 4:8, 4:8] = False  # q block 1 (size 4): kv block 1 masked
  dense[0, 0, 4, 5] = True  # ... but not entirely: PARTIAL
  plan = _plan(masks.Full(), jnp.arange(16), jnp.arange(16), 4, 4, dense=jnp.asarray(dense))
  np.testing.assert_array_equal(np.asarray(plan.block_class)[0, 0][1], [2, 1, 2, 2])
  np.testing.assert_array_equal(np.asarray(plan.kv_index)[0, 0][1], [0, 2, 3, 1])
  # Row 1: FULL blocks 0, 2, 3; only block 0 starts a consecutive run.
  np.testing.assert_array_equal(np.asarray(plan.kv_full)[0, 0], [4, 1, 4, 4])


@given(spec=mask_strategy, t=st.sampled_from([1, 4, 13]), s=st.sampled_from([32, 47]),
       bq=st.sampled_from([1, 8]), bk=st.sampled_from([4, 8]), offset=st.integers(-8, 40),
       docs=st.booleans(), seed=st.integers(0, 2**16))
def test_range_plan_lists_every_live_tile_between_the_first_and_the_last(spec, t, s, bq, bk,
                                                                        offset, docs, seed):
  """``range_plan`` (decode's forward plan) lists, per q block, the consecutive tiles from the
  first live one to the last live one of ``make_plan``, all PARTIAL, padded with the last."""
  rng = np.random.default_rng(seed)
  qpos = jnp.arange(t, dtype=jnp.int32) + offset
  kpos = jnp.arange(s, dtype=jnp.int32)
  qseg = kseg = None
  if docs:  # a cache's length: slots past it are another segment
    qseg = jnp.zeros((1, t), jnp.int32)
    kseg = (jnp.arange(s)[None] >= rng.integers(0, s + 1)).astype(jnp.int32)
  exact = _plan(spec, qpos, kpos, bq, bk, qseg, kseg)
  tp, sp = -(-t // bq) * bq, -(-s // bk) * bk
  qi = bs.pad_token_info(bs.make_token_info(t, 1, qpos, qseg), tp)
  ki = bs.pad_token_info(bs.make_token_info(s, 1, kpos, kseg), sp)
  ranged = bs.range_plan(spec, qi, ki, block_q=bq, block_kv=bk, q_len=t, kv_len=s)
  live = np.asarray(exact.block_class)[0, 0] > bs.EMPTY  # [nq, nk]
  count = np.asarray(ranged.kv_count)[0, 0]
  index = np.asarray(ranged.kv_index)[0, 0]
  for i, row in enumerate(live):
    cols = np.flatnonzero(row)
    want = np.arange(cols[0], cols[-1] + 1) if cols.size else np.arange(0)
    np.testing.assert_array_equal(index[i, :count[i]], want, err_msg=f"q block {i}")
    if cols.size:
      assert np.all(index[i, count[i]:] == cols[-1])
    assert np.all(np.asarray(ranged.kv_class)[0, 0, i, :count[i]] == bs.PARTIAL)
  assert bool(ranged.any_live) == bool(live.any())
