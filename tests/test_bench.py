"""The benchmark's timing helpers (the GPU benchmarks themselves run on GPUs only)."""

import jax.numpy as jnp

from pallas_ring import bench


def test_interleaved_timing_calls_every_implementation_alike():
  calls = []

  def make(name):
    def f(x):
      calls.append(name)
      return x + 1
    return f

  res = bench.timeit_interleaved({"a": (make("a"), (jnp.ones(3),)),
                                  "b": (make("b"), (jnp.ones(3),))}, iters=3, reps=4)
  assert set(res) == {"a", "b"} and all(t > 0 for t in res.values())
  # Two warm-up calls each, then the repetitions alternate: a a a b b b a a a b b b ...
  assert calls[:4] == ["a", "a", "b", "b"]
  assert calls[4:] == (["a"] * 3 + ["b"] * 3) * 4


def test_visible_pairs_of_each_mask_kind():
  assert bench.visible_pairs(8, "full") == 64
  assert bench.visible_pairs(8, "causal") == 36
  assert bench.visible_pairs(8, "window", window=2) == 1 + 2 + 3 * 6
  assert bench.visible_pairs(8, "documents", doc=4) == 2 * 10
