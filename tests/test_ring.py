"""Ring and all-gather sequence parallelism on 8 / 4 virtual CPU devices against the reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from pallas_ring import BlockSizes, SequenceParallelConfig, layouts, masks, reference
from pallas_ring import ring_attention, sharded_attention
from pallas_ring.halo import RingVariants
from conftest import check_ring_step, kernel_call_sites, rel_err

MASKS = {
    "causal": (masks.Causal(), False),
    "window": (masks.SlidingWindow(13), False),
    "documents": (masks.Causal(), True),
    "full": (masks.Full(), False),
}


def _problem(seed, b=2, t=64, n=4, kh=2, h=32, docs=False):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((b, t, kh, h)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((b, t, kh, h)), jnp.float32)
  seg = None
  if docs:
    seg = jnp.asarray(np.sort(rng.integers(0, 5, (b, t)), axis=1), jnp.int32)
  return q, k, v, seg


def _check(mesh, cfg, mask, q, k, v, seg, sinks=None, softcap=None, interpret=None, tol=2e-5):
  r = mesh.shape[cfg.axis_name]
  perm = lambda x: None if x is None else layouts.permute(x, cfg.layout, r)
  unperm = lambda x: layouts.unpermute(x, cfg.layout, r)

  def ours(q_, k_, v_, sk):
    out = sharded_attention(perm(q_), perm(k_), perm(v_), mesh=mesh, config=cfg, mask=mask,
                            segment_ids=perm(seg), sinks=sk, softcap=softcap, interpret=interpret)
    return unperm(out)

  def ref(q_, k_, v_, sk):
    return reference.attention(q_, k_, v_, mask=mask, segment_ids=seg, sinks=sk, softcap=softcap)[0]

  w = jnp.cos(jnp.arange(q.shape[-1], dtype=jnp.float32))
  loss = lambda fn: lambda *a: jnp.sum(fn(*a) * w)
  args = (q, k, v, sinks)
  argnums = (0, 1, 2, 3) if sinks is not None else (0, 1, 2)
  out = jax.jit(ours)(*args)
  assert rel_err(out, ref(*args)) < tol
  g1 = jax.jit(jax.grad(loss(ours), argnums=argnums))(*args)
  g2 = jax.grad(loss(ref), argnums=argnums)(*args)
  for name, a, b_ in zip("qkvs", g1, g2):
    assert np.all(np.isfinite(np.asarray(a))), name
    assert rel_err(a, b_) < tol, (name, rel_err(a, b_))


@pytest.mark.ci_cases("contiguous-causal-ring", "zigzag-documents-ring", "striped-window-ring",
                      "zigzag-full-all_gather")
@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("layout", layouts.LAYOUTS)
def test_sharded_8_devices(layout, mask_name, strategy):
  mask, docs = MASKS[mask_name]
  mesh = jax.make_mesh((2, 4), ("dp", "sp"))
  cfg = SequenceParallelConfig(axis_name="sp", layout=layout, strategy=strategy,
                               batch_axes=("dp",), backend="xla")
  _check(mesh, cfg, mask, *_problem(1, docs=docs))


@pytest.mark.parametrize("forward_received", [True, False])
def test_packed_sends_forwarded_as_received(monkeypatch, forward_received):
  """The GPU rings' packed sends (``RingStatic.pack_sends``) on CPU: each forward step sends on
  the buffer it received (``RingVariants.forward_received``: the forward packs once, before its
  scan) or packs its K/V again (also in the scan's body); with documents, whose segment ids
  travel in the buffer too. Output and gradients as the reference."""
  from pallas_ring import ring, sends
  packed = lambda *a, **kw: ring_static(*a, **{**kw, "pack_sends": True})
  ring_static, pack_buffers, packs = ring.RingStatic, sends.pack_buffers, []
  monkeypatch.setattr(ring, "RingStatic", packed)
  monkeypatch.setattr(sends, "pack_buffers", lambda x: packs.append(len(x)) or pack_buffers(x))
  mesh = jax.make_mesh((4,), ("sp",), axis_types=(AxisType.Auto,))
  cfg = SequenceParallelConfig(axis_name="sp", layout="zigzag", backend="xla",
                               ring_variants=RingVariants(forward_received=forward_received))
  q, k, v, seg = _problem(6, docs=True)
  jax.make_jaxpr(lambda *x: sharded_attention(*x, mesh=mesh, config=cfg, mask=masks.Causal(),
                                              segment_ids=seg))(q, k, v)
  assert packs == ([3] if forward_received else [3, 3])  # (K, V and segment ids)
  _check(mesh, cfg, masks.Causal(), q, k, v, seg)


@pytest.mark.ci_cases(every=True)
@pytest.mark.parametrize("layout, mask", [
    ("zigzag", masks.Causal()), ("contiguous", masks.Causal() & masks.SlidingWindow(6))])
def test_whole_local_pair_gives_the_same_gradients(layout, mask, monkeypatch):
  """``RingVariants(whole_local_pair=True)``: the local pair's backward in one call at the first
  step (no dQ-only or dK/dV-only call), its dK/dV added to the other devices' once those come
  home (with a window: beside a halo's slice, added at its runs). Output and gradients as the
  reference's, and with a bias (its gradient computed once) as the two halves'."""
  import inspect
  from pallas_ring import ring
  from pallas_ring.kernels import common
  calls, pair_backward = [], ring.pair_backward
  monkeypatch.setattr(ring, "pair_backward", lambda *a, **kw: calls.append(
      inspect.signature(pair_backward).bind(*a, **kw).arguments.get("parts", common.BOTH))
      or pair_backward(*a, **kw))
  mesh = jax.make_mesh((4,), ("sp",), axis_types=(AxisType.Auto,))
  config = lambda whole: SequenceParallelConfig(
      axis_name="sp", layout=layout, backend="xla",
      ring_variants=RingVariants(whole_local_pair=whole, gather_halos=False))
  q, k, v, seg = _problem(7, docs=True)
  _check(mesh, config(True), mask, q, k, v, seg)
  bias = jnp.asarray(np.random.default_rng(8).standard_normal((1, 1, 64, 64)), jnp.float32)

  def grads(whole):
    calls.clear()
    loss = lambda *a: jnp.sum(sharded_attention(*a[:3], mesh=mesh, config=config(whole),
                                                mask=mask, segment_ids=seg, bias=a[3]))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, bias), set(calls)

  (whole, parts), (halves, halves_parts) = grads(True), grads(False)
  assert parts == {common.BOTH} and {common.DQ, common.DKV} <= halves_parts
  for a, b in zip(whole, halves):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layout", layouts.LAYOUTS)
def test_ring_of_8_with_sinks_softcap_and_odd_shards(layout):
  # T=72 over 8 ranks: 9 tokens a shard (zigzag: two chunks of 4.5 -> use 80 there).
  t = 80 if layout == "zigzag" else 72
  mesh = jax.make_mesh((8,), ("sp",), axis_types=(AxisType.Auto,))
  cfg = SequenceParallelConfig(axis_name="sp", layout=layout, backend="xla",
                               block_sizes={"block_q": 4, "block_kv": 4, "block_q_bwd": 4,
                                            "block_kv_bwd": 4})
  q, k, v, seg = _problem(2, b=1, t=t, docs=True)
  sinks = jnp.asarray(np.random.default_rng(3).standard_normal(4), jnp.float32)
  _check(mesh, cfg, masks.Causal() | masks.PrefixLM(7), q, k, v, seg, sinks=sinks, softcap=5.0)


@pytest.mark.ci_cases(every=True)
@pytest.mark.parametrize("backend", ["pallas_triton", "pallas_tpu"])
def test_pallas_backends_in_ring(backend):
  mesh = jax.make_mesh((4,), ("sp",))
  cfg = SequenceParallelConfig(axis_name="sp", layout="zigzag", backend=backend)
  t = 512 if backend == "pallas_tpu" else 128
  q, k, v, seg = _problem(4, b=1, t=t, n=2, kh=1, h=64, docs=True)
  _check(mesh, cfg, masks.Causal(), q, k, v, seg, interpret=True, tol=2e-3)


@pytest.mark.ci_cases("pallas_triton-case0", "pallas_tpu-case2")
@pytest.mark.parametrize("backend, case", [
    ("pallas_triton", (masks.Causal(), 200, 200, 4, 2, 64, jnp.bfloat16, True, None)),
    ("pallas_triton", (masks.Full(), 130, 96, 2, 1, 64, jnp.float32, False, 20.0)),
    ("pallas_tpu", (masks.Causal(), 256, 256, 2, 2, 128, jnp.float32, True, None)),
    ("xla", (masks.Causal(), 100, 60, 2, 1, 32, jnp.float32, True, 20.0)),
])
def test_ring_step_merges_into_the_running_results(backend, case):
  """A ring step's kernels given the running (o, lse) and dq (Triton's dQ kernel adds dq
  itself; the rest merges after the kernels) equal ``common.merge`` and an add after the plain
  calls."""
  check_ring_step(case, backend, interpret=True)


def test_gpu_schedule_ring_of_two_with_caller_positions():
  """The Triton schedule (no cond, one packed send of K/V, positions, segment ids and dK/dV) on a
  ring of two, whose scan has no middle step, with caller positions that must rotate."""
  mesh = jax.make_mesh((2,), ("sp",), axis_types=(AxisType.Auto,))
  cfg = SequenceParallelConfig(axis_name="sp", backend="pallas_triton")
  q, k, v, seg = _problem(10, b=1, t=64, n=2, kh=1, h=64, docs=True)
  pos = jnp.asarray(np.random.default_rng(3).permutation(64) + 500, jnp.int32)
  mask = masks.SlidingWindow(20)
  f = lambda q_, k_, v_: sharded_attention(q_, k_, v_, mesh=mesh, config=cfg, mask=mask,
                                           segment_ids=seg, positions=pos, interpret=True)
  ref = lambda q_, k_, v_: reference.attention(q_, k_, v_, mask=mask, segment_ids=seg,
                                               q_positions=pos, kv_positions=pos)[0]
  assert rel_err(jax.jit(f)(q, k, v), ref(q, k, v)) < 2e-3
  loss = lambda fn: lambda *a: jnp.sum(fn(*a) * jnp.cos(jnp.arange(64.0)))
  g1 = jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)))(q, k, v)
  g2 = jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v)
  for name, a, b_ in zip("qkv", g1, g2):
    assert rel_err(a, b_) < 2e-3, (name, rel_err(a, b_))


@pytest.mark.ci_cases(every=True)
@pytest.mark.parametrize("shapes, word", [
    ((((4, 6), jnp.bfloat16), ((3,), jnp.float32), ((5,), jnp.int32)), jnp.uint32),
    ((((3, 5), jnp.bfloat16), ((2,), jnp.float32)), jnp.uint16),  # 30 bytes
    ((((3,), jnp.int8), ((2,), jnp.bfloat16)), jnp.uint8),
])
def test_packed_sends_round_trip_in_the_widest_word(shapes, word):
  """GPU rings send each step's arrays as one buffer of the widest word their byte sizes allow
  (XLA:GPU copies 4-byte words faster than bytes), and unpack them bit for bit."""
  from pallas_ring import sends
  rng = np.random.default_rng(4)
  arrays = [jnp.asarray(rng.standard_normal(shape) * 100, dtype) for shape, dtype in shapes]
  buf = jax.jit(sends.pack_buffers)(arrays)
  assert buf.dtype == word and buf.size * word(0).itemsize == sum(x.nbytes for x in arrays)
  for got, want in zip(sends.unpack_buffers(buf, arrays), arrays):
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_heads_over_a_tensor_axis_and_checkpoint():
  mesh = jax.make_mesh((2, 4), ("tp", "sp"), axis_types=(AxisType.Auto,) * 2)
  cfg = SequenceParallelConfig(axis_name="sp", layout="zigzag", head_axis="tp", backend="xla")
  q, k, v, seg = _problem(5, b=1, docs=True)
  perm = lambda x: layouts.permute(x, "zigzag", 4)
  f = jax.checkpoint(lambda q_, k_, v_: sharded_attention(
      q_, k_, v_, mesh=mesh, config=cfg, mask=masks.Causal(), segment_ids=perm(seg)))
  out = layouts.unpermute(jax.jit(f)(perm(q), perm(k), perm(v)), "zigzag", 4)
  assert rel_err(out, reference.attention(q, k, v, mask=masks.Causal(), segment_ids=seg)[0]) < 2e-5
  g = jax.jit(jax.grad(lambda x: jnp.sum(f(x, perm(k), perm(v)) ** 2)))(perm(q))
  g_ref = jax.grad(lambda x: jnp.sum(reference.attention(
      x, k, v, mask=masks.Causal(), segment_ids=seg)[0] ** 2))(q)
  assert rel_err(layouts.unpermute(g, "zigzag", 4), g_ref) < 2e-5


def test_segment_ids_split_across_shards_rotate_with_kv():
  """One document spans shards 0-2: replicating shard-local ids would be wrong (PRIOR_ART)."""
  mesh = jax.make_mesh((4,), ("sp",), axis_types=(AxisType.Auto,))
  t = 32
  seg = jnp.asarray([[0] * 5 + [1] * 20 + [2] * 7], jnp.int32)  # doc 1 crosses 3 shards
  q, k, v, _ = _problem(6, b=1, t=t)
  cfg = SequenceParallelConfig(axis_name="sp", backend="xla")
  out = jax.jit(lambda *a: sharded_attention(*a, mesh=mesh, config=cfg, mask=masks.Causal(),
                                              segment_ids=seg))(q, k, v)
  ref = reference.attention(q, k, v, mask=masks.Causal(), segment_ids=seg)[0]
  assert rel_err(out, ref) < 2e-5
  # What a ring that compares every kv shard against the *local* segment ids would compute:
  wrong = reference.attention(q, k, v, mask=masks.Causal(),
                              segment_ids=seg, kv_segment_ids=jnp.roll(seg, 8, axis=1))[0]
  assert rel_err(wrong, ref) > 0.1


def test_empty_steps_and_shards_are_zero_not_nan():
  """Causal + window: most ring steps are empty; a shard whose rows see nothing returns 0."""
  mesh = jax.make_mesh((4,), ("sp",), axis_types=(AxisType.Auto,))
  q, k, v, _ = _problem(7, b=1, t=32)
  pos = jnp.arange(32) + 1000  # positions need not start at 0
  cfg = SequenceParallelConfig(axis_name="sp", backend="xla")
  mask = masks.SlidingWindow(0)  # each token sees only itself
  out = jax.jit(lambda *a: sharded_attention(*a, mesh=mesh, config=cfg, mask=mask,
                                              positions=pos))(q, k, v)
  ref = reference.attention(q, k, v, mask=mask, q_positions=pos, kv_positions=pos)[0]
  assert rel_err(out, ref) < 2e-5
  # Keys entirely in the future of every query on every shard: all rows empty.
  mask2 = masks.Custom(lambda a, b: b > a + 100)
  out2, lse2 = jax.jit(lambda *a: sharded_attention(*a, mesh=mesh, config=cfg, mask=mask2,
                                                     return_lse=True))(q, k, v)
  assert np.all(np.asarray(out2) == 0) and np.all(np.isneginf(np.asarray(lse2)))
  g = jax.jit(jax.grad(lambda x: jnp.sum(sharded_attention(x, k, v, mesh=mesh, config=cfg,
                                                           mask=mask2))))(q)
  assert np.all(np.asarray(g) == 0)


@pytest.mark.ci_cases("pallas_tpu-tpu-tpu_custom_call-2",
                      "pallas_triton-cuda-__gpu$xla.gpu.triton-2",
                      "pallas_mosaic_gpu-cuda-@mosaic_gpu-2")
@pytest.mark.xdist_group("libtpu")
@pytest.mark.parametrize("ring", [2, 4])
@pytest.mark.parametrize("backend,platform,marker", [
    ("pallas_tpu", "tpu", "tpu_custom_call"),
    ("pallas_triton", "cuda", "__gpu$xla.gpu.triton"),
    ("pallas_mosaic_gpu", "cuda", "@mosaic_gpu")])
def test_ring_backward_runs_each_kernel_once_per_pair(backend, platform, marker, ring):
  """Forward+backward lowers to one forward kernel and one dQ and one dK/dV kernel per (q shard,
  kv shard) pair: the local pair's backward in two halves (its dQ kernel at the first step, its
  dK/dV kernel after the last), each without the other's kernel; on Mosaic GPU one fused
  backward kernel per pair, the local one whole by the rule (``RingVariants.whole_local_pair``;
  False: its two halves, the pair's kernels)."""
  from jax.sharding import Mesh, PartitionSpec as P
  from pallas_ring import ring_attention
  mesh = Mesh(jax.devices()[:ring], ("sp",))

  def loss(q, k, v, variants=None, block_sizes=None):
    f = lambda q, k, v: ring_attention(q, k, v, axis_name="sp", mask=masks.Causal(),
                                       layout="zigzag", backend=backend, interpret=False,
                                       ring_variants=variants, block_sizes=block_sizes)
    o = jax.shard_map(f, mesh=mesh, in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp"),
                      check_vma=False)(q, k, v)
    return jnp.sum(o.astype(jnp.float32))

  x = jax.ShapeDtypeStruct((1, 512 * ring, 2, 128), jnp.bfloat16)
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(x, x, x).lower(
      lowering_platforms=(platform,)).as_text()
  # Call sites (a scan body counted once). Forward: the first step, (R=4: a scan body), the
  # last. Backward: the local dQ and dK/dV (Mosaic GPU: one fused kernel); dQ and dK/dV (Mosaic
  # GPU: one fused kernel) of step 1, (R=4: a scan body, the last step).
  from pallas_ring.kernels.pallas_mosaic_gpu import Variants, tiles
  fused = backend == "pallas_mosaic_gpu" and tiles.fused_backward(Variants(), 128, 512)
  steps, forwards = (1, 2) if ring == 2 else (3, 3)
  assert kernel_call_sites(text, marker) == forwards + (1 + steps) * (1 if fused else 2)
  if backend == "pallas_mosaic_gpu" and ring == 2:  # the local pair in halves: two kernels
    halves = functools.partial(loss, variants=RingVariants(whole_local_pair=False),
                               block_sizes=BlockSizes(variants=Variants(deterministic=False)))
    text = jax.jit(jax.grad(halves, argnums=(0, 1, 2))).trace(x, x, x).lower(
        lowering_platforms=(platform,)).as_text()
    assert kernel_call_sites(text, marker) == forwards + 2 + steps


def test_ring_jaxpr_has_ppermute_in_scan_and_no_repeated_kv():
  mesh = jax.make_mesh((4,), ("sp",), axis_types=(AxisType.Auto,))
  cfg = SequenceParallelConfig(axis_name="sp", backend="xla")
  q, k, v, _ = _problem(8, b=1, t=64)
  f = lambda q_, k_, v_: sharded_attention(q_, k_, v_, mesh=mesh, config=cfg, mask=masks.Causal())
  text = str(jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(f(*a)), argnums=(0, 1, 2)))(q, k, v))
  scans = text.split("scan[")
  assert len(scans) >= 3  # forward scan and backward scan
  assert any("ppermute" in s for s in scans[1:])


def test_ring_of_one_calls_flash_attention():
  mesh = jax.make_mesh((1,), ("sp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
  cfg = SequenceParallelConfig(axis_name="sp", layout="zigzag", backend="xla")
  q, k, v, seg = _problem(9, b=1, t=24, docs=True)
  out = jax.jit(lambda *a: sharded_attention(*a, mesh=mesh, config=cfg, mask=masks.Causal(),
                                              segment_ids=seg))(q, k, v)
  assert rel_err(out, reference.attention(q, k, v, mask=masks.Causal(), segment_ids=seg)[0]) < 2e-5


@pytest.mark.xdist_group("libtpu")
def test_ring_compiles_for_tpu_v5e_8_and_overlaps_permutes():
  """Compile the ring (forward + backward) for a v5e 2x4 slice through libtpu; the schedule
  brackets the kernels with collective-permute-start / -done."""
  from pallas_ring.aot import compile_ring, overlaps_kernels
  rep = compile_ring("v5e:2x4", SequenceParallelConfig(axis_name="sp", layout="zigzag"),
                     seq_len=8 * 1024, heads=4, kv_heads=2)
  assert rep.num_devices == 8 and rep.device_kind.startswith("TPU v5")
  assert rep.kernels >= 3 and rep.permutes_overlap_kernels
  assert rep.temp_bytes > 0 and rep.argument_bytes > 0
  # The overlap detector itself: a start ... kernel ... done sequence, and not without one.
  kernel = 'b = custom-call(y), custom_call_target="tpu_custom_call"'
  assert overlaps_kernels(f"a = collective-permute-start(x)\n{kernel}\n"
                          "c = collective-permute-done(a)")
  assert not overlaps_kernels(f"a = collective-permute-start(x)\nc = collective-permute-done(a)"
                              f"\n{kernel}")


def test_eager_sharded_attention_compiles_once():
  from pallas_ring import sharded
  mesh = jax.make_mesh((4,), ("sp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
  cfg = SequenceParallelConfig(axis_name="sp", backend="xla")
  q, k, v, _ = _problem(21, b=1, t=32)
  before = sharded._run._cache_size()
  a = sharded_attention(q, k, v, mesh=mesh, config=cfg, mask=masks.Causal())
  b = sharded_attention(q + 1, k, v, mesh=mesh, config=cfg, mask=masks.Causal())
  assert sharded._run._cache_size() == before + 1  # the second eager call reuses the program
  assert rel_err(a, reference.attention(q, k, v, mask=masks.Causal())[0]) < 1e-5
  assert not np.allclose(a, b)


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
@pytest.mark.parametrize("layout", layouts.LAYOUTS)
def test_plans_of_layout_positions_are_built_ahead(layout, strategy):
  """Derived positions, no segment ids: the ring selects each step's plan from those built while
  tracing (its lowered forward+backward holds no sort, the device plan's lists); the same
  positions given by the caller keep the device plan, with the same results."""
  mesh = jax.make_mesh((4,), ("sp",), axis_types=(AxisType.Auto,))
  cfg = SequenceParallelConfig(axis_name="sp", layout=layout, strategy=strategy, backend="xla",
                               block_sizes={"block_q": 8, "block_kv": 8, "block_q_bwd": 8,
                                            "block_kv_bwd": 8})
  q, k, v, _ = _problem(11, b=1, t=80)
  pos = layouts.positions(80, layout, 4)  # [T] in layout order: what the ring derives
  mask = masks.ChunkedCausal(24) | masks.PrefixLM(5)

  def grads(**kw):
    f = lambda *a: sharded_attention(*a, mesh=mesh, config=cfg, mask=mask, **kw)
    return jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=(0, 1, 2))

  sorts = lambda fn: jax.jit(fn).trace(q, k, v).lower().as_text().count("stablehlo.sort")
  assert sorts(grads()) == 0
  assert sorts(grads(positions=pos)) > 0
  for a, b_ in zip(jax.jit(grads())(q, k, v), jax.jit(grads(positions=pos))(q, k, v)):
    assert rel_err(a, b_) < 1e-6  # (two programs: XLA may fuse their float math differently)




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
  # Residuals of the vjp are the local q, k, v, lse, positions: every one is at most two
  # [R=4, T/R=16, heads, H] stacks of shards, never R ring steps of K/V per device.
  res = [v.aval for v in closed.jaxpr.outvars[1:]]
  assert all(np.prod(a.shape) <= 2 * 4 * 16 * 2 * 32 for a in res if hasattr(a, "shape"))
  # K and V travel as a pair of bf16 shards [1, T/R=16, heads, H] (no stacked copy, no upcast).
  permutes = [line for line in text.splitlines() if "ppermute" in line]
  shard_sends = [line for line in permutes if "[1,16,2,32]" in line]
  assert shard_sends and all("bf16[1,16,2,32]" in line for line in shard_sends)
  assert not any("[2,1,16,2,32]" in line for line in permutes)


def test_default_mesh_axis_types_readme_pattern():
  """``jax.make_mesh``'s default Explicit axes: under ``jax.set_mesh`` (the README's pattern)
  eager ``jax.grad`` of sharded_attention and of a user's own shard_map over ring_attention
  work and equal the jitted gradient; eager grad without it raises ours, naming the fix."""
  from jax.sharding import PartitionSpec as P
  mesh = jax.make_mesh((4,), ("sp",))
  cfg = SequenceParallelConfig(axis_name="sp", layout="zigzag", backend="xla")
  q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 64, 2, 32)), jnp.float32)
  loss = lambda x: jnp.sum(sharded_attention(x, x, x, mesh=mesh, config=cfg,
                                             mask=masks.Causal()) ** 2)
  want = jax.jit(jax.grad(loss))(q)
  with pytest.raises(ValueError, match=r"jax.set_mesh\(mesh\)"):
    jax.grad(loss)(q)
  own = jax.shard_map(lambda x: ring_attention(x, x, x, axis_name="sp", layout="zigzag",
                                               mask=masks.Causal(), backend="xla"),
                      mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"),
                      check_vma=False)
  with jax.set_mesh(mesh):
    assert rel_err(jax.grad(loss)(q), want) < 1e-6
    qs = jax.device_put(q, jax.sharding.NamedSharding(mesh, P(None, "sp")))  # (shard_map's rule)
    assert rel_err(jax.grad(lambda x: jnp.sum(own(x) ** 2))(qs), want) < 1e-5


def test_jitted_grad_through_unpermute_on_an_explicit_mesh():
  """A jitted loss in natural order, ``layouts.unpermute`` (or a ``Placement``'s) of
  ``sharded_attention``'s output, differentiates on an Explicit mesh under ``jax.set_mesh``
  (the gather given ``out_sharding`` failed to transpose: scatter-add's mesh) and equals the
  reference's gradient; the output keeps its sharding."""
  mesh = jax.make_mesh((2,), ("sp",), devices=jax.devices()[:2])
  q = jnp.asarray(np.random.default_rng(1).standard_normal((1, 64, 2, 16)), jnp.float32)
  seg = np.repeat(np.arange(3), [40, 20, 4])[None].astype(np.int32)
  placed = layouts.balance(seg, 2)
  orders = {"zigzag": (lambda x: layouts.permute(x, "zigzag", 2),
                       lambda x: layouts.unpermute(x, "zigzag", 2), {}, None),
            "placement": (placed.permute, placed.unpermute,
                          dict(segment_ids=placed.permute(seg), positions=placed.positions), seg)}
  for layout, (perm, unperm, extra, ids) in orders.items():
    cfg = SequenceParallelConfig(axis_name="sp", backend="xla",
                                 layout="contiguous" if ids is not None else layout)
    out = lambda x: unperm(sharded_attention(perm(x), perm(x), perm(x), mesh=mesh, config=cfg,
                                             mask=masks.Causal(), **extra))
    ref = lambda x: reference.attention(x, x, x, mask=masks.Causal(), segment_ids=ids)[0]
    with jax.set_mesh(mesh):
      got = jax.grad(jax.jit(lambda x: jnp.sum(out(x) ** 2)))(q)
      assert jax.typeof(jax.jit(out)(q)).sharding.spec[1] == "sp"
    want = jax.grad(lambda x: jnp.sum(ref(x) ** 2))(q)
    assert rel_err(got, want) < 1e-5, layout


def _every_third(q, k):
  return (k <= q) & ((q - k) % 3 != 1)


def _every_third_blocks(q_lo, q_hi, k_lo, k_hi):
  return k_lo <= q_hi, jnp.zeros_like(k_lo <= q_hi)  # (jnp on the host's bounds)


def test_a_custom_block_fn_using_jnp_under_the_readme_mesh():
  """A ``Custom`` mask's ``block_fn`` calling jnp runs on the plan's bounds inside the ring's
  shard_map; under ``jax.set_mesh`` of an Explicit mesh that raised a bare AssertionError."""
  mask = masks.Custom(_every_third, _every_third_blocks)
  mesh = jax.make_mesh((8,), ("sp",))
  cfg = SequenceParallelConfig(axis_name="sp", backend="xla")
  q, k, v = _problem(21, b=1, t=128)[:3]
  with jax.set_mesh(mesh):
    out = sharded_attention(q, k, v, mesh=mesh, config=cfg, mask=mask)
  assert rel_err(out, reference.attention(q, k, v, mask=mask)[0]) < 1e-5
