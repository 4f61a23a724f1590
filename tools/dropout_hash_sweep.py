"""Times candidate per-element dropout hashes in the Triton kernel (one GPU run, one table).

Each variant replaces ``kernels.common.dropout_keep`` for the run (caches cleared between
variants); the library ships one. Prints, per variant, causal T=16k forward and forward+backward
time with dropout 0.1 against the same call without dropout (H100 target: <= 1.15x).

  PYTHONPATH=. python3 tools/dropout_hash_sweep.py
"""

from __future__ import annotations

import jax
from jax import lax
import numpy as np

from pallas_ring import masks
from pallas_ring.attention import flash_attention
from pallas_ring.bench import _fwd_bwd, _inputs, timeit
from pallas_ring.kernels import common

M = np.int32(-1640531535)  # 0x9e3779b1


def xorshift_mul(rate, row, col):  # add, xorshift, multiply, compare
  x = row + col
  x = (x ^ lax.shift_right_logical(x, np.int32(15))) * M
  return x >= np.int32(common.keep_threshold(rate))


def row_odd_mad(rate, row, col):  # one multiply-add, compare
  odd = row | np.int32(1)
  return col * odd + row * odd >= np.int32(common.keep_threshold(rate))


VARIANTS = {"xorshift_mul": xorshift_mul, "row_odd_mad": row_odd_mad}


def main():
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
  q, k, v, do = _inputs(1, 16384, 16, 128, seed=4)
  key = jax.random.key(0)
  shipped = common.dropout_keep
  results = {}
  for name, fn in [("none", None)] + list(VARIANTS.items()):
    jax.clear_caches()
    common.dropout_keep = fn or shipped
    kw = {} if fn is None else dict(dropout_rate=0.1, dropout_rng=key)
    f = lambda q_, k_, v_, kw=kw: flash_attention(q_, k_, v_, mask=masks.Causal(), **kw)
    results[name] = (timeit(jax.jit(f), q, k, v), timeit(_fwd_bwd(f), q, k, v, do))
    print(f"{name:14s} fwd {results[name][0] * 1e3:7.3f} ms  fwd+bwd {results[name][1] * 1e3:7.3f}"
          f" ms  ratio {results[name][0] / results['none'][0]:.3f} / "
          f"{results[name][1] / results['none'][1]:.3f}", flush=True)
  common.dropout_keep = shipped


if __name__ == "__main__":
  main()
