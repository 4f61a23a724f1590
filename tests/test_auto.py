"""strategy="auto": the cost model's choices and an auto call on 8 CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from pallas_ring import SequenceParallelConfig, auto, masks, reference, sharded_attention
from pallas_ring.halo import RingVariants
from conftest import rel_err

MHA = dict(heads=16, kv_heads=16, head_dim=128, ring_size=8, itemsize=2)
MHA4 = dict(MHA, ring_size=4)  # the 4-GPU cases the defaults are fitted to (BENCHMARKS.md)


@pytest.mark.ci_cases(every=True)
@pytest.mark.parametrize("mask, per_device, layout, kw, expected", [
    (masks.SlidingWindow(1024), 32768, "zigzag", MHA4, "ring"),  # short halos, overlapped
    (masks.ChunkedCausal(8192), 32768, "zigzag", MHA4, "ring"),  # a neighbour's chunk only
    (masks.Causal(), 32768, "zigzag", MHA4, "ring"),  # compute hides the whole ring
    (masks.Full(), 32768, "zigzag", MHA4, "ulysses"),  # the ring's kernels' slowdown shows
    (masks.Causal(), 32768, "contiguous", dict(MHA4, segmented=True), "ulysses"),  # a pack
    (masks.Causal(), 1024, "zigzag", MHA, "ulysses"),  # short: the ring's sends are exposed
    (masks.Causal(), 1024, "zigzag", dict(MHA, heads=4, kv_heads=4), "all_gather"),  # N % R
])
def test_auto_choices(mask, per_device, layout, kw, expected):
  choice = auto.choose(mask, seq_len=kw["ring_size"] * per_device, layout=layout, **kw)
  assert choice.strategy == expected, choice.describe()
  assert f"chose {expected!r}" in choice.describe()
  assert len(choice.seconds) == (3 if kw["heads"] == 16 else 2)


def test_caller_positions_keep_the_whole_ring_in_the_model():
  local = auto.choose(masks.SlidingWindow(64), seq_len=8 * 1024, layout="contiguous", **MHA)
  given = auto.choose(masks.SlidingWindow(64), seq_len=8 * 1024, layout="contiguous",
                      derived_positions=False, **MHA)
  assert local.reach == (1, 0) and given.reach == (7, 0)


def test_halo_shrinks_the_modelled_ring():
  """A narrow window's ring sends a slice per hop (halo.share): less modelled time than whole
  shards, and the ring wins where whole shards would have lost to all_gather."""
  kw = dict(MHA, heads=2, kv_heads=2, ring_size=2)
  args = (masks.SlidingWindow(16),)
  halo = auto.choose(*args, seq_len=2 * 32768, layout="contiguous", **kw)
  whole = auto.choose(*args, seq_len=2 * 32768, layout="contiguous",
                      variants=RingVariants(halo=False), **kw)
  assert dict(halo.seconds)["ring"] < dict(whole.seconds)["ring"]
  assert halo.strategy == "ring" and whole.strategy != "ring", whole.describe()


def test_auto_runs_its_choice_and_matches_the_reference():
  mesh = jax.make_mesh((8,), ("sp",), axis_types=(AxisType.Auto,))
  cfg = SequenceParallelConfig(axis_name="sp", strategy="auto", backend="xla")
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal((1, 64, 8, 16)), jnp.float32) for _ in range(3))
  mask = masks.Causal()
  f = lambda *a: sharded_attention(*a, mesh=mesh, config=cfg, mask=mask)
  choice = auto.choose(mask, seq_len=64, heads=8, kv_heads=8, head_dim=16, ring_size=8,
                       layout="contiguous", itemsize=4)
  text = str(jax.make_jaxpr(f)(q, k, v))
  ran = "ulysses" if "all_to_all" in text else "all_gather" if "all_gather" in text else "ring"
  assert ran == choice.strategy
  assert rel_err(jax.jit(f)(q, k, v), reference.attention(q, k, v, mask=mask)[0]) < 2e-5


def test_the_cost_model_rates_decide():
  """A causal 32k-per-device ring hides its sends at the default rates; with a link 100x slower
  the model exposes them and another strategy wins."""
  kw = dict(MHA4, seq_len=4 * 32768, layout="zigzag")
  assert auto.choose(masks.Causal(), **kw).strategy == "ring"
  slow = auto.choose(masks.Causal(), model=auto.CostModel(bytes_per_s=1e9), **kw)
  assert slow.strategy != "ring", slow.describe()


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
@pytest.mark.parametrize("packed", [None, "segment_ids", "cu_seqlens"])
def test_packs_reach_the_model(packed, axis_type):
  """sharded_attention tells the model about packs: a causal 32k-per-device call on 4 devices
  runs the ring, the same call with segment ids or cu_seqlens runs Ulysses (traced only), on
  Auto and on Explicit (jax.make_mesh's default) axes."""
  mesh = jax.make_mesh((4,), ("sp",), axis_types=(axis_type,), devices=jax.devices()[:4])
  cfg = SequenceParallelConfig(axis_name="sp", strategy="auto", backend="xla")
  t = 4 * 32768
  qkv = [jax.ShapeDtypeStruct((1, t, 16, 128), jnp.bfloat16)] * 3
  kw = {}
  if packed == "segment_ids":
    kw["segment_ids"] = jnp.zeros((1, t), jnp.int32)
  elif packed == "cu_seqlens":
    kw["cu_seqlens"] = jnp.asarray([0, t // 3, t], jnp.int32)
  f = lambda q, k, v: sharded_attention(q, k, v, mesh=mesh, config=cfg, mask=masks.Causal(),
                                        **kw)
  with jax.set_mesh(mesh):
    text = str(jax.make_jaxpr(f)(*qkv))
  assert ("all_to_all" in text) == bool(packed) and ("ppermute" in text) != bool(packed)
