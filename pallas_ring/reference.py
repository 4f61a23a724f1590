"""Dense reference attention: the definition every backend is tested against.

Materialises the ``[B, N, T, S]`` logits, so use it only at test sizes. Computes in float32 (or
float64 for float64 inputs when x64 is enabled). Rows with no visible key give output 0 and
lse ``-inf``; their gradients are 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_ring import masks as masks_lib


def visibility(mask: masks_lib.MaskSpec, q_positions, kv_positions, segment_ids=None,
               kv_segment_ids=None, dense_mask=None):
  """Dense bool visibility ``[B|1, N|1, T, S]`` from positions, segments and a dense mask."""
  qp = jnp.asarray(q_positions)
  kp = jnp.asarray(kv_positions)
  qp = qp[None] if qp.ndim == 1 else qp
  kp = kp[None] if kp.ndim == 1 else kp
  vis = mask.visible(qp[:, None, :, None], kp[:, None, None, :])
  if segment_ids is not None:
    vis = vis & (segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :])
  if dense_mask is not None:
    vis = vis & jnp.asarray(dense_mask, bool)
  return vis


def attention(q, k, v, *, mask=None, segment_ids=None, kv_segment_ids=None, q_positions=None,
              kv_positions=None, dense_mask=None, sinks=None, softcap=None, scale=None, bias=None,
              alibi_slopes=None, dropout_rate=0.0, dropout_mask=None):
  """Dense attention with the semantics of ``pallas_ring.flash_attention``.

  Args:
    q: ``[B, T, N, H]`` queries.
    k: ``[B, S, K, H]`` keys, ``N % K == 0``; v: ``[B, S, K, Hv]`` values (``Hv`` may differ).
    mask: a mask spec (default Full) in global positions.
    segment_ids, kv_segment_ids: ``[B, T]`` / ``[B, S]`` int document ids.
    q_positions, kv_positions: ``[T]`` / ``[S]`` (or ``[B, .]``) positions; default arange.
    dense_mask: bool broadcastable to ``[B, N, T, S]``, True = attend.
    sinks: ``[N]`` per-head sink logits, counted once in each row's denominator.
    softcap: logit soft-cap ``cap * tanh(s / cap)``.
    scale: logit scale, default ``H ** -0.5``.
    bias: additive logit bias broadcastable to ``[B, N, T, S]``.
    alibi_slopes: ``[N]`` or ``[B, N]``: ``-slope * |q_pos - k_pos|`` is added to the logits.
    dropout_rate, dropout_mask: bool keep mask broadcastable to ``[B, N, T, S]`` (e.g.
      ``pallas_ring.dropout_keep_mask``); kept weights are scaled by ``1 / (1 - rate)``.

  Returns:
    ``(out [B, T, N, Hv] in q.dtype, lse [B, N, T] in the compute dtype, natural log)``.
  """
  mask = masks_lib.as_spec(mask)
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  g = n // kh
  ctype = jnp.promote_types(q.dtype, jnp.float32)
  scale = h ** -0.5 if scale is None else scale
  if q_positions is None:
    q_positions = jnp.arange(t, dtype=jnp.int32)
  if kv_positions is None:
    kv_positions = jnp.arange(s, dtype=jnp.int32)
  if segment_ids is not None and kv_segment_ids is None:
    kv_segment_ids = segment_ids
  vis = visibility(mask, q_positions, kv_positions, segment_ids, kv_segment_ids, dense_mask)
  vis = jnp.broadcast_to(vis, (b, n, t, s)).reshape(b, kh, g, t, s)

  qf = q.astype(ctype).reshape(b, t, kh, g, h)
  logits = jnp.einsum("btkgh,bskh->bkgts", qf, k.astype(ctype),
                      precision=jax.lax.Precision.HIGHEST) * scale
  if softcap is not None:
    logits = softcap * jnp.tanh(logits / softcap)
  if bias is not None:
    logits = logits + jnp.broadcast_to(jnp.asarray(bias, ctype), (b, n, t, s)).reshape(
        b, kh, g, t, s)
  if alibi_slopes is not None:
    qp = jnp.asarray(q_positions, ctype)
    kp = jnp.asarray(kv_positions, ctype)
    qp = qp[None] if qp.ndim == 1 else qp  # [B|1, T]
    kp = kp[None] if kp.ndim == 1 else kp
    dist = jnp.abs(qp[:, None, :, None] - kp[:, None, None, :])  # [B|1, 1, T, S]
    sl = jnp.asarray(alibi_slopes, ctype)
    sl = jnp.broadcast_to(sl[None] if sl.ndim == 1 else sl, (b, n))[:, :, None, None]
    logits = logits - (sl * dist).reshape(b, kh, g, t, s)
  masked = jnp.where(vis, logits, -jnp.inf)
  m = jnp.max(masked, axis=-1, keepdims=True)
  if sinks is not None:
    sk = jnp.asarray(sinks, ctype).reshape(1, kh, g, 1, 1)
    m = jnp.maximum(m, sk)
  m_safe = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
  p = jnp.where(vis, jnp.exp(logits - m_safe), 0.0)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  if sinks is not None:
    denom = denom + jnp.exp(sk - m_safe)
  empty = denom == 0
  denom_safe = jnp.where(empty, 1.0, denom)
  w = p / denom_safe
  if dropout_mask is not None:
    keep = jnp.broadcast_to(jnp.asarray(dropout_mask, bool), (b, n, t, s)).reshape(b, kh, g, t, s)
    w = jnp.where(keep, w / (1.0 - dropout_rate), 0.0)
  out = jnp.einsum("bkgts,bskh->btkgh", w, v.astype(ctype), precision=jax.lax.Precision.HIGHEST)
  lse = jnp.where(empty, -jnp.inf, m_safe + jnp.log(denom_safe))[..., 0]
  return out.reshape(b, t, n, v.shape[-1]).astype(q.dtype), lse.reshape(b, n, t)


__all__ = ["attention", "visibility"]
