"""The optional operands' declarations (``pallas_ring.operands``): every declared operand is a
keyword of every entry point that takes it, and the axis roles give each strategy its layout."""

import inspect

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from pallas_ring import decode_attention, flash_attention, operands, reference, ring_attention
from pallas_ring import sharded_attention


@pytest.mark.parametrize("fn", [flash_attention, ring_attention, sharded_attention,
                                reference.attention])
def test_every_declared_operand_is_a_keyword(fn):
  params = inspect.signature(fn).parameters
  for o in operands.DECLARED:
    assert o.argument in params or not o.keyword, (fn.__name__, o.argument)


def test_decode_takes_the_operands_without_a_key_axis():
  params = inspect.signature(decode_attention).parameters
  for o in (o for o in operands.DECLARED if o.keyword):
    assert (o.argument in params) == (operands.KEYS not in o.axes), o.argument


def test_normalize_specs_and_padding():
  d = operands.Dims(b=2, n=4, t=6, s=10)
  terms = operands.normalize(dict(bias=jnp.ones((4, 6, 10)), alibi_slopes=jnp.ones((2, 4)),
                                  sinks=jnp.zeros(4), dense_mask=None), d)
  assert sorted(terms) == ["alibi", "bias", "sinks"]
  assert terms["bias"].shape == (1, 4, 6, 10) and terms["alibi"].shape == (2, 4, 1)
  specs = operands.specs(terms, batch="dp", heads="tp", rows="sp")
  assert specs == {"bias": P(None, "tp", "sp", None), "alibi": P("dp", "tp", None),
                   "sinks": P("tp")}
  padded = operands.pad(terms, queries=8, keys=16)
  assert padded["bias"].shape == (1, 4, 8, 16) and padded["alibi"].shape == (2, 4, 1)
  assert sorted(operands.in_kernel(terms)) == ["alibi", "bias"]
  assert operands.repeat_batch(operands.in_kernel(terms), 3)["alibi"].shape == (6, 4, 1)


def test_differentiating_alibi_slopes_raises():
  """ALiBi slopes have no gradient: differentiating them raises (naming them and the fixes)
  instead of giving zeros; the gradients of q, k, v with constant slopes are unaffected."""
  q = jax.random.normal(jax.random.key(0), (1, 12, 2, 8))
  loss = lambda q, a: jnp.sum(flash_attention(q, q, q, alibi_slopes=a) ** 2)
  a = jnp.full((2,), 0.3)
  ref = jax.grad(lambda q: jnp.sum(reference.attention(q, q, q, alibi_slopes=a)[0] ** 2))(q)
  got = jax.jit(jax.grad(loss))(q, a)
  assert jnp.linalg.norm(got - ref) <= 1e-4 * jnp.linalg.norm(ref)
  with pytest.raises(NotImplementedError, match=r"`alibi_slopes` is differentiated.*stop_grad"):
    jax.grad(loss, argnums=1)(q, a)
  assert not jnp.any(jax.grad(lambda a: loss(q, jax.lax.stop_gradient(a)))(a))


def test_bad_operands_name_the_argument():
  d = operands.Dims(b=2, n=4, t=6, s=10)
  with pytest.raises(ValueError, match="`alibi_slopes` has shape"):
    operands.normalize(dict(alibi_slopes=jnp.ones(3)), d)
  with pytest.raises(ValueError, match="`bias` has shape"):
    operands.normalize(dict(bias=jnp.ones((3, 6, 10))), d)
  with pytest.raises(ValueError, match="`sinks` has shape"):
    operands.normalize(dict(sinks=jnp.ones(5)), d)
  with pytest.raises(TypeError, match="`bias` has dtype"):
    operands.normalize(dict(bias=jnp.ones((6, 10), jnp.int32)), d)
