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


def test_key_chunks_inside_a_tile_match_the_whole_tile():
  """A 384-key tile computed in chunks of 128 keys (``Variants.kv_compute``) in every kernel:
  the same results as the reference with every score term (bias, ALiBi, dropout, documents,
  padding) on masked and unmasked tiles."""
  from pallas_ring import BlockSizes, dropout_keep_mask
  from pallas_ring.kernels.pallas_tpu import Variants
  b, t, n, kh, h = 1, 300, 2, 1, 64
  rng = np.random.default_rng(21)
  q, k, v, do = (jnp.asarray(rng.standard_normal(s), jnp.float32)
                 for s in ((b, t, n, h), (b, t, kh, h), (b, t, kh, h), (b, t, n, h)))
  seg = jnp.asarray(np.arange(t)[None] // 250, jnp.int32)
  bias = jnp.asarray(rng.standard_normal((1, n, t, t)), jnp.float32)
  slopes = jnp.asarray([0.1, 0.02], jnp.float32)
  key = jax.random.key(22)
  keep = dropout_keep_mask(key, 0.2, b, n, jnp.arange(t), jnp.arange(t))
  kw = dict(mask=masks.Causal(), segment_ids=seg, alibi_slopes=slopes)
  ref = lambda q, k, v, bias: reference.attention(q, k, v, bias=bias, dropout_rate=0.2,
                                                  dropout_mask=keep, **kw)[0]
  loss = lambda f: lambda *a: jnp.sum(f(*a) * do)
  want = (ref(q, k, v, bias), *jax.grad(loss(ref), (0, 1, 2, 3))(q, k, v, bias))
  bs = BlockSizes(8, 384, 8, 384, variants=Variants(kv_compute=128))
  ours = lambda q, k, v, bias: flash_attention(q, k, v, bias=bias, dropout_rate=0.2,
                                               dropout_rng=key, backend="pallas_tpu",
                                               block_sizes=bs, **kw)
  got = (ours(q, k, v, bias), *jax.grad(loss(ours), (0, 1, 2, 3))(q, k, v, bias))
  for which, a, r in zip(("o", "dq", "dk", "dv", "dbias"), got, want):
    assert rel_err(a, r) < 2e-3, (which, rel_err(a, r))


def test_kv_compute_must_be_a_multiple_of_128():
  from pallas_ring.kernels.pallas_tpu import Variants
  with pytest.raises(ValueError, match=r"kv_compute=100 .*multiple of 128"):
    Variants(kv_compute=100)


def test_tiles_split_to_fit_vmem_match_the_reference(monkeypatch):
  """Tiles too large for the chip's VMEM are split (``_fit``: the plan refined, each tile's
  class repeated over its parts): with a chip of 3.2 MiB named, 256 x 256 tiles run as smaller
  ones in every pass, with the same results as the reference (interpret mode; documents, so that
  refined PARTIAL tiles hold empty and full parts)."""
  from pallas_ring import BlockSizes
  from pallas_ring.kernels import pallas_tpu
  monkeypatch.setattr(pallas_tpu.tiles, "_chip", lambda like: (int(3.2 * 2**20), "a test chip"))
  seen, fit = [], pallas_tpu.tiles._fit
  monkeypatch.setattr(pallas_tpu.tiles, "_fit", lambda *a: (lambda r: (seen.append(r), r)[1])(fit(*a)))
  b, t, n, kh, h = 1, 600, 2, 1, 64
  rng = np.random.default_rng(5)
  q, k, v, do = (jnp.asarray(rng.standard_normal(s), jnp.float32)
                 for s in ((b, t, n, h), (b, t, kh, h), (b, t, kh, h), (b, t, n, h)))
  kw = dict(mask=masks.Causal(), segment_ids=jnp.asarray(np.arange(t)[None] // 230, jnp.int32))
  ours = lambda *a: flash_attention(*a, backend="pallas_tpu", block_sizes=BlockSizes(
      256, 256, 256, 256), **kw)
  ref = lambda *a: reference.attention(*a, **kw)[0]
  loss = lambda f: lambda *a: jnp.sum(f(*a) * do)
  got = (ours(q, k, v), *jax.grad(loss(ours), (0, 1, 2))(q, k, v))
  want = (ref(q, k, v), *jax.grad(loss(ref), (0, 1, 2))(q, k, v))
  for which, a, r in zip(("o", "dq", "dk", "dv"), got, want):
    assert rel_err(a, r) < 2e-3, (which, rel_err(a, r))
  tiles = {(c.block_q, c.block_kv, c.block_q_bwd, c.block_kv_bwd)
           for c in (p.kernel.keywords["cfg"] for p, _ in seen)}
  assert all(v.fits() for _, v in seen) and (256, 256, 256, 256) not in tiles, tiles
