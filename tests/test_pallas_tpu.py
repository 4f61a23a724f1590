"""The ``pallas_tpu`` backend (interpret mode on CPU; compiled for TPU in test_lowering)."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conformance import Conformance
from conftest import rel_err, small_blocks
from pallas_ring import flash_attention, masks, reference


class TestPallasTpu(Conformance):
  backend = "pallas_tpu"


# The conformance cases have fewer than 8 heads (lane-block views), and test_extras' head-block
# cases are float32. 16-bit operands with a multiple of 8 heads are read in place as uint32 words
# of head pairs, one head at a time by a traced index: forward and gradients, masked and unmasked
# tiles (causal + documents), in interpret mode.
IN_PLACE = {
    "mha_bf16": (8, 8, jnp.bfloat16),
    "gqa_bf16_two_kv_blocks_two_ranks": (32, 16, jnp.bfloat16),
    "mha_f16": (8, 8, jnp.float16),
}


@pytest.mark.parametrize("case", list(IN_PLACE))
def test_heads_read_in_place(case):
  n, kh, dt = IN_PLACE[case]
  b, t, h = 1, 200, 128
  rng = np.random.default_rng(zlib.crc32(case.encode()))
  q, k, v, do = (jnp.asarray(rng.standard_normal(s), dt)
                 for s in ((b, t, n, h), (b, t, kh, h), (b, t, kh, h), (b, t, n, h)))
  kw = dict(mask=masks.Causal(), segment_ids=jnp.asarray(np.arange(t)[None] // 150, jnp.int32))
  ours = lambda *a: flash_attention(*a, backend="pallas_tpu", block_sizes=small_blocks(
      "pallas_tpu"), **kw)
  ref = lambda *a: reference.attention(*a, **kw)[0]
  tol = 2e-3 if dt == jnp.float32 else 2e-2
  assert rel_err(ours(q, k, v), ref(q, k, v)) < tol
  loss = lambda f: lambda *a: jnp.sum(f(*a).astype(jnp.float32) * do.astype(jnp.float32))
  for which, a, r in zip("qkv", jax.grad(loss(ours), (0, 1, 2))(q, k, v),
                         jax.grad(loss(ref), (0, 1, 2))(q, k, v)):
    assert a.dtype == dt and rel_err(a, r) < tol, (which, rel_err(a, r))
