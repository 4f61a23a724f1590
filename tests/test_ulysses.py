"""Ulysses (all-to-all) sequence parallelism on 4 / 8 virtual CPU devices against the reference
and against the ring."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from pallas_ring import SequenceParallelConfig, layouts, masks, reference, sharded_attention
from conftest import rel_err

R = 4


def _mesh(shape=(R,), names=("sp",)):
  return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


def _problem(seed, b=2, t=64, n=8, kh=2, h=16):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((b, t, kh, h)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((b, t, kh, h)), jnp.float32)
  seg = jnp.asarray(np.sort(rng.integers(0, 4, (b, t)), axis=1), jnp.int32)
  return q, k, v, seg


def _run(f, *args):
  """``(f(*args), gradients of sum(sin(its first output)) by every argument)`` from one compiled
  program (run eagerly, the sharded calls and their gradients dispatch op by op, several times
  slower)."""
  first = lambda out: out[0] if isinstance(out, tuple) else out
  grads = jax.grad(lambda *a: jnp.sum(jnp.sin(first(f(*a)))), argnums=tuple(range(len(args))))
  return jax.jit(lambda *a: (f(*a), grads(*a)))(*args)


def _ulysses(mesh, layout, r=R, **cfg_kw):
  """``f(q, k, v, **kw)`` on naturally ordered arrays: permuted to ``layout``, Ulysses, back."""
  cfg = SequenceParallelConfig(axis_name="sp", layout=layout,
                               **({"strategy": "ulysses", "backend": "xla"} | cfg_kw))
  perm = lambda x: None if x is None else layouts.permute(x, layout, r)

  def f(q, k, v, segment_ids=None, **kw):
    out = sharded_attention(perm(q), perm(k), perm(v), mesh=mesh, config=cfg,
                            segment_ids=perm(segment_ids), **kw)
    if kw.get("return_lse"):
      return layouts.unpermute(out[0], layout, r), layouts.unpermute(out[1], layout, r, axis=2)
    return layouts.unpermute(out, layout, r)

  return f


@pytest.mark.parametrize("layout, kv_heads", [("contiguous", 8), ("zigzag", 2), ("striped", 1)],
                         ids=["contiguous_mha", "zigzag_gqa_fewer_than_devices", "striped_mqa"])
def test_matches_the_reference_forward_and_gradients(layout, kv_heads):
  """Causal with documents, sinks, soft-cap and ALiBi; kv heads repeated just enough when
  fewer than the devices (GQA 8/2 and MQA on 4 devices)."""
  q, k, v, seg = _problem(1, kh=kv_heads)
  kw = dict(mask=masks.Causal(), sinks=jnp.linspace(-1.0, 1.0, 8), softcap=20.0,
            alibi_slopes=jnp.linspace(0.05, 0.4, 8))
  ours = lambda q, k, v: _ulysses(_mesh(), layout)(q, k, v, segment_ids=seg, **kw)
  ref = lambda q, k, v: reference.attention(q, k, v, segment_ids=seg, **kw)[0]
  (out, grads), (out_ref, grads_ref) = _run(ours, q, k, v), _run(ref, q, k, v)
  assert rel_err(out, out_ref) < 2e-6
  for got, want in zip(grads, grads_ref):
    assert rel_err(got, want) < 2e-6


@pytest.mark.ci
def test_dense_mask_bias_dropout_and_lse_equal_the_ring():
  """Per-head bias and a dense mask (heads sharded over the axis), dropout (the same global keep
  mask) and the lse: equal to the ring's, gradients included."""
  q, k, v, _ = _problem(2)
  rng = np.random.default_rng(3)
  bias = jnp.asarray(rng.standard_normal((1, 8, 64, 64)), jnp.float32)
  dense = jnp.asarray(rng.random((2, 1, 64, 64)) > 0.2)
  kw = dict(mask=masks.SlidingWindow(40), bias=bias, dense_mask=dense, dropout_rate=0.2,
            dropout_rng=jax.random.key(4))
  cfg = SequenceParallelConfig(axis_name="sp", layout="zigzag", backend="xla")
  perm = lambda x: layouts.permute(x, "zigzag", R)
  perm2 = lambda x: layouts.permute(layouts.permute(x, "zigzag", R, axis=2), "zigzag", R,
                                    axis=3)  # rows and columns

  def run(strategy):
    c = cfg.replace(strategy=strategy)
    return lambda q, k, v, b: sharded_attention(
        perm(q), perm(k), perm(v), mesh=_mesh(), config=c, return_lse=True,
        **(kw | dict(bias=perm2(b), dense_mask=perm2(dense))))

  (outs, grads), (outs_ring, grads_ring) = (_run(run(s), q, k, v, bias)
                                            for s in ("ulysses", "ring"))
  for a, b_ in zip((*outs, *grads), (*outs_ring, *grads_ring)):  # o, lse, dq, dk, dv, dbias
    assert rel_err(a, b_) < 2e-6


def test_positions_cu_seqlens_and_a_head_axis():
  """Caller positions, packed sequences (cu_seqlens) and a (2 heads x 4 sequence) mesh with the
  batch on neither: the reference's results."""
  q, k, v, _ = _problem(5, b=1)
  mesh = _mesh((2, R), ("tp", "sp"))
  f = _ulysses(mesh, "striped", head_axis="tp")
  cu = jnp.asarray([0, 20, 45, 64], jnp.int32)
  seg = jnp.asarray(np.repeat([0, 1, 2], [20, 25, 19])[None], jnp.int32)
  ref = reference.attention(q, k, v, mask=masks.Causal(), segment_ids=seg)[0]
  assert rel_err(f(q, k, v, mask=masks.Causal(), cu_seqlens=cu), ref) < 2e-6
  pos = layouts.permute(jnp.arange(64) * 3, "striped", R, axis=0)  # (layout order)
  got = f(q, k, v, mask=masks.SlidingWindow(30), positions=pos)
  want = reference.attention(q, k, v, mask=masks.SlidingWindow(30), q_positions=jnp.arange(64) * 3,
                             kv_positions=jnp.arange(64) * 3)[0]
  assert rel_err(got, want) < 2e-6


def test_heads_that_do_not_split_over_the_axis_raise_with_the_fix():
  q, k, v, _ = _problem(6, n=6, kh=2)
  cfg = SequenceParallelConfig(axis_name="sp", strategy="ulysses", backend="xla")
  with pytest.raises(ValueError, match=r"6 query heads over the 4 devices of axis_name='sp'.*strategy='ring'"):
    sharded_attention(q, k, v, mesh=_mesh(), config=cfg)
  from pallas_ring import ring_attention
  with pytest.raises(ValueError, match="run it through sharded_attention"):
    ring_attention(q, k, v, axis_name="sp", strategy="ulysses")


@pytest.mark.xdist_group("libtpu")
def test_compiles_for_a_tpu_slice_with_mosaic_kernels():
  """``python -m pallas_ring compile``'s path for a v5e:2x4 slice: forward and backward compile
  to the Mosaic kernels between all-to-alls."""
  from pallas_ring.aot import compile_ring
  cfg = SequenceParallelConfig(axis_name="sp", strategy="ulysses")
  rep = compile_ring("v5e:2x4", cfg, seq_len=8192, heads=8, kv_heads=2)
  assert rep.num_devices == 8 and rep.kernels == 3  # the forward and the two backward kernels
  # At least q, k, v there and o back (XLA may combine the backward's into tuples).
  assert rep.all_to_alls >= 4


@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_ulysses_ring_matches_the_reference(layout):
  """2-D: all-to-all over ``ulysses_axis`` (2 devices), ring over ``axis_name`` (4 devices); a
  global array in layout order over the ring axis, each ring chunk split contiguously over the
  Ulysses devices. Documents, sinks, ALiBi, MQA (its kv head repeated for the Ulysses
  devices) and the lse; forward and gradients."""
  mesh = _mesh((R, 2), ("sp", "u"))
  q, k, v, seg = _problem(7, kh=1)
  kw = dict(mask=masks.Causal(), sinks=jnp.linspace(-1.0, 1.0, 8),
            alibi_slopes=jnp.linspace(0.05, 0.4, 8))
  ours = lambda q, k, v: _ulysses(mesh, layout, strategy="ulysses_ring", ulysses_axis="u")(
      q, k, v, segment_ids=seg, return_lse=True, **kw)
  ref = lambda q, k, v: reference.attention(q, k, v, segment_ids=seg, **kw)
  (outs, grads), (outs_ref, grads_ref) = _run(ours, q, k, v), _run(ref, q, k, v)
  for got, want in zip((*outs, *grads), (*outs_ref, *grads_ref)):  # (o, lse, dq, dk, dv)
    assert rel_err(got, want) < 2e-6


def test_ulysses_ring_dense_bias_and_positions_equal_the_ring():
  """A per-head bias and a dense mask (rows over the ring axis, heads over the Ulysses axis) and
  caller positions: the 1-D ring's results."""
  q, k, v, _ = _problem(8)
  rng = np.random.default_rng(9)
  bias = jnp.asarray(rng.standard_normal((1, 8, 64, 64)), jnp.float32)
  dense = jnp.asarray(rng.random((1, 8, 64, 64)) > 0.3)
  pos = jnp.arange(64) * 2
  kw = dict(mask=masks.SlidingWindow(50), bias=bias, dense_mask=dense, positions=pos)
  ring_cfg = SequenceParallelConfig(axis_name="sp", layout="contiguous", backend="xla")
  two_d = ring_cfg.replace(strategy="ulysses_ring", ulysses_axis="u")
  ring = sharded_attention(q, k, v, mesh=_mesh((R,)), config=ring_cfg, **kw)
  ours = sharded_attention(q, k, v, mesh=_mesh((R, 2), ("sp", "u")), config=two_d, **kw)
  assert rel_err(ours, ring) < 2e-6


def test_bytes_moved_on_paper():
  """The 2-D scheme is the ring when U = 1 and Ulysses when R = 1; Ulysses moves less than the
  ring when heads are few and shards long; MQA's kv head is repeated to U."""
  from pallas_ring.aot import bytes_moved
  shape = dict(seq_len=1 << 16, heads=8, kv_heads=8, head_dim=128)
  ring = bytes_moved("ring", ring=8, **shape)
  assert ring == bytes_moved("ulysses_ring", ring=8, ulysses=1, **shape)
  assert ring == bytes_moved("all_gather", ring=8, **shape)
  uly = bytes_moved("ulysses", ring=8, **shape)
  assert uly == bytes_moved("ulysses_ring", ring=1, ulysses=8, **shape)
  assert uly[0] < ring[0] and uly[1] < ring[1]
  mqa = bytes_moved("ulysses", ring=8, **(shape | dict(kv_heads=1)))
  assert mqa == uly  # (one kv head repeated to 8 moves what 8 kv heads do)


# The matrix of issue 40: every (mesh and strategy, layout, mask class) triple, with MHA, GQA and
# MQA and with and without segment ids cycling through them (a covering design rather than the
# full product, to keep CI short), on meshes of 8, 4, 2 x 4 (a batch axis) and 4 x 2 devices;
# forward and gradients.
MASK_CLASSES = {"causal": masks.Causal(), "window": masks.SlidingWindow(9),
                "prefix": masks.PrefixLM(12), "full": masks.Full()}
MESHES = {  # name: (shape, axes, config fields)
    "ulysses_8": ((8,), ("sp",), dict(strategy="ulysses")),
    "ulysses_4": ((4,), ("sp",), dict(strategy="ulysses")),
    "ulysses_dp2x4": ((2, 4), ("dp", "sp"), dict(strategy="ulysses", batch_axes=("dp",))),
    "ulysses_ring_4x2": ((4, 2), ("sp", "u"), dict(strategy="ulysses_ring", ulysses_axis="u")),
    "ulysses_ring_2x4": ((2, 4), ("sp", "u"), dict(strategy="ulysses_ring", ulysses_axis="u")),
}


MATRIX = [(m, lay, mask, (8, 2, 1)[i % 3], i % 2 == 0) for i, (m, lay, mask) in enumerate(
    (m, lay, mask) for m in MESHES for lay in layouts.LAYOUTS for mask in MASK_CLASSES)]


@pytest.mark.ci_cases("ulysses_8-contiguous-causal-k8-docs", "ulysses_4-zigzag-window-k1-plain",
                      "ulysses_dp2x4-striped-prefix-k2-docs",
                      "ulysses_ring_2x4-zigzag-full-k2-plain",
                      "ulysses_ring_4x2-striped-window-k8-plain")
@pytest.mark.parametrize("mesh_name, layout, mask_name, kv_heads, docs", MATRIX,
                         ids=[f"{m}-{lay}-{mask}-k{kh}-{'docs' if d else 'plain'}"
                              for m, lay, mask, kh, d in MATRIX])
def test_strategy_layout_mask_heads_matrix(mesh_name, layout, mask_name, kv_heads, docs):
  shape, axes, fields = MESHES[mesh_name]
  r = shape[axes.index("sp")]
  mesh = _mesh(shape, axes)
  q, k, v, seg = _problem(11, kh=kv_heads)
  seg = seg if docs else None
  mask = MASK_CLASSES[mask_name]
  ours = lambda q, k, v: _ulysses(mesh, layout, r=r, **fields)(q, k, v, segment_ids=seg,
                                                                mask=mask)
  ref = lambda q, k, v: reference.attention(q, k, v, segment_ids=seg, mask=mask)[0]
  (out, grads), (out_ref, grads_ref) = _run(ours, q, k, v), _run(ref, q, k, v)
  assert rel_err(out, out_ref) < 2e-6
  for got, want in zip(grads, grads_ref):
    assert rel_err(got, want) < 2e-6


@pytest.mark.ci_cases("pallas_triton-ulysses", "pallas_tpu-ulysses_ring")
@pytest.mark.parametrize("strategy", ["ulysses", "ulysses_ring"])
@pytest.mark.parametrize("backend", ["pallas_triton", "pallas_tpu"])
def test_pallas_backends_in_interpret_mode(backend, strategy):
  uly = strategy == "ulysses_ring"
  mesh = _mesh((2, 2), ("sp", "u")) if uly else _mesh((4,), ("sp",))
  r = 2 if uly else 4
  t = 256 if backend == "pallas_tpu" else 64
  q, k, v, seg = _problem(13, b=1, t=t, n=4, kh=2, h=32)
  fields = dict(strategy=strategy, backend=backend) | (dict(ulysses_axis="u") if uly else {})
  ours = lambda q, k, v: _ulysses(mesh, "zigzag", r=r, **fields)(
      q, k, v, segment_ids=seg, mask=masks.Causal(), interpret=True)
  ref = lambda q, k, v: reference.attention(q, k, v, segment_ids=seg, mask=masks.Causal())[0]
  (out, grads), (out_ref, grads_ref) = _run(ours, q, k, v), _run(ref, q, k, v)
  assert rel_err(out, out_ref) < 2e-3
  for got, want in zip(grads, grads_ref):
    assert rel_err(got, want) < 2e-3


@pytest.mark.parametrize("strategy", ["ulysses", "ulysses_ring"])
def test_cross_lowers_triton_kernels_for_cuda(strategy):
  """From this CPU host, the strategies lower for CUDA with our Triton kernels (``auto``)."""
  uly = strategy == "ulysses_ring"
  mesh = _mesh((4, 2), ("sp", "u")) if uly else _mesh((8,), ("sp",))
  cfg = SequenceParallelConfig(axis_name="sp", layout="zigzag", strategy=strategy,
                               ulysses_axis="u" if uly else None)
  f = lambda q, k, v: jnp.sum(sharded_attention(q, k, v, mesh=mesh, config=cfg,
                                                mask=masks.Causal()).astype(jnp.float32))
  s = jax.ShapeDtypeStruct((1, 1024, 8, 64), jnp.bfloat16)
  text = jax.jit(jax.grad(f, argnums=(0, 1, 2))).trace(s, s, s).lower(
      lowering_platforms=("cuda",)).as_text()
  assert text.count("__gpu$xla.gpu.triton") >= 3  # the forward, dQ and dK/dV kernels
  assert "all_to_all" in text or "all-to-all" in text
