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
}


def _fn(backend, case):
  extra = {k: v for k, v in case.items() if k not in ("segments", "dense")}

  def f(q, k, v, seg, dense):
    return flash_attention(q, k, v, segment_ids=seg if case.get("segments") else None,
                           dense_mask=dense if case.get("dense") else None, backend=backend,
                           interpret=False, **extra)

  def loss(q, k, v, seg, dense):
    return jnp.sum(f(q, k, v, seg, dense).astype(jnp.float32))

  return f, jax.grad(loss, argnums=(0, 1, 2))


def _structs(t, sharding=None):
  s = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)
  return (s((2, t, 4, 128), jnp.bfloat16), s((2, t, 2, 128), jnp.bfloat16),
          s((2, t, 2, 128), jnp.bfloat16), s((2, t), jnp.int32), s((1, 1, t, t), jnp.bool_))


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


@pytest.mark.parametrize("case", list(CASES))
def test_triton_lowers_for_cuda(case):
  args = _structs(300)
  fwd, bwd = _fn("pallas_triton", CASES[case])
  for fn, n_kernels in ((fwd, 1), (bwd, 3)):
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == n_kernels
