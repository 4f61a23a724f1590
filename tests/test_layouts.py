import jax.numpy as jnp
import numpy as np
import pytest

from pallas_ring import layouts

# Literal tables: rank -> global positions it holds, T=16, R=4.
TABLES = {
    "contiguous": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
    "zigzag": [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]],
    "striped": [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]],
}


@pytest.mark.parametrize("layout", list(TABLES))
def test_positions_table(layout):
  for rank, expected in enumerate(TABLES[layout]):
    np.testing.assert_array_equal(layouts.positions(16, layout, 4, rank), expected)
  np.testing.assert_array_equal(layouts.positions(16, layout, 4), np.concatenate(TABLES[layout]))


def test_zigzag_two_ranks_table():
  np.testing.assert_array_equal(layouts.positions(8, "zigzag", 2),
                                [0, 1, 6, 7, 2, 3, 4, 5])


@pytest.mark.ci_cases(every=True)
@pytest.mark.parametrize("layout", list(TABLES))
@pytest.mark.parametrize("t, r", [(8, 1), (8, 2), (48, 4), (64, 8)])
def test_one_rank_agrees_with_the_global_order(layout, t, r):
  """One rank's positions (computed by arithmetic) are that rank's slice of the layout order."""
  order = np.asarray(layouts.positions(t, layout, r)).reshape(r, t // r)
  for rank in range(r):
    np.testing.assert_array_equal(layouts.positions(t, layout, r, rank), order[rank])


@pytest.mark.parametrize("layout", list(TABLES))
def test_permute_places_tokens_and_unpermute_inverts(layout):
  x = jnp.arange(2 * 16 * 3).reshape(2, 16, 3)
  y = layouts.permute(x, layout, 4)
  np.testing.assert_array_equal(y[0, :, 0] // 3, np.concatenate(TABLES[layout]))
  np.testing.assert_array_equal(layouts.unpermute(y, layout, 4), x)
  z = layouts.permute(x, layout, 4, axis=1)
  np.testing.assert_array_equal(z, y)


def test_traced_rank():
  import jax
  f = jax.jit(lambda r: layouts.positions(16, "zigzag", 4, r))
  np.testing.assert_array_equal(f(2), [4, 5, 10, 11])


@pytest.mark.parametrize("layout, t, r, match", [
    ("zigzag", 12, 4, "multiple of 2R"),
    ("contiguous", 10, 4, "multiple of R"),
    ("striped", 9, 2, "multiple of R"),
])
def test_indivisible_length(layout, t, r, match):
  with pytest.raises(ValueError, match=match):
    layouts.positions(t, layout, r)


def test_unknown_layout():
  with pytest.raises(ValueError, match="'snake'.*contiguous"):
    layouts.positions(8, "snake", 2)


@pytest.mark.ci_cases(every=True)
@pytest.mark.parametrize("call, error, match", [
    (lambda: layouts.positions(8, "zigzag", 2, np.int32(5)), ValueError, "`rank`=5 is not a rank"),
    (lambda: layouts.positions(8, "zigzag", 2, jnp.int32(2)), ValueError, "`rank`=2 is not a rank"),
    (lambda: layouts.positions(8, "zigzag", 2, 1.0), TypeError, "must be an integer scalar"),
    (lambda: layouts.positions(8, "zigzag", 2.0), ValueError, "ring_size=2.0 must be an int"),
    (lambda: layouts.permute(np.arange(8), "zigzag", 2), ValueError,
     r"permute: `axis`=1 is not an axis of x, whose shape is \(8,\)"),
    (lambda: layouts.unpermute(np.zeros((1, 8)), "zigzag", 2, axis=3), ValueError,
     r"unpermute: `axis`=3 is not an axis"),
], ids=["numpy_rank", "jax_rank", "float_rank", "float_ring", "one_dim", "axis_out_of_range"])
def test_mistakes_name_the_argument(call, error, match):
  """A concrete rank outside the ring (a jax scalar too: it returned negative positions), a
  float ring size or an axis x lacks raise naming it."""
  with pytest.raises(error, match=match):
    call()


def test_an_explicitly_sharded_array_keeps_its_sharding():
  """permute / unpermute (and a Placement's) of an array sharded over an Explicit mesh, eager and
  jitted, outside ``jax.set_mesh``: the values of the numpy reorder, the array's sharding."""
  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = jax.make_mesh((2,), ("sp",), devices=jax.devices()[:2])
  x = np.arange(32.0).reshape(1, 16, 2)
  xs = jax.device_put(x, NamedSharding(mesh, P(None, "sp")))
  placed = layouts.balance(np.repeat(np.arange(3), [8, 6, 2])[None].astype(np.int32), 2)
  for reorder, inverse in [(lambda a: layouts.permute(a, "zigzag", 2),
                            lambda a: layouts.unpermute(a, "zigzag", 2)),
                           (placed.permute, placed.unpermute)]:
    for run in (lambda f, a: f(a), lambda f, a: jax.jit(f)(a)):
      y = run(reorder, xs)
      np.testing.assert_array_equal(y, reorder(x))
      assert y.sharding.spec[:2] == (None, "sp")
      np.testing.assert_array_equal(run(inverse, y), x)
