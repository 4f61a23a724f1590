"""The TPU kernels under JAX's TPU interpreter (``pltpu.InterpretParams``): uninitialised memory
is NaN, out-of-bounds reads raise, two cores per device share each ``parallel`` grid axis and a
happens-before race detector watches every buffer; the kernels take the hardware's code paths
where the interpreter runs them (float16 widened; the ref bitcast of in-place 16-bit blocks
where the interpreter reads through it, ``pallas_tpu.views._interprets_ref_bitcast``). Plain
interpret mode (the conformance tests) zero-fills scratch, runs one core and sees no races.

Tiny shapes (the interpreter runs each operation of each grid point on the host): flash
attention forward and both backward passes, decode, and the ring and Ulysses on several devices;
every case checks outputs and gradients against ``pallas_ring.reference`` and that no race was
reported.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import rel_err
from pallas_ring import (BlockSizes, SequenceParallelConfig, decode_attention, flash_attention,
                         layouts, masks, quantize_fp8, reference, sharded_attention)

PARAMS = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan",
                               out_of_bounds_reads="raise", num_cores_or_threads=2)
TILES = BlockSizes(block_q=64, block_kv=128, block_q_bwd=64, block_kv_bwd=128)


def _recorded_states(monkeypatch) -> list:
  """Every race-detection state the interpreter creates from now on (one per kernel call: it
  replaces ``interpret_pallas_call.races`` each time, so the last one alone misses races)."""
  from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
  states = []

  class Recorded(ipc.RaceDetectionState):
    def __init__(self, *a, **k):
      super().__init__(*a, **k)
      states.append(self)

  monkeypatch.setattr(ipc, "RaceDetectionState", Recorded)
  return states


@pytest.fixture
def races(monkeypatch):
  """The test fails if any kernel it runs under the interpreter reported a race."""
  states = _recorded_states(monkeypatch)
  yield states
  assert states, "the TPU interpreter ran no kernel with race detection"
  assert not any(s.races_found for s in states), "the TPU interpreter reported a race"


def test_the_race_check_sees_a_race(monkeypatch):
  """The ``races`` fixture's check can fail: two cores writing one output block from the two
  halves of a ``parallel`` grid axis is a race the interpreter reports."""
  states = _recorded_states(monkeypatch)

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]

  x = jnp.ones((16, 128), jnp.float32)
  jax.block_until_ready(pl.pallas_call(
      kernel, grid=(2,), in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((8, 128), lambda i: (0, 0)),
      out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32), interpret=PARAMS,
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)))(x))
  assert any(s.races_found for s in states)


def _inputs(seed, t, n, kh, h, dtype, s=None):
  rng = np.random.default_rng(seed)
  s = t if s is None else s
  return tuple(jnp.asarray(rng.standard_normal(shape), dtype)
               for shape in ((1, t, n, h), (1, s, kh, h), (1, s, kh, h), (1, t, n, h)))


def _check(ours, ref, args, do, tol):
  """Outputs and gradients (every pass of the backward) of ``ours`` against ``ref``, and no NaN
  (read from uninitialised memory)."""
  loss = lambda f: lambda *a: jnp.sum(f(*a).astype(jnp.float32) * do.astype(jnp.float32))
  got = jax.block_until_ready((ours(*args), *jax.grad(loss(ours), (0, 1, 2))(*args)))
  want = (ref(*args), *jax.grad(loss(ref), (0, 1, 2))(*args))
  for which, a, r in zip(("o", "dq", "dk", "dv"), got, want):
    assert not np.isnan(np.asarray(a, np.float32)).any(), which
    assert rel_err(a, r) < tol, (which, rel_err(a, r))


# (name, T, N, K, H, dtype, extras): each a forward with both backward passes (dQ; dK/dV).
FLASH = {
    "gqa_f32_documents": (128, 2, 1, 64, jnp.float32, dict(documents=True)),
    "mha_bf16_in_place_8_heads": (64, 8, 8, 128, jnp.bfloat16, dict(documents=True)),
    "mqa_f16_softcap_window": (128, 2, 1, 64, jnp.float16,
                               dict(mask=masks.SlidingWindow(40), softcap=20.0)),
}


# The first case runs in `make test` and `make quick`, the others in `make test-all` (conftest).
@pytest.mark.parametrize("case", list(FLASH))
def test_flash_attention_forward_and_backward(case, races):
  t, n, kh, h, dt, extra = FLASH[case]
  q, k, v, do = _inputs(1, t, n, kh, h, dt)
  kw = dict(mask=extra.get("mask", masks.Causal()), softcap=extra.get("softcap"))
  if extra.get("documents"):
    kw["segment_ids"] = jnp.asarray(np.arange(t)[None] // 50, jnp.int32)  # (PARTIAL tiles)
  ours = lambda *a: flash_attention(*a, backend="pallas_tpu", block_sizes=TILES,
                                    interpret=PARAMS, **kw)
  ref = lambda *a: reference.attention(*a, **kw)[0]
  _check(ours, ref, (q, k, v), do, 2e-3 if dt == jnp.float32 else 2e-2)


@pytest.mark.ci_cases(every=True)
@pytest.mark.parametrize("cache", ["float32", "float8_e4m3fn"])
def test_decode(races, cache):
  """A few query tokens against a cache with ragged lengths (the forward kernel over chunks of
  the cache). An FP8 cache of 8 kv heads reaches the kernel as FP8 in place (4 heads a 32-bit
  word), and the kernel widens each head's tile."""
  rng = np.random.default_rng(3)
  kh = 2 if cache == "float32" else 8
  q = jnp.asarray(rng.standard_normal((2, 2, 2 * kh, 64)), jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal((2, 128, kh, 64)), jnp.float32) for _ in range(2))
  lengths = jnp.asarray([128, 70], jnp.int32)
  scales = {}
  if cache != "float32":
    (k, kd), (v, vd) = quantize_fp8(k, cache), quantize_fp8(v, cache)
    scales = dict(k_descale=kd, v_descale=vd)
  got = decode_attention(q, k, v, kv_lengths=lengths, backend="pallas_tpu", interpret=PARAMS,
                         block_sizes=BlockSizes(block_kv=128, kv_splits=1), **scales)
  if scales:  # the reference on the dequantized cache
    k, v = (x.astype(jnp.float32) * d[:, None, :, None] for x, d in ((k, kd), (v, vd)))
  q_pos = lengths[:, None] - 2 + jnp.arange(2)
  seg_kv = (jnp.arange(128)[None] >= lengths[:, None]).astype(jnp.int32)
  want = reference.attention(q, k, v, mask=masks.Causal(), q_positions=q_pos,
                             segment_ids=jnp.zeros((2, 2), jnp.int32), kv_segment_ids=seg_kv)[0]
  assert rel_err(got, want) < 2e-3


# The interpreter runs each device's kernel call on a host thread of XLA's CPU pool and holds it
# at its start until every device's call has arrived (a global barrier, as if kernels
# communicated), so: two devices, as a 2-core machine has 2 such threads; and layouts whose ring
# steps all have work on every device (a contiguous causal ring skips a step's kernel on some
# devices, and the others' calls then wait forever).
@pytest.mark.ci_cases("ring-zigzag-2", "ulysses-contiguous-2")
@pytest.mark.parametrize("strategy, layout, devices", [("ring", "zigzag", 2),
                                                      ("ring", "striped", 2),
                                                      ("ulysses", "contiguous", 2)])
def test_sequence_parallel(strategy, layout, devices, races):
  """The ring (each step's forward merges into the running (o, lse) and its backward adds into
  the running dQ and the travelling dK/dV: the kernels' accumulators) and Ulysses on several
  devices, forward and gradients, with documents."""
  t, n, kh, h = 64 * devices, 2, 2, 64
  q, k, v, do = _inputs(4, t, n, kh, h, jnp.float32)
  seg = jnp.asarray(np.arange(t)[None] // 100, jnp.int32)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("sp",))
  cfg = SequenceParallelConfig(axis_name="sp", layout=layout, strategy=strategy,
                               backend="pallas_tpu", block_sizes=TILES)
  perm = lambda x: layouts.permute(x, layout, devices)
  ours = lambda *a: sharded_attention(*a, mesh=mesh, config=cfg, mask=masks.Causal(),
                                      segment_ids=perm(seg), interpret=PARAMS)
  ref = lambda *a: perm(reference.attention(*(layouts.unpermute(x, layout, devices) for x in a),
                                            mask=masks.Causal(), segment_ids=seg)[0])
  put = lambda x: jax.device_put(perm(x), NamedSharding(mesh, P(None, "sp")))
  _check(ours, ref, tuple(map(put, (q, k, v))), perm(do), 2e-3)


def test_interpret_params_reach_the_kernels(monkeypatch):
  """``interpret=pltpu.InterpretParams(...)`` passes the public API and arrives in the kernels'
  config unchanged (not turned into ``True``)."""
  from pallas_ring.kernels import pallas_tpu
  seen, forward = [], pallas_tpu.forward
  monkeypatch.setattr(pallas_tpu.BACKEND, "forward",
                      lambda *a, **k: (seen.append(a[5].interpret), forward(*a, **k))[1])
  q = jnp.ones((1, 8, 2, 64), jnp.float32)
  jax.eval_shape(lambda q: flash_attention(q, q, q, backend="pallas_tpu", interpret=PARAMS), q)
  assert seen == [PARAMS]
