"""Dense masks that cannot mean what the caller meant are refused, or poison the output under jit.

* A mask built in natural token order (Flax's ``nn.make_causal_mask``) over tokens in zigzag or
  striped order: eager calls raise naming the argument and the fix; under ``jit`` (values unknown
  while tracing) the output is NaN. A mask built in layout order (or permuted into it) is right.
* A float mask with values other than 0 / 1 (an additive ``0 / -inf`` mask): eager calls raise,
  jitted ones return NaN; float 0 / 1 masks (as Flax builds them) keep working.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import flax.linen as nn

import pallas_ring
from pallas_ring import SequenceParallelConfig, layouts, masks
from pallas_ring.nn import RingAttention, make_attention_fn
from conftest import rel_err

B, T, N, H, D, R = 2, 16, 2, 8, 16, 4


def _qkv(seed=0):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32) for _ in range(3)]


def _mesh():
  return jax.make_mesh((R,), ("sp",))


@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_sharded_attention_refuses_a_natural_order_mask_under_a_permuting_layout(layout):
  q, k, v = _qkv()
  mesh, cfg = _mesh(), SequenceParallelConfig(axis_name="sp", layout=layout, backend="xla")
  natural = nn.make_causal_mask(jnp.ones((B, T)))  # float32 [B, 1, T, T], natural order
  with pytest.raises(ValueError, match=r"(?s)`dense_mask` is lower-triangular.*layout="
                     rf"'{layout}'.*masks\.Causal\(\).*layouts\.permute"):
    pallas_ring.sharded_attention(q, k, v, mesh=mesh, config=cfg, dense_mask=natural)
  run = jax.jit(lambda m: pallas_ring.sharded_attention(q, k, v, mesh=mesh, config=cfg,
                                                        dense_mask=m, return_lse=True))
  out, lse = run(natural)
  assert np.isnan(np.asarray(out)).all() and np.isnan(np.asarray(lse)).all()
  # Right: the causal mask in layout order (permuted on both token axes), equal to the spec.
  permuted = layouts.permute(layouts.permute(natural, layout, R, axis=-1), layout, R, axis=-2)
  ref = pallas_ring.sharded_attention(q, k, v, mesh=mesh, config=cfg, mask=masks.Causal())
  out, _ = run(permuted)
  assert rel_err(out, ref) < 1e-6
  eager = pallas_ring.sharded_attention(q, k, v, mesh=mesh, config=cfg, dense_mask=permuted)
  assert rel_err(eager, ref) < 1e-6


def test_a_contiguous_ring_takes_a_natural_order_mask():
  """Contiguous layout: natural order is layout order, nothing to refuse."""
  q, k, v = _qkv(1)
  mesh, cfg = _mesh(), SequenceParallelConfig(axis_name="sp", backend="xla")
  natural = nn.make_causal_mask(jnp.ones((B, T)))
  out = jax.jit(lambda m: pallas_ring.sharded_attention(q, k, v, mesh=mesh, config=cfg,
                                                        dense_mask=m))(natural)
  ref = pallas_ring.sharded_attention(q, k, v, mesh=mesh, config=cfg, mask=masks.Causal())
  assert rel_err(out, ref) < 1e-6


def test_ring_attention_refuses_flax_make_causal_mask_on_a_zigzag_ring():
  """The issue's case: RingAttention on a zigzag ring given Flax's natural-order causal mask."""
  x = jnp.asarray(np.random.default_rng(2).standard_normal((B, T, D)), jnp.float32)
  cfg = SequenceParallelConfig(axis_name="sp", layout="zigzag", backend="xla")
  ring = RingAttention(num_heads=N, config=cfg, mesh=_mesh())
  params = ring.init(jax.random.key(0), x)
  causal = nn.make_causal_mask(jnp.ones((B, T)))
  with pytest.raises(ValueError, match=r"(?s)`mask` is lower-triangular.*masks\.Causal\(\)"):
    ring.apply(params, x, mask=causal)
  assert np.isnan(np.asarray(jax.jit(ring.apply)(params, x, mask=causal))).all()


def test_an_additive_float_mask_raises_eagerly_and_poisons_under_jit():
  q, k, v = _qkv(3)
  mesh, cfg = _mesh(), SequenceParallelConfig(axis_name="sp", backend="xla")
  causal = nn.make_causal_mask(jnp.ones((B, T)))  # float 0 / 1, Flax's convention
  additive = jnp.where(causal > 0, 0.0, -jnp.inf)  # 0 visible, -inf masked: belongs in `bias`
  with pytest.raises(ValueError, match=r"`dense_mask` has dtype float32 .* belongs in `bias`"):
    pallas_ring.sharded_attention(q, k, v, mesh=mesh, config=cfg, dense_mask=additive)
  run = jax.jit(lambda m: pallas_ring.sharded_attention(q, k, v, mesh=mesh, config=cfg,
                                                        dense_mask=m))
  assert np.isnan(np.asarray(run(additive))).all()
  ref = pallas_ring.sharded_attention(q, k, v, mesh=mesh, config=cfg, mask=masks.Causal())
  assert rel_err(run(causal), ref) < 1e-6  # float 0 / 1 still works under jit

  # Flax modules with make_attention_fn: Flax passes float 0 / 1 masks; an additive one is loud.
  x = jnp.asarray(np.random.default_rng(4).standard_normal((B, T, D)), jnp.float32)
  stock = nn.MultiHeadDotProductAttention(num_heads=N)
  ours = nn.MultiHeadDotProductAttention(num_heads=N, attention_fn=make_attention_fn())
  params = stock.init(jax.random.key(0), x)
  apply = jax.jit(ours.apply)
  assert rel_err(apply(params, x, mask=causal), stock.apply(params, x, mask=causal)) < 1e-5
  assert np.isnan(np.asarray(apply(params, x, mask=additive))).all()
  with pytest.raises(ValueError, match=r"`mask` has dtype float32 .* belongs in `bias`"):
    ours.apply(params, x, mask=additive)


def test_flash_and_ring_attention_poison_an_additive_mask_under_jit():
  """The per-device entry points too: NaN for a traced additive mask, the right output for a
  traced float 0 / 1 mask."""
  q, k, v = _qkv(5)
  causal = jnp.tril(jnp.ones((T, T), jnp.float32))
  additive = jnp.where(causal > 0, 0.0, -jnp.inf)
  flash = jax.jit(lambda m: pallas_ring.flash_attention(q, k, v, dense_mask=m, backend="xla"))
  assert np.isnan(np.asarray(flash(additive))).all()
  ref = pallas_ring.flash_attention(q, k, v, mask=masks.Causal(), backend="xla")
  assert rel_err(flash(causal), ref) < 1e-6
  mesh = jax.make_mesh((R,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
  spec = jax.sharding.PartitionSpec
  ring = jax.jit(jax.shard_map(
      lambda q_, k_, v_, m: pallas_ring.ring_attention(q_, k_, v_, axis_name="sp", dense_mask=m,
                                                       backend="xla"),
      mesh=mesh, in_specs=(spec(None, "sp"),) * 3 + (spec("sp"),),
      out_specs=spec(None, "sp"), check_vma=False))
  assert np.isnan(np.asarray(ring(q, k, v, additive))).all()
  assert rel_err(ring(q, k, v, causal), ref) < 1e-5
