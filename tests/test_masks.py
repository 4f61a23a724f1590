import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_ring import masks
from pallas_ring.masks import BlockBounds

SPECS = [masks.Full(), masks.Causal(), masks.SlidingWindow(3), masks.SlidingWindow(2, 5),
         masks.ChunkedCausal(4), masks.PrefixLM(5),
         masks.Causal() & masks.SlidingWindow(6), masks.PrefixLM(3) | masks.ChunkedCausal(5)]


def test_elementwise_definitions():
  q, k = np.arange(12)[:, None], np.arange(12)[None, :]
  np.testing.assert_array_equal(masks.Causal().visible(q, k), k <= q)
  np.testing.assert_array_equal(masks.SlidingWindow(2, 1).visible(q, k), (k >= q - 2) & (k <= q + 1))
  np.testing.assert_array_equal(masks.ChunkedCausal(4).visible(q, k), (q // 4 == k // 4) & (k <= q))
  np.testing.assert_array_equal(masks.PrefixLM(3).visible(q, k), (k < 3) | (k <= q))
  np.testing.assert_array_equal(masks.Full().visible(q, k), np.ones((12, 12), bool))
  even = masks.Custom(lambda a, b: (a + b) % 2 == 0)
  np.testing.assert_array_equal(even.visible(q, k), (q + k) % 2 == 0)
  both = masks.Causal() & masks.SlidingWindow(2)
  np.testing.assert_array_equal(both.visible(q, k), (k <= q) & (k >= q - 2))
  either = masks.PrefixLM(2) | masks.SlidingWindow(0, 1)
  np.testing.assert_array_equal(either.visible(q, k), (k < 2) | (k <= q) | (k <= q + 1) & (k >= q))


def test_specs_are_hashable_and_jit_static():
  assert hash(masks.Causal()) == hash(masks.Causal())
  assert masks.SlidingWindow(4) == masks.SlidingWindow(4, 0)
  assert masks.SlidingWindow(4) != masks.SlidingWindow(5)
  assert len({masks.Causal() & masks.PrefixLM(2), masks.Causal() & masks.PrefixLM(2)}) == 1

  @jax.jit
  def count(x, spec=masks.Causal()):
    return jnp.sum(spec.visible(x[:, None], x[None, :]))

  f = jax.jit(lambda x, spec: jnp.sum(spec.visible(x[:, None], x[None, :])), static_argnums=1)
  x = jnp.arange(8)
  assert int(f(x, masks.Causal())) == 36
  assert int(f(x, masks.SlidingWindow(1))) == 15


def test_bool_raises():
  with pytest.raises(TypeError, match="ambiguous"):
    bool(masks.Causal())
  with pytest.raises(TypeError, match="&"):
    _ = masks.Causal() and masks.Full()


def test_combining_with_non_spec_raises():
  with pytest.raises(TypeError, match="dense_mask"):
    _ = masks.Causal() & np.ones((4, 4), bool)


@pytest.mark.ci_cases(every=True)
@pytest.mark.parametrize("ctor, match", [
    (lambda: masks.SlidingWindow(-1), "left=-1"),
    (lambda: masks.SlidingWindow(2, -3), "right=-3"),
    (lambda: masks.ChunkedCausal(0), "chunk=0"),
    (lambda: masks.PrefixLM(-2), "prefix=-2"),
])
def test_invalid_parameters(ctor, match):
  with pytest.raises(ValueError, match=match):
    ctor()


def test_non_int_parameter_raises_type_error():
  with pytest.raises(TypeError, match="int"):
    masks.SlidingWindow(2.5)
  with pytest.raises(TypeError, match="callable"):
    masks.Custom(3)


@pytest.mark.ci_cases(every=True)
@pytest.mark.parametrize("spec", SPECS, ids=repr)
def test_block_test_sound_and_exact_on_contiguous_blocks(spec):
  """Every pair of contiguous blocks in [0, 14): any/all equal brute force for primitive specs
  (exactness), and are sound for combinations."""
  n = 14
  pos = np.arange(n)
  vis = np.asarray(spec.visible(pos[:, None], pos[None, :]), bool)
  spans = [(a, b) for a in range(n) for b in range(a, n)]
  quads = np.array([(q0, q1, k0, k1) for (q0, q1), (k0, k1) in itertools.product(spans, spans)])
  any_bf = np.array([vis[q0:q1 + 1, k0:k1 + 1].any() for q0, q1, k0, k1 in quads])
  all_bf = np.array([vis[q0:q1 + 1, k0:k1 + 1].all() for q0, q1, k0, k1 in quads])
  col = lambda i: jnp.asarray(quads[:, i], jnp.int32)
  a, f = spec.block_test(BlockBounds(col(0), col(1)), BlockBounds(col(2), col(3)))
  a, f = np.asarray(a), np.asarray(f)
  assert not np.any(any_bf & ~a), quads[any_bf & ~a][:3]  # never EMPTY with a visible pair
  assert not np.any(~all_bf & f), quads[~all_bf & f][:3]  # never FULL with a masked pair
  if not isinstance(spec, (masks.And, masks.Or)):
    np.testing.assert_array_equal(a, any_bf)
    np.testing.assert_array_equal(f, all_bf)


def test_custom_block_fn_is_used():
  spec = masks.Custom(lambda q, k: k <= q, block_fn=lambda ql, qh, kl, kh: (kl <= qh, kh <= ql))
  a, f = spec.block_test(BlockBounds(jnp.int32(0), jnp.int32(3)), BlockBounds(jnp.int32(8), jnp.int32(9)))
  assert not bool(a) and not bool(f)
  default = masks.Custom(lambda q, k: k <= q)
  a, f = default.block_test(BlockBounds(jnp.int32(0), jnp.int32(3)), BlockBounds(jnp.int32(8), jnp.int32(9)))
  assert bool(a) and not bool(f)  # no block_fn: always partial (sound, no skipping)


def test_anonymous_custom_function_warns_once():
  import warnings
  from pallas_ring import masks as masks_mod
  masks_mod._WARNED_ANONYMOUS = False
  with pytest.warns(UserWarning, match=r"Define the function once at module level") as rec:
    masks.Custom(lambda q, k: k <= q)
  assert rec[0].filename == __file__  # the caller's line, not the dataclass's generated code
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    masks.Custom(lambda q, k: k <= q)  # once per process


def test_window_width_bounds_every_row():
  """``window_width``: the narrowest sliding window bounding every query's keys (a bound: the
  widest row of the elementwise mask sees at most that many keys besides its own)."""
  cases = [(masks.SlidingWindow(5), 5), (masks.Causal() & masks.SlidingWindow(7, 2), 9),
           (masks.SlidingWindow(3) & masks.SlidingWindow(9, 1), 3), (masks.Causal(), None),
           (masks.ChunkedCausal(4), None), (masks.SlidingWindow(2) | masks.Causal(), None)]
  pos = jnp.arange(40)
  for spec, width in cases:
    assert masks.window_width(spec) == width
    widest = int(spec.visible(pos[:, None], pos[None, :]).sum(axis=1).max())
    assert width is None or widest <= width + 1


@pytest.mark.parametrize("spec", SPECS + [masks.Causal() | masks.SlidingWindow(2, 3),
                                          masks.SlidingWindow(9, 1) & masks.SlidingWindow(4, 6)])
def test_key_bounds_hold_for_every_visible_pair(spec):
  """``key_bounds``: every visible key lies within ``[q - left, q + right]`` (the decode kernel
  reads nothing outside); bounded exactly where the spec's structure says so."""
  left, right = masks.key_bounds(spec)
  pos = jnp.arange(-20, 40)
  q, k = np.meshgrid(pos, pos, indexing="ij")
  vis = np.asarray(spec.visible(jnp.asarray(q), jnp.asarray(k)))
  assert left is None or not np.any(vis & (k < q - left))
  assert right is None or not np.any(vis & (k > q + right))
  if isinstance(spec, masks.SlidingWindow):
    assert (left, right) == (spec.left, spec.right)
  if isinstance(spec, masks.Causal):
    assert (left, right) == (None, 0)
