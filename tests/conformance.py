"""The conformance suite every backend's tests inherit: its capability flags are its support
matrix.

A backend's test module declares one class, e.g.::

    class TestXla(Conformance):
      backend = "xla"

and runs every case of the mixins below against the dense reference. A feature a backend does not
serve (a flag set to False) is not skipped: ``requires`` asserts that asking for it raises the
error that names it, so the declaration is checked both ways.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_ring import flash_attention
from test_attention import EdgeCases, FlashCases, NumericsCases
from test_extras import ExtrasCases


def _feature_call(feature: str) -> dict:
  """The smallest keyword arguments of ``flash_attention`` that use ``feature``."""
  return {"dense_mask": dict(dense_mask=np.ones((1, 1, 128, 128), bool)),
          "bias": dict(bias=np.zeros((128, 128), np.float32)),
          "alibi": dict(alibi_slopes=np.ones(2, np.float32)),
          "dropout": dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)),
          "float32": dict(dtype=jnp.float32)}[feature]


class Conformance(FlashCases, EdgeCases, NumericsCases, ExtrasCases):
  """Every case, for ``backend``; the flags say what it serves."""

  backend: str  # the backend= name under test
  dense_mask = True  # dense boolean masks
  bias = True  # additive bias (and its gradient)
  alibi = True  # ALiBi slopes
  dropout = True  # attention dropout
  float32 = True  # float32 inputs (False: float32 cases run in bfloat16, see conftest)

  def requires(self, *features: str) -> bool:
    """Whether this backend serves every one of ``features``; for each it does not, asserts that
    an explicit request names the missing feature (``cannot serve this call``)."""
    missing = [f for f in features if not getattr(self, f)]
    for f in missing:
      kw = _feature_call(f)
      x = jnp.ones((1, 128, 2, 64), kw.pop("dtype", jnp.bfloat16))
      with pytest.raises(ValueError, match="cannot serve this call"):
        flash_attention(x, x, x, backend=self.backend, **kw)
    return not missing
