"""A value head dim of its own (DeepSeek-style MLA, ``v [B, S, K, Hv]``) through the sequence-
parallel strategies and the Flax function; the single-device backends run it in the conformance
suite (``test_attention.CASES``) and decode in ``test_decode``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from pallas_ring import (SequenceParallelConfig, flash_attention, layouts, masks, reference,
                         sharded_attention)
from pallas_ring.nn import make_attention_fn
from conftest import rel_err

R = 4


def _problem(seed, b=1, t=64, n=4, kh=2, h=48, hv=32):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((b, t, kh, h)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((b, t, kh, hv)), jnp.float32)
  return q, k, v


def _with_grads(f, *args):
  """``(f(*args), gradients of sum(sin(f)) by every argument)`` in one compiled program."""
  grads = jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=tuple(range(len(args))))
  return jax.jit(lambda *a: (f(*a), grads(*a)))(*args)


@pytest.mark.parametrize("strategy, layout, hv", [("ring", "zigzag", 32), ("all_gather",
                                                  "contiguous", 64), ("ulysses", "striped", 32)])
def test_sharded_strategies_take_their_own_value_head_dim(strategy, layout, hv):
  """Output ``[B, T, N, Hv]`` and gradients of q, k, v against the dense reference, with the
  default scale ``H ** -0.5`` of q/k's head dim (Hv narrower and wider than H)."""
  q, k, v = _problem(1, hv=hv)
  mesh = jax.make_mesh((R,), ("sp",), axis_types=(AxisType.Auto,))
  cfg = SequenceParallelConfig(axis_name="sp", layout=layout, strategy=strategy, backend="xla")
  perm = lambda x: layouts.permute(x, layout, R)
  ours = lambda q_, k_, v_: layouts.unpermute(sharded_attention(
      perm(q_), perm(k_), perm(v_), mesh=mesh, config=cfg, mask=masks.Causal()), layout, R)
  ref = lambda q_, k_, v_: reference.attention(q_, k_, v_, mask=masks.Causal())[0]
  out, grads = _with_grads(ours, q, k, v)
  ref_out, ref_grads = _with_grads(ref, q, k, v)
  assert out.shape == q.shape[:3] + (hv,)
  assert rel_err(out, ref_out) < 1e-5
  for which, g, r in zip("qkv", grads, ref_grads):
    assert g.shape == r.shape and rel_err(g, r) < 1e-5, which


def test_flax_attention_fn_takes_its_own_value_head_dim():
  """``make_attention_fn`` as Flax calls it (``[B, T, N, H]`` projections), v narrower."""
  q, k, v = _problem(2, kh=4)
  fn = make_attention_fn(mask=masks.Causal())
  out = fn(q, k, v)
  ref = reference.attention(q, k, v, mask=masks.Causal())[0]
  assert out.shape == (1, 64, 4, 32) and rel_err(out, ref) < 1e-5


def test_k_and_v_that_disagree_beyond_the_head_dim_name_the_rule():
  q, k, _ = _problem(3)
  v = jnp.zeros((1, 63, 2, 32))
  with pytest.raises(ValueError, match=r"`k` and `v` must agree on \[batch, seq, kv_heads\]"):
    flash_attention(q, k, v, backend="xla")
