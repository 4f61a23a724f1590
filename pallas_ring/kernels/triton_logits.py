"""The matmuls and base-2 logits that the Triton kernels (``pallas_triton`` and
``pallas_triton_decode``) share."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_ring.kernels import common


def dot_nt(a, b):
  """``a @ b.T`` in float32."""
  return jnp.dot(a, b.T, preferred_element_type=jnp.float32)


def dot(a, b):
  """``a @ b`` in float32."""
  return jnp.dot(a, b, preferred_element_type=jnp.float32)


def logits2(q, k, cfg):
  """Base-2 logits ``[bq, bk]``: natural (soft-capped) logits times log2(e)."""
  if cfg.softcap is None:
    return dot_nt(q, k) * (cfg.scale * common.LOG2E)  # one multiply per logit
  s = dot_nt(q, k) * cfg.scale
  return (cfg.softcap * common.LOG2E) * jnp.tanh(s / cfg.softcap)
