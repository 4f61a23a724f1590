"""The Pallas kernels are real kernels: Mosaic compiles them for TPU topologies through libtpu,
and the Triton kernels lower for CUDA, all on this CPU machine."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_ring import flash_attention, masks

CASES = {
    "causal_gqa_softcap": dict(mask=masks.Causal(), softcap=30.0),
    "chunked_documents": dict(mask=masks.ChunkedCausal(300) | masks.PrefixLM(64), segments=True),
    "window_dense": dict(mask=masks.SlidingWindow(200), dense=True),
    # issue 15: additive bias (per head), ALiBi and hashed dropout, in every kernel
    "bias_alibi_dropout": dict(mask=masks.Causal(), bias=True, dropout_rate=0.1,
                               alibi_slopes=np.linspace(0.01, 0.1, 4, dtype=np.float32)),
    "alibi_bidirectional": dict(mask=masks.SlidingWindow(100, 50),
                                alibi_slopes=np.linspace(0.01, 0.1, 4, dtype=np.float32)),
}


def _fn(backend, case):
  extra = {k: v for k, v in case.items() if k not in ("segments", "dense", "bias")}
  if "dropout_rate" in case:
    extra["dropout_rng"] = jax.random.key(0)

  def f(q, k, v, seg, dense):
    bias = None
    if case.get("bias"):  # [N, T, S] derived from the dense mask's shape
      bias = jnp.broadcast_to(jnp.linspace(-1, 1, dense.shape[-1], dtype=jnp.float32),
                              (q.shape[2],) + dense.shape[2:])
    return flash_attention(q, k, v, segment_ids=seg if case.get("segments") else None,
                           dense_mask=dense if case.get("dense") else None, bias=bias,
                           backend=backend, interpret=False, **extra)

  def loss(q, k, v, seg, dense):
    return jnp.sum(f(q, k, v, seg, dense).astype(jnp.float32))

  return f, jax.grad(loss, argnums=(0, 1, 2))


def _structs(t, sharding=None):
  s = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)
  return (s((2, t, 4, 128), jnp.bfloat16), s((2, t, 2, 128), jnp.bfloat16),
          s((2, t, 2, 128), jnp.bfloat16), s((2, t), jnp.int32), s((1, 1, t, t), jnp.bool_))


@pytest.mark.ci_cases("causal_gqa_softcap-v5e:2x2", "chunked_documents-v6e:2x2",
                      "window_dense-v5e:2x2")
@pytest.mark.xdist_group("libtpu")
@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
@pytest.mark.parametrize("case", list(CASES))
def test_mosaic_compiles_for_tpu(topology, case):
  from jax.experimental import topologies
  try:
    topo = topologies.get_topology_desc(topology_name=topology, platform="tpu")
  except Exception as e:  # pragma: no cover - only without libtpu
    pytest.fail(f"libtpu is required (pip install -e '.[tpu]'): {e}")
  mesh = jax.sharding.Mesh(np.array(topo.devices[:1]), ("x",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  args = _structs(1000, sharding)  # not a block multiple: padding inside
  fwd, bwd = _fn("pallas_tpu", CASES[case])
  for fn, n_kernels in ((fwd, 1), (bwd, 3)):
    compiled = jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).compile()
    text = compiled.as_text()
    assert text.count("custom_call_target=\"tpu_custom_call\"") == n_kernels
    mem = compiled.memory_analysis()
    assert mem.argument_size_in_bytes > 0


@pytest.mark.xdist_group("libtpu")
@pytest.mark.parametrize("topology, head_dim", [("v5p:2x2x1", 64), ("v5p:2x2x1", 256),
                                                ("v6e:2x2", 256)])
def test_mosaic_compiles_every_head_dim(topology, head_dim):
  """Head dims 64 and 256 on v5p and v6e."""
  from jax.experimental import topologies
  topo = topologies.get_topology_desc(topology_name=topology, platform="tpu")
  mesh = jax.sharding.Mesh(np.array(topo.devices[:1]), ("x",))
  sd = lambda shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec()))
  args = (sd((1, 1000, 4, head_dim)), sd((1, 1000, 2, head_dim)), sd((1, 1000, 2, head_dim)))
  f = lambda q, k, v: flash_attention(q, k, v, mask=masks.Causal(), backend="pallas_tpu",
                                      interpret=False)
  grad = jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1, 2))
  text = jax.jit(grad).trace(*args).lower(lowering_platforms=("tpu",)).compile().as_text()
  assert text.count("custom_call_target=\"tpu_custom_call\"") == 3


@pytest.mark.xdist_group("libtpu")
@pytest.mark.parametrize("heads, kv_heads, dtype", [(16, 8, jnp.bfloat16), (8, 8, jnp.float32),
                                                    (8, 1, jnp.bfloat16), (8, 8, jnp.float16)])
def test_mosaic_compiles_heads_read_in_place(heads, kv_heads, dtype):
  """Operands with a multiple of 8 heads are read in place by a traced head index (uint32 words
  of head pairs for 16-bit dtypes): every kernel compiles, with masked and unmasked tiles.
  float16 runs the float32 kernels on widened operands (Mosaic has no float16 vector casts)."""
  from jax.experimental import topologies
  topo = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu")
  mesh = jax.sharding.Mesh(np.array(topo.devices[:1]), ("x",))
  sd = lambda n: jax.ShapeDtypeStruct((1, 1000, n, 128), dtype, sharding=jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec()))
  f = lambda q, k, v: flash_attention(q, k, v, mask=masks.Causal(), backend="pallas_tpu",
                                      interpret=False, dropout_rate=0.1,
                                      dropout_rng=jax.random.key(0))
  grad = jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1, 2))
  args = sd(heads), sd(kv_heads), sd(kv_heads)
  text = jax.jit(grad).trace(*args).lower(lowering_platforms=("tpu",)).compile().as_text()
  assert text.count("custom_call_target=\"tpu_custom_call\"") == 3


@pytest.mark.xdist_group("libtpu")
@pytest.mark.parametrize("topology, kind", [("v4:2x2x1", "TPU v4"), ("v5e:2x2", "TPU v5 lite"),
                                            ("v5p:2x2x1", "TPU v5"), ("v6e:2x2", "TPU v6 lite")])
def test_ring_compiles_with_the_targets_defaults(topology, kind, monkeypatch):
  """Tiles and the VMEM limit come from the chip being compiled for, not from this CPU host (v4
  ran out of VMEM with the v5e tiles): the ring's forward+backward compiles with default
  arguments for every generation."""
  from pallas_ring import SequenceParallelConfig
  from pallas_ring.aot import compile_ring
  from pallas_ring.kernels import tuning
  seen = []
  resolve = tuning.resolve
  monkeypatch.setattr(tuning, "resolve", lambda *a, **k: (seen.append(tuning.device_kind(a[0])),
                                                          resolve(*a, **k))[1])
  rep = compile_ring(topology, SequenceParallelConfig(axis_name="sp", layout="zigzag"),
                     seq_len=4096 * 4, heads=8, kv_heads=8)
  assert rep.kernels > 0 and rep.device_kind == kind
  assert set(seen) == {kind}


@pytest.mark.xdist_group("libtpu")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_v4_compiles_wide_inputs_with_default_tiles(dtype):
  """16 MiB of VMEM (v4): float32 kernels (float16 inputs run them too) get narrower default
  key tiles than 16-bit ones, and compile with default arguments."""
  from jax.experimental import topologies
  topo = topologies.get_topology_desc(topology_name="v4:2x2x1", platform="tpu")
  mesh = jax.sharding.Mesh(np.array(topo.devices[:1]), ("x",))
  sd = jax.ShapeDtypeStruct((1, 2048, 8, 128), dtype, sharding=jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec()))
  f = lambda q, k, v: flash_attention(q, k, v, mask=masks.Causal())
  grad = jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1, 2))
  with jax.set_mesh(mesh):  # (the target chip's tiles: the mesh's device is a v4)
    text = jax.jit(grad).trace(sd, sd, sd).lower(lowering_platforms=("tpu",)).compile().as_text()
  assert text.count("custom_call_target=\"tpu_custom_call\"") == 3


@pytest.mark.parametrize("case", list(CASES))
def test_triton_lowers_for_cuda(case):
  args = _structs(300)
  fwd, bwd = _fn("pallas_triton", CASES[case])
  for fn, n_kernels in ((fwd, 1), (bwd, 3)):
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == n_kernels


# -------------------------------------- backend="auto", interpret=None: per lowering platform --

def _default_fn():
  """flash_attention with every dispatch argument left at its default."""
  def f(q, k, v, seg, dense):
    return flash_attention(q, k, v, mask=masks.Causal(), segment_ids=seg)
  return f, jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1, 2))


@pytest.mark.xdist_group("libtpu")
def test_defaults_compile_native_mosaic_kernels_for_tpu_from_a_cpu_host():
  from jax.experimental import topologies
  topo = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu")
  mesh = jax.sharding.Mesh(np.array(topo.devices[:1]), ("x",))
  args = _structs(512, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  for fn, n_kernels in zip(_default_fn(), (1, 3)):
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).compile().as_text()
    assert text.count("custom_call_target=\"tpu_custom_call\"") == n_kernels


def _every_key(q, k):
  return k >= 0


@pytest.mark.xdist_group("libtpu")
@pytest.mark.parametrize("mask", [masks.Full(), masks.Custom(_every_key)])
def test_masks_without_a_block_structure_lower_for_a_topology_under_its_mesh(mask):
  """Masks whose block test is a constant (Full, Custom without block_fn) build their plans in
  numpy, so they lower under ``jax.set_mesh`` of a TPU topology (the mesh that picks the
  target chip's tiles), where a jax constant cannot be placed."""
  from jax.experimental import topologies
  topo = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu")
  mesh = jax.sharding.Mesh(np.array(topo.devices[:1]), ("x",))
  sd = jax.ShapeDtypeStruct((1, 512, 2, 128), jnp.bfloat16,
                            sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  with jax.set_mesh(mesh):
    text = jax.jit(lambda q, k, v: flash_attention(q, k, v, mask=mask)).trace(
        sd, sd, sd).lower(lowering_platforms=("tpu",)).as_text()
  assert "tpu_custom_call" in text


@pytest.mark.xdist_group("libtpu")
def test_sharded_attention_defaults_compile_mosaic_kernels_for_tpu():
  from jax.experimental import topologies
  from jax.sharding import NamedSharding, PartitionSpec as P
  from pallas_ring import SequenceParallelConfig, sharded_attention
  topo = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu")
  mesh = jax.sharding.Mesh(np.array(topo.devices), ("sp",))
  sd = lambda shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16,
                                          sharding=NamedSharding(mesh, P(None, "sp")))
  cfg = SequenceParallelConfig(axis_name="sp", layout="zigzag")  # backend="auto"
  f = lambda q, k, v: sharded_attention(q, k, v, mesh=mesh, config=cfg, mask=masks.Causal())
  text = jax.jit(f).trace(sd((1, 4096, 4, 128)), sd((1, 4096, 4, 128)),
                          sd((1, 4096, 4, 128))).lower(lowering_platforms=("tpu",)).as_text()
  assert "tpu_custom_call" in text


def test_defaults_cross_lower_triton_kernels_for_cuda_and_xla_for_cpu():
  args = _structs(300)
  for fn, n_kernels in zip(_default_fn(), (1, 3)):
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == n_kernels
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cpu",)).as_text()
    assert "triton" not in text and "tpu_custom_call" not in text


def test_auto_with_block_sizes_a_kernel_cannot_take_falls_back_to_xla_there():
  from pallas_ring import BlockSizes, kernels, reference
  bs = BlockSizes(block_q=16, block_kv=16)  # not a TPU tile (keys need multiples of 128)
  v = kernels.variants("auto", None, kernels.Call(jnp.bfloat16, 32, block_sizes=bs))
  assert v["tpu"] == ("xla", False) and v["cuda"] == ("pallas_triton", False)
  assert v["cpu"] == ("xla", False)
  call = kernels.Call(jnp.float32, 32)
  assert kernels.variants("pallas_tpu", None, call)["cpu"] == ("pallas_tpu", True)
  q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 40, 2, 32)), jnp.float32)
  out = flash_attention(q, q, q, mask=masks.Causal(), block_sizes=bs)
  np.testing.assert_allclose(out, reference.attention(q, q, q, mask=masks.Causal())[0],
                             atol=2e-5)


# ----------------------------------------- TPU scalar memory: plan lists bounded per kernel call --

def test_tpu_lists_split_over_calls_match_the_reference(monkeypatch):
  """With a tiny SMEM budget every pass runs as one call per row (outputs aliased in place);
  results equal the reference (interpret mode)."""
  from pallas_ring import reference
  from pallas_ring.kernels import pallas_tpu
  monkeypatch.setattr(pallas_tpu.tiles, "SMEM_LIST_BYTES", 1)
  assert pallas_tpu.tiles._row_ranges(jnp.zeros((1, 1, 5, 3), jnp.int32)) == [
      (0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
  r = np.random.default_rng(0)
  q, k, v = (jnp.asarray(r.standard_normal((1, 300, n, 64)), jnp.float32) for n in (4, 2, 2))
  bs = dict(block_q=64, block_kv=128, block_q_bwd=64, block_kv_bwd=128)
  f = lambda q, k, v: flash_attention(q, k, v, mask=masks.Causal(), backend="pallas_tpu",
                                      block_sizes=bs, interpret=True)
  ref = lambda q, k, v: reference.attention(q, k, v, mask=masks.Causal())[0]
  out, vjp = jax.vjp(f, q, k, v)
  ref_out, ref_vjp = jax.vjp(ref, q, k, v)
  np.testing.assert_allclose(out, ref_out, atol=2e-5)
  for g, rg in zip(vjp(out), ref_vjp(out)):
    np.testing.assert_allclose(g, rg, atol=5e-5)


@pytest.mark.xdist_group("libtpu")
def test_tpu_long_sequence_compiles_with_bounded_smem():
  """Lists of 512 x 512 tiles (768 KiB) exceed one call's budget: each pass is split, and the
  whole forward+backward compiles for v5e (it failed with SMEM exhausted before)."""
  from jax.experimental import topologies
  topo = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu")
  mesh = jax.sharding.Mesh(np.array(topo.devices[:1]), ("x",))
  sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  t = 65536
  s = jax.ShapeDtypeStruct((1, t, 2, 128), jnp.bfloat16, sharding=sh)
  bs = dict(block_q=128, block_kv=128, block_q_bwd=128, block_kv_bwd=128)
  f = lambda q, k, v: flash_attention(q, k, v, mask=masks.Causal(), block_sizes=bs)
  g = jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1, 2))
  compiled = jax.jit(g).trace(s, s, s).lower(lowering_platforms=("tpu",)).compile()
  assert compiled.as_text().count('custom_call_target="tpu_custom_call"') > 3


@pytest.mark.xdist_group("libtpu")
def test_tpu_memory_against_splash_attention():
  """Issue 14's targets on one v5e chip (causal, N=8, H=128, bf16), splash compiled in the same
  test: forward temporaries <= 2x splash's + the output's size, forward+backward <= 1.25x
  splash's. The 8-head blocks read [B, T, N, H] in place; the relayout copies this replaced
  cost 129 MiB (forward) and 321 MiB (forward+backward) at this length."""
  import importlib.util
  import pathlib
  path = pathlib.Path(__file__).parents[1] / "tools" / "tpu_memory.py"
  spec = importlib.util.spec_from_file_location("tpu_memory", path)
  tm = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(tm)
  t, out_bytes = 32768, 32768 * 8 * 128 * 2
  for backward in (False, True):
    ours = tm.temp_bytes(tm.ours("v5e:2x2", t, backward=backward))
    splash = tm.temp_bytes(tm.splash("v5e:2x2", t, backward=backward))
    limit = 1.25 * splash if backward else 2 * splash + out_bytes
    assert ours <= limit, (backward, ours / 2**20, splash / 2**20)


# --------------------------------------------- TPU VMEM: every generation, default arguments --

def _tool(name):
  import importlib.util
  import pathlib
  path = pathlib.Path(__file__).parents[1] / "tools" / f"{name}.py"
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  import sys
  sys.modules[name] = module  # (its dataclasses look their module up there)
  spec.loader.exec_module(module)
  return module


@pytest.mark.xdist_group("libtpu")
def test_v4_compiles_default_forward_backward_without_a_mesh():
  """Issue 58: bf16 causal forward+backward, N=K=8, H=128, T=4096 for v4 with default
  arguments and no ``jax.set_mesh`` (tiles chosen for an unknown chip) ran out of VMEM (16.25 of
  16 MiB): the kernels now measure their programs and split tiles that do not fit the chip that
  the operands' sharding names."""
  from pallas_ring.kernels import pallas_tpu
  from jax.experimental import topologies
  topo = topologies.get_topology_desc(topology_name="v4:2x2x1", platform="tpu")
  mesh = jax.sharding.Mesh(np.array(topo.devices[:1]), ("x",))
  sd = jax.ShapeDtypeStruct((1, 4096, 8, 128), jnp.bfloat16,
                            sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  f = lambda q, k, v: flash_attention(q, k, v, mask=masks.Causal())
  grad = jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1, 2))
  seen, fit = [], pallas_tpu.tiles._fit

  def recording(*a):
    p, vmem = fit(*a)
    seen.append(vmem)
    return p, vmem

  pallas_tpu.tiles._fit = recording
  try:
    text = jax.jit(grad).trace(sd, sd, sd).lower(lowering_platforms=("tpu",)).compile().as_text()
  finally:
    pallas_tpu.tiles._fit = fit
  assert text.count("custom_call_target=\"tpu_custom_call\"") == 3
  assert len(seen) >= 3 and all(v.chip == "TPU v4" and v.capacity == 16 * 2**20 for v in seen)
  assert all(v.fits() for v in seen)


@pytest.mark.xdist_group("libtpu")
def test_a_new_buffer_is_measured_and_tiles_split_to_fit(monkeypatch):
  """A kernel that grows a buffer cannot overflow VMEM silently: 6 MiB more staging scratch in
  the forward is measured from the grid spec, and the tiles are split until the program fits
  v4's 16 MiB (it compiles)."""
  from pallas_ring import BlockSizes
  from pallas_ring.kernels import pallas_tpu
  from jax.experimental import topologies
  fwd = pallas_tpu.fwd_kernel
  staging, kernel = fwd._staging, fwd._fwd_kernel
  monkeypatch.setattr(fwd, "_staging", lambda dtype, h, *rows: staging(dtype, h, *rows) + [
      fwd.pltpu.VMEM((6 * 2**20 // 512, 128), jnp.float32)])
  monkeypatch.setattr(fwd, "_fwd_kernel", lambda *refs, **kw: kernel(*refs[:-1], **kw))
  seen, fit = [], pallas_tpu.tiles._fit
  monkeypatch.setattr(pallas_tpu.tiles, "_fit", lambda *a: (lambda r: (seen.append(r), r)[1])(fit(*a)))
  topo = topologies.get_topology_desc(topology_name="v4:2x2x1", platform="tpu")
  mesh = jax.sharding.Mesh(np.array(topo.devices[:1]), ("x",))
  sd = jax.ShapeDtypeStruct((1, 2048, 8, 128), jnp.bfloat16,
                            sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  f = lambda q, k, v: flash_attention(q, k, v, mask=masks.Causal(),
                                      block_sizes=BlockSizes(block_q=512, block_kv=512))
  text = jax.jit(f).trace(sd, sd, sd).lower(lowering_platforms=("tpu",)).compile().as_text()
  assert "tpu_custom_call" in text
  (p, vmem), = seen
  cfg = p.kernel.keywords["cfg"]
  assert vmem.scratch >= 6 * 2**20 and vmem.fits()
  assert cfg.block_q * cfg.block_kv < 512 * 512


# A representative subset of tools/tpu_compile_matrix.py (BENCHMARKS.md has the whole matrix):
# every generation, dtype, program, head dim and mask at least once, and the tightest cell
# (v4's ring dK/dV with accumulators).
MATRIX_SUBSET = [("v4", "bfloat16", "ring", 128, "documents"),
                 ("v4", "float32", "forward+backward", 256, "documents"),
                 ("v5e", "float16", "forward+backward", 64, "causal"),
                 ("v5p", "float32", "decode", 256, "documents"),
                 ("v6e", "bfloat16", "forward", 64, "causal"),
                 ("v6e", "bfloat16", "forward+backward", 192, "documents", 128)]


@pytest.mark.ci_cases("v4-bfloat16-ring-128-documents", "v5e-float16-forward+backward-64-causal",
                      "v5p-float32-decode-256-documents", "v6e-bfloat16-forward-64-causal",
                      "v6e-bfloat16-forward+backward-192-documents-128")
@pytest.mark.ci
@pytest.mark.xdist_group("libtpu")
@pytest.mark.parametrize("cell", MATRIX_SUBSET, ids=lambda c: "-".join(map(str, c)))
def test_compile_matrix_subset_with_default_arguments(cell):
  tool = _tool("tpu_compile_matrix")
  r = tool.compile_cell(tool.Cell(*cell))
  assert r.ok, r.error
  assert r.passes and all(vmem <= capacity for *_, vmem, capacity in r.passes), r.passes
