"""Flax adapters: the ``RingAttention`` linen module and ``make_attention_fn`` for stock modules.

``RingAttention`` has the parameters of ``flax.linen.MultiHeadDotProductAttention`` (``query``,
``key``, ``value``: DenseGeneral to ``[N, H]``; ``out``: DenseGeneral over ``(N, H)``), so
checkpoints load unchanged. It runs the ring (``shard_map``, ``ppermute`` in a scan) when a mesh
holding ``config.axis_name`` is given or active (``jax.set_mesh``), and ``flash_attention``
otherwise.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from pallas_ring import masks as masks_lib
from pallas_ring.attention import flash_attention
from pallas_ring.config import SequenceParallelConfig
from pallas_ring.sharded import sharded_attention

Array = Any


def _active_mesh(mesh, config: Optional[SequenceParallelConfig]):
  """The mesh to run the ring on, or None for single-device attention."""
  if config is None:
    return None
  if mesh is not None:
    return mesh if config.axis_name in mesh.axis_names else None
  ctx = jax.sharding.get_abstract_mesh()
  if ctx is not None and not ctx.empty and config.axis_name in ctx.axis_names:
    return ctx
  return None


def _attend(q, k, v, *, config, mesh, mask, dense_mask=None, segment_ids=None, positions=None):
  """Dispatches ``[..., T, N, H]`` q/k/v to the ring (mesh) or to flash_attention."""
  batch_shape = q.shape[:-3]
  flat = lambda x: None if x is None else x.reshape((-1,) + x.shape[len(batch_shape):])
  q, k, v = flat(q), flat(k), flat(v)
  if segment_ids is not None:
    segment_ids = segment_ids.reshape((-1,) + segment_ids.shape[len(batch_shape):])
  if dense_mask is not None:
    if dense_mask.ndim > 4:
      dense_mask = dense_mask.reshape((-1,) + dense_mask.shape[-3:])
    dense_mask = dense_mask.astype(bool) if dense_mask.dtype == bool else dense_mask != 0
  run_mesh = _active_mesh(mesh, config)
  cfg = config or SequenceParallelConfig()
  if run_mesh is not None:
    out = sharded_attention(q, k, v, mesh=run_mesh if mesh is not None else None, config=cfg,
                            mask=mask, segment_ids=segment_ids, positions=positions,
                            dense_mask=dense_mask)
  else:
    out = flash_attention(q, k, v, mask=mask, segment_ids=segment_ids, q_positions=positions,
                          kv_positions=positions if q.shape[1] == k.shape[1] else None,
                          dense_mask=dense_mask, block_sizes=cfg.block_sizes, backend=cfg.backend)
  return out.reshape(batch_shape + out.shape[1:])


def make_attention_fn(config: Optional[SequenceParallelConfig] = None,
                      mask: Optional[masks_lib.MaskSpec] = None, mesh=None) -> Callable:
  """An ``attention_fn`` for ``nn.MultiHeadDotProductAttention`` / ``nnx.MultiHeadAttention``.

  Args:
    config: sequence-parallel config; with a mesh holding ``config.axis_name`` (given here or
      active through ``jax.set_mesh``), attention runs as a ring over that axis and inputs must be
      in ``config.layout`` order.
    mask: a mask spec in global positions, ANDed with the dense mask the module passes.
    mesh: the mesh to run the ring on (None: the active mesh, if any).

  Returns:
    ``attention_fn(query, key, value, ...)`` naming every keyword both Flax modules pass.
  """
  spec = masks_lib.as_spec(mask)

  def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                   dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                   precision=None, module=None, force_fp32_for_softmax=False,
                   qk_attn_weights_einsum=None, attn_weights_value_einsum=None, is_causal=False):
    del broadcast_dropout, dropout_rng, precision, force_fp32_for_softmax  # fp32 softmax always
    if dropout_rate > 0.0 and not deterministic:
      raise NotImplementedError(
          f"pallas_ring attention has no attention-probability dropout (dropout_rate="
          f"{dropout_rate}, deterministic=False). Set dropout_rate=0.0 on the attention module "
          "(use dropout on its output instead) or run with deterministic=True.")
    if module is not None:
      raise NotImplementedError(
          "sow_weights=True needs the [T, S] attention weights, which pallas_ring never "
          "materialises. Call the module with sow_weights=False, or use the stock "
          "flax dot_product_attention to inspect weights.")
    if bias is not None or qk_attn_weights_einsum is not None or \
        attn_weights_value_einsum is not None:
      raise NotImplementedError(
          "pallas_ring attention supports no additive bias or custom einsums; express the bias "
          "as a mask spec / dense mask, or use the stock attention_fn.")
    m = spec & masks_lib.Causal() if is_causal else spec
    out = _attend(query, key, value, config=config, mesh=mesh, mask=m, dense_mask=mask)
    return out if dtype is None else out.astype(dtype)

  return attention_fn


class RingAttention(nn.Module):
  """Multi-head attention with ``MultiHeadDotProductAttention``'s parameters, on pallas_ring.

  Attributes:
    num_heads: number of attention heads.
    config: sequence-parallel config (axis, layout, strategy, blocks, backend).
    mask: mask spec in global positions (e.g. ``masks.Causal()``).
    mesh: mesh for the ring; None uses the mesh active through ``jax.set_mesh`` (if it holds
      ``config.axis_name``), else single-device ``flash_attention``.
    dtype: computation dtype (None: inferred from inputs and params), as in Flax.
    param_dtype: parameter dtype.
    qkv_features: q/k/v projection width (default: the input width).
    out_features: output width (default: the input width).
    kernel_init, bias_init, use_bias, out_kernel_init, out_bias_init: as in Flax.
    decode: must stay False (no KV cache; see the error's advice).
  """

  num_heads: int
  config: Optional[SequenceParallelConfig] = None
  mask: Optional[masks_lib.MaskSpec] = None
  mesh: Any = None
  dtype: Any = None
  param_dtype: Any = jnp.float32
  qkv_features: Optional[int] = None
  out_features: Optional[int] = None
  kernel_init: Callable = nn.linear.default_kernel_init
  out_kernel_init: Optional[Callable] = None
  bias_init: Callable = nn.initializers.zeros_init()
  out_bias_init: Optional[Callable] = None
  use_bias: bool = True
  decode: bool = False  # autoregressive decoding: not supported (raises)

  @nn.compact
  def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, segment_ids=None, positions=None,
               mask=None):
    """Attends ``inputs_q [..., T, D]`` to ``inputs_k`` / ``inputs_v`` (default: self-attention).

    Args:
      segment_ids: ``[B, T]`` document ids (layout order under a ring).
      positions: ``[T]`` / ``[B, T]`` global positions the mask compares (default: arange, or
        the layout's positions under a ring).
      mask: optional dense mask broadcastable to ``[B, N, T, S]`` (Flax convention, True/1 =
        attend), ANDed with ``self.mask``.
    """
    if self.decode:
      raise NotImplementedError(
          "RingAttention(decode=True): pallas_ring has no KV cache; it targets training and "
          "prefill of long sequences. Decode with flax.linen.MultiHeadDotProductAttention("
          "decode=True) on the same parameters (they load unchanged).")
    if inputs_k is None:
      inputs_k = inputs_q
    if inputs_v is None:
      inputs_v = inputs_k
    features = self.out_features or inputs_q.shape[-1]
    qkv_features = self.qkv_features or inputs_q.shape[-1]
    if qkv_features % self.num_heads:
      raise ValueError(f"qkv_features={qkv_features} must be divisible by num_heads="
                       f"{self.num_heads}.")
    head_dim = qkv_features // self.num_heads
    dense = functools.partial(
        nn.DenseGeneral, axis=-1, dtype=self.dtype, param_dtype=self.param_dtype,
        features=(self.num_heads, head_dim), kernel_init=self.kernel_init,
        bias_init=self.bias_init, use_bias=self.use_bias)
    query = dense(name="query")(inputs_q)  # [B, T, N, H]
    key = dense(name="key")(inputs_k)  # [B, S, N, H]
    value = dense(name="value")(inputs_v)  # [B, S, N, H]
    x = _attend(query, key, value, config=self.config, mesh=self.mesh,
                mask=masks_lib.as_spec(self.mask), dense_mask=mask, segment_ids=segment_ids,
                positions=positions)
    return nn.DenseGeneral(
        features=features, axis=(-2, -1), kernel_init=self.out_kernel_init or self.kernel_init,
        bias_init=self.out_bias_init or self.bias_init, use_bias=self.use_bias,
        dtype=self.dtype, param_dtype=self.param_dtype, name="out")(x)


__all__ = ["RingAttention", "make_attention_fn"]
