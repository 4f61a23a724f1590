"""The planner: plans built once ahead of a call, equal to the plans built on device."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st
from jax.sharding import AxisType

from pallas_ring import BlockSizes, SequenceParallelConfig, attention, layouts, masks, plans
from pallas_ring import block_sparse as bs
from pallas_ring import sharded_attention
from pallas_ring.kernels import common
from test_block_sparse import mask_strategy


def _block_fn(q_lo, q_hi, k_lo, k_hi):  # (module level: a Custom mask's block test)
  return k_lo <= q_hi + 3, k_hi <= q_lo - 5


def _fn(q, k):
  return (k <= q + 3) & (k >= q - 40)


def _ops(q_pos, kv_pos, q_seg=None, kv_seg=None):
  """Operands of a pair with these (padded) positions and segment ids."""
  return common.Operands(bs.TokenInfo(q_pos, q_seg), bs.TokenInfo(kv_pos, kv_seg))


def _assert_same_plan(a, b, what=""):
  for name, x, y in zip(bs.BlockPlan._fields, a, b):
    assert (x.dtype, x.shape) == (y.dtype, y.shape), name + what
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name + what)


@given(spec=st.one_of(mask_strategy, st.just(masks.Custom(_fn, _block_fn))),
       t=st.sampled_from([1, 13, 32, 40]), s=st.sampled_from([5, 32, 47]),
       bq=st.sampled_from([1, 4, 8]), bk=st.sampled_from([4, 8, 16]))
def test_indexed_plan_is_the_device_plan_in_numpy(spec, t, s, bq, bk):
  """Indexed positions: the planner's plan (numpy, built ahead, read-only) equals the jitted
  plan of the same positions: arrays, dtypes and shapes."""
  tp, sp = -(-t // bq) * bq, -(-s // bk) * bk
  np.testing.assert_array_equal(bs.indexed_positions(t, tp),
                                bs.pad_token_info(bs.make_token_info(t, 1), tp).positions)
  q_pos, kv_pos = bs.indexed_positions(t, tp), bs.indexed_positions(s, sp)
  planner = plans.Planner(spec, t, s, tp, sp, (bq, bk), (bq, bk), plans.Indexed())
  ahead = planner.plan(_ops(q_pos, kv_pos))
  device = jax.jit(lambda a, c: bs.make_plan(spec, bs.TokenInfo(a), bs.TokenInfo(c), block_q=bq,
                                             block_kv=bk, q_len=t, kv_len=s))(
      jnp.asarray(q_pos), jnp.asarray(kv_pos))
  _assert_same_plan(ahead, device)
  built, _ = planner._ahead(bq, bk)
  assert all(isinstance(x, np.ndarray) and not x.flags.writeable for x in built)


def _sorts(f, *args, op="stablehlo.sort"):
  """The sort ops (the device plan's lists), or other ``op``, in ``f``'s lowered program."""
  return jax.jit(f).trace(*args).lower().as_text().count(op)


def test_flash_attention_takes_a_static_plan_as_constants():
  """Default positions, no segment ids: the plan is built ahead (no plan ops in the program,
  forward or backward); explicit positions or segment ids keep the device plan, with segment
  ids only its segment part (fewer reductions). Results are the same either way."""
  t = 256
  q = jax.random.normal(jax.random.key(0), (1, t, 2, 32), jnp.float32)
  seg = (jnp.arange(t) // 100)[None]
  run = lambda q, **kw: attention.flash_attention(q, q, q, mask=masks.Causal(), backend="xla",
                                                  block_sizes=BlockSizes(64, 64, 64, 64),
                                                  **kw)
  grad = lambda **kw: jax.grad(lambda q: run(q, **kw).sum())
  assert _sorts(run, q) == _sorts(grad(), q) == 0
  pos = dict(q_positions=jnp.arange(t), kv_positions=jnp.arange(t))
  assert _sorts(lambda q: run(q, **pos), q) > 0
  docs = lambda q, s, **kw: run(q, segment_ids=s, **kw)
  assert _sorts(docs, q, seg) > 0
  reductions = lambda f: _sorts(f, q, seg, op="stablehlo.reduce")
  assert reductions(docs) < reductions(functools.partial(docs, **pos))
  np.testing.assert_array_equal(jax.jit(docs)(q, seg),
                                jax.jit(functools.partial(docs, **pos))(q, seg))
  np.testing.assert_array_equal(jax.jit(run)(q), jax.jit(lambda q: run(q, **pos))(q))
  np.testing.assert_array_equal(jax.jit(grad())(q), jax.jit(grad(**pos))(q))


def test_limits_send_larger_plans_to_the_device():
  """Past ``Limits.max_tiles`` (one pair) or ``max_pairs`` (a ring) the plan is built on device
  from the operands, and equals the plan built ahead."""
  t, blk, r = 64, 8, 4
  pos = jnp.asarray(bs.indexed_positions(t, t))
  planner = lambda *a, **kw: plans.Planner(masks.Causal(), t, t, t, t, (blk, blk), (blk, blk),
                                           *a, limits=plans.Limits(**kw))
  ahead = planner(plans.Indexed())
  tight = planner(plans.Indexed(), max_tiles=(t // blk) ** 2 - 1)
  plan = lambda p: jax.jit(lambda x: p.plan(_ops(x, x)))
  sorts = lambda p: plan(p).trace(pos).lower().as_text().count("stablehlo.sort")
  assert sorts(ahead) == 0 and sorts(tight) > 0
  _assert_same_plan(plan(ahead)(pos), plan(tight)(pos))
  ring = plans.RingLayout(r * t, "zigzag", r, False)
  zig = lambda rank: bs.TokenInfo(layouts.positions(r * t, "zigzag", r, rank)[None])
  ring_ops = common.Operands(zig(1), zig(2))
  few_pairs = planner(ring, max_pairs=r * r - 1)
  assert few_pairs.plan(ring_ops, rank=1, src=2) is not None and few_pairs._ahead(blk, blk) is None
  _assert_same_plan(planner(ring).plan(ring_ops, rank=1, src=2),
                    few_pairs.plan(ring_ops, rank=1, src=2))


def test_one_planner_builds_each_plan_once(monkeypatch):
  """A ring's forward and backward (same tiles) share the plans its planner built once."""
  calls = []
  table = bs.plan_table
  monkeypatch.setattr(bs, "plan_table", lambda *a, **kw: calls.append(1) or table(*a, **kw))
  mesh = jax.make_mesh((4,), ("sp",), axis_types=(AxisType.Auto,))
  cfg = SequenceParallelConfig(axis_name="sp", backend="xla",
                               block_sizes=dict(block_q=8, block_kv=8, block_q_bwd=8,
                                                block_kv_bwd=8))
  q = jax.random.normal(jax.random.key(1), (1, 64, 2, 16), jnp.float32)
  loss = lambda q: sharded_attention(q, q, q, mask=masks.Causal(), mesh=mesh, config=cfg).sum()
  jax.jit(jax.grad(loss)).trace(q)
  assert len(calls) == 1


@pytest.mark.parametrize("layout", layouts.LAYOUTS)
@pytest.mark.parametrize("mask", [masks.Full(), masks.Causal(), masks.SlidingWindow(13, 4),
                                  masks.ChunkedCausal(12) | masks.PrefixLM(20)],
                         ids=["full", "causal", "window", "chunked-prefix"])
def test_ring_plans_are_the_device_plans_of_each_pair(layout, mask):
  """Every (rank, source) pair's plan selected from those a ring's planner built ahead equals the
  plan built on device from the two shards' positions (shards of 18 tokens in tiles of 8:
  padded); each distinct plan is stored once (a full mask over unpadded shards: one plan, as
  constants)."""
  r, t, blk = 4, 18, 8
  tp = 24
  planner = plans.Planner(mask, t, t, tp, tp, (blk, blk), (blk, blk),
                          plans.RingLayout(r * t, layout, r, False))
  info = lambda rank: bs.pad_token_info(
      bs.make_token_info(t, 1, layouts.positions(r * t, layout, r, rank)), tp)
  ops = lambda i, j: common.Operands(info(i), info(j))
  select = jax.jit(lambda i, j: planner.plan(ops(i, j), rank=i, src=j))
  device = jax.jit(lambda i, j: bs.make_plan(mask, info(i), info(j), block_q=blk, block_kv=blk,
                                             q_len=t, kv_len=t))
  for i in range(r):
    for j in range(r):
      _assert_same_plan(select(i, j), device(i, j), f" of pair ({i}, {j})")
  stored, table = planner._ahead(blk, blk)
  assert table.shape == (r, r) and stored.block_class.shape[0] == len(np.unique(table))
  one = plans.Planner(masks.Full(), 16, 16, 16, 16, (blk, blk), (blk, blk),
                      plans.RingLayout(64, "zigzag", r, False))
  zig = lambda rank: bs.make_token_info(16, 1, layouts.positions(64, "zigzag", r, rank))
  assert isinstance(one.plan(common.Operands(zig(0), zig(0))).kv_count, jax.Array)
  assert one._ahead(blk, blk)[0].block_class.shape[0] == 1
