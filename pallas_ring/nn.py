"""Flax adapters: the ``RingAttention`` linen module and ``make_attention_fn`` for stock modules.

``RingAttention`` *is* a ``flax.linen.MultiHeadDotProductAttention`` (a subclass): every field and
call argument keeps Flax's meaning and the parameter tree is the stock one for every field
combination (``normalize_qk``, ``use_bias``, ``qkv_features``, ``out_features``, ``decode`` with
its cache, custom ``dot_general``s, ...; an FP8 ``cache_dtype`` adds the cache's descales), so
checkpoints load unchanged. Only its default ``attention_fn`` differs: pallas_ring attention,
run as a ring (``shard_map``, ``ppermute`` in a scan) when a mesh holding ``config.axis_name`` is
given or active (``jax.set_mesh``), and as ``flash_attention`` when no mesh is present.

Rows with no visible key return 0 here, where Flax's ``dot_product_attention`` (and
``jax.nn.dot_product_attention``) return the mean of V.
"""

from __future__ import annotations

import contextvars
from typing import Any, Callable, NamedTuple, Optional

import flax.linen as nn
from flax.linen import module as flax_module
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from pallas_ring import fp8, kernels
from pallas_ring import masks as masks_lib
from pallas_ring import operands, validation
from pallas_ring.attention import flash_attention
from pallas_ring.config import SequenceParallelConfig
from pallas_ring.decode import decode_attention
from pallas_ring.sharded import (active_mesh, batch_spec, check_batch, check_heads, constrain,
                                 has_explicit_axes, natural_order_mask, sharded_attention)

Array = Any


def _attend(q, k, v, *, config, mesh, mask, dense_mask=None, segment_ids=None,
            q_positions=None, kv_positions=None, single_device=False, bias=None, dropout=None,
            cache_index=None, descales=None):
  """Dispatches ``[..., T, N, H]`` q/k/v to the ring (mesh), to flash_attention, or (decoding
  against a cache whose slots up to ``cache_index`` are filled) to decode_attention.

  ``dense_mask`` / ``bias`` are ``[..., N, T, S]`` (Flax's layout); ``dropout`` holds the
  ``dropout_rate`` / ``dropout_rng`` / ``dropout_broadcast`` keywords (or None); ``descales``
  the ``k_descale`` / ``v_descale`` keywords of an FP8 cache (``[..., N]`` each, or None).
  """
  batch_shape = q.shape[:-3]
  flat = lambda x: None if x is None else x.reshape((-1,) + x.shape[len(batch_shape):])
  descales = {name: d.reshape(-1, d.shape[-1]) for name, d in (descales or {}).items()}

  def flat_bnts(x, name):  # [..., N|1, T, S] with the batch dims flattened, as q's
    if x is None:
      return x
    extra = x.ndim - 3 - len(batch_shape)  # (leading 1s beyond the batch dims, as broadcast)
    if extra > 0 and all(d == 1 for d in x.shape[:extra]):
      x = x.reshape(x.shape[extra:])
    if x.ndim <= 4 and len(batch_shape) <= 1:
      return x
    lead = x.shape[:-3]
    if all(d == 1 for d in lead):  # (broadcast over every batch row)
      return x.reshape((1,) + x.shape[-3:])
    try:
      x = jnp.broadcast_to(x, batch_shape + x.shape[-3:])
    except ValueError:
      raise ValueError(f"`{name}` has shape {x.shape}, whose leading dims {lead} do not "
                       f"broadcast to the inputs' batch dims {batch_shape}: expected "
                       f"[..., N, T, S] with leading dims broadcasting to {batch_shape}.") from None
    return x.reshape((-1,) + x.shape[-3:])

  q, k, v = flat(q), flat(k), flat(v)
  if segment_ids is not None:
    segment_ids = segment_ids.reshape((-1,) + segment_ids.shape[len(batch_shape):])
  misuse = []  # traced flags of a misused dense mask: the output is poisoned with NaN
  if dense_mask is not None:
    dense_mask = flat_bnts(dense_mask, "mask")
    misuse.append(operands.dense_mask_misuse(dense_mask, "mask"))  # 0/1 floats only
    dense_mask = dense_mask.astype(bool) if dense_mask.dtype == bool else dense_mask != 0
  bias = flat_bnts(bias, "bias")
  dropout = dropout or {}
  if cache_index is not None and bias is None and not dropout:
    # (Flax's dense mask here is the cache's own, slots <= cache_index: kv_lengths says it.)
    lengths = jnp.broadcast_to(cache_index + 1, q.shape[:1]).astype(jnp.int32)
    out = decode_attention(q, k, v, mask=mask, kv_lengths=lengths, config=config,
                           mesh=None if config is None else mesh, **descales)
    return out.reshape(batch_shape + out.shape[1:])
  run_mesh = None if single_device else active_mesh(mesh, config)
  cfg = config or SequenceParallelConfig()
  if run_mesh is not None:
    # (sharded_attention checks it too; here the error names Flax's `mask` argument.)
    misuse.append(natural_order_mask(dense_mask, q_positions, cfg.layout,
                                     run_mesh.shape[cfg.axis_name], name="mask"))
    given = None if mesh is None else _auto_outside(mesh, q)
    out = sharded_attention(q, k, v, mesh=given, config=cfg, mask=mask, segment_ids=segment_ids,
                            positions=q_positions, dense_mask=dense_mask, bias=bias, **dropout,
                            **descales)
  else:
    if kv_positions is None and q.shape[1] == k.shape[1]:
      kv_positions = q_positions
    cache_mesh = active_mesh(mesh, config) if single_device else None
    if cache_mesh is not None:  # decoding with a dense mask: one device's attention on the
      # gathered cache (replicated: flash_attention takes no sharded operands under Explicit axes)
      q, k, v, dense_mask, bias = (constrain(x, cache_mesh, P())
                                   for x in (q, k, v, dense_mask, bias))
      descales = {name: constrain(d, cache_mesh, P()) for name, d in descales.items()}
    out = flash_attention(q, k, v, mask=mask, segment_ids=segment_ids, q_positions=q_positions,
                          kv_positions=kv_positions, dense_mask=dense_mask, bias=bias,
                          block_sizes=cfg.block_sizes, backend=cfg.backend, **dropout,
                          **descales)
    if cache_mesh is not None:  # batch rows back where the other decode steps leave them
      out = constrain(out, cache_mesh, P(batch_spec(config), None, None, None))
  out = validation.poison(out, *misuse)
  return out.reshape(batch_shape + out.shape[1:])


class _Tokens(NamedTuple):
  """What a ``RingAttention`` call passes to its attention beyond Flax's keywords."""

  config: Optional[SequenceParallelConfig]
  mask: Optional[masks_lib.MaskSpec]
  mesh: Any
  segment_ids: Optional[Array]  # [B, T]
  q_positions: Optional[Array]  # [T] / [B, T]
  kv_positions: Optional[Array]  # [S] (decode: the cache slots)
  single_device: bool  # decoding with a dense mask of the caller's: flash_attention, one device
  # Decoding: the slot of the query token (Flax's cache_index before the call). Slots up to it
  # are visible: decode_attention runs, on the cache sharded along its slots under a mesh.
  cache_index: Optional[Array] = None
  # Decoding: ``append(key, value) -> (cached_key, cached_value, last slot, descales)`` writes
  # the call's projected K/V ``[..., T, K, H]`` into the module's cache (``descales``: the
  # ``k_descale`` / ``v_descale`` keywords of an FP8 cache, else empty).
  append: Optional[Callable] = None


_CALL = contextvars.ContextVar("pallas_ring_ring_attention_call", default=None)


def _flax_attention(spec, query, key, value, *, config, mesh, bias, mask, dropout_rng,
                    dropout_rate, broadcast_dropout, deterministic, dtype, module,
                    qk_attn_weights_einsum, attn_weights_value_einsum, einsum_dot_general,
                    is_causal, tokens=None):
  """The body of every adapter: checks Flax's keywords, promotes dtypes like Flax, attends."""
  dropout = None
  if dropout_rate > 0.0 and not deterministic:  # as Flax: dropout only while training
    if dropout_rng is None:
      raise ValueError(f"dropout_rate={dropout_rate} with deterministic=False needs a "
                       "`dropout_rng` (Flax passes the module's 'dropout' rng: call "
                       "apply(..., rngs={'dropout': key})), or set deterministic=True.")
    dropout = dict(dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                   dropout_broadcast=bool(broadcast_dropout))
  if module is not None:
    raise NotImplementedError(
        "sow_weights=True needs the [T, S] attention weights, which pallas_ring never "
        "materialises. Call the module with sow_weights=False, or use the stock "
        "flax dot_product_attention to inspect weights.")
  if any(x is not None for x in (qk_attn_weights_einsum, attn_weights_value_einsum,
                                 einsum_dot_general)):
    raise NotImplementedError(
        "pallas_ring attention runs its own kernels, so custom einsums (qk_attn_weights_einsum, "
        "attn_weights_value_einsum, einsum_dot_general; e.g. AQT quantisation) cannot apply. "
        "Leave them unset, or use the stock attention_fn.")
  t = tokens or _Tokens(config, None, mesh, None, None, None, False)
  index, descales, overflow = t.cache_index, None, None
  if t.append is not None:  # the call's K/V into the cache; its queries attend the cache
    key, value, last, descales, overflow = t.append(key, value)
    index = None if index is None else last  # (None: a dense mask of the caller's decides)
  # As flax.linen.dot_product_attention: compute in `dtype`, default the promoted input dtype
  # (an FP8 cache stays FP8: the kernels widen it with its descales).
  if descales:
    dtype = dtype or query.dtype
    query = query.astype(dtype)
  else:
    dtype = dtype or jnp.result_type(query, key, value)
    query, key, value = (x.astype(dtype) for x in (query, key, value))
  m = spec & masks_lib.Causal() if is_causal else spec
  if tokens is None and m is not None and not masks_lib.is_full(m) and (
      query.shape[-3] != key.shape[-3]):
    raise ValueError(
        f"make_attention_fn(mask={spec!r}) (or is_causal) compares the positions arange(T) of "
        f"the queries and arange(S) of the keys, but T={query.shape[-3]} != S={key.shape[-3]}: "
        "a decode step (one query against the cache, which is not at position 0) or "
        "cross-attention. In decode mode the stock module passes the cache's own mask: use "
        "make_attention_fn() without a mask spec there (the prefill call's causal mask as a "
        "dense `mask`), or pallas_ring.nn.RingAttention(decode=True, mask=...), which knows "
        "the query's position.")
  out = _attend(query, key, value, config=t.config, mesh=t.mesh, mask=m, dense_mask=mask,
                segment_ids=t.segment_ids, q_positions=t.q_positions,
                kv_positions=t.kv_positions, single_device=t.single_device, bias=bias,
                dropout=dropout, cache_index=index, descales=descales)
  return validation.poison(out, overflow).astype(dtype)


def _note_precision(precision, query, config: Optional[SequenceParallelConfig]) -> None:
  """Flax passes the module's ``precision`` to its attention_fn too: above the default, with
  float32 inputs on a GPU, say that the attention kernels do not take it (their float32 matmuls
  run at the default precision: TF32 in the GPU kernels). A backend whose matmuls follow
  ``jax.default_matmul_precision`` (``xla``) under "highest" is exact; CPU kernels are too."""
  if precision is None or query.dtype != jnp.float32 or jax.default_backend() != "gpu":
    return
  named = None if config is None or config.backend == "auto" else kernels.get(config.backend)
  if named is not None and named.follows_matmul_precision and str(
      jax.config.jax_default_matmul_precision).lower() in ("highest", "float32"):
    return
  given = precision if isinstance(precision, tuple) else (precision,)
  if all(isinstance(p, (str, lax.Precision)) and lax.Precision(p) == lax.Precision.DEFAULT
         for p in given):
    return
  validation.warn(
      f"precision={precision!r} is applied to the module's projections, not to pallas_ring's "
      "attention: its kernels multiply float32 inputs at the default precision (TF32 in the GPU "
      "kernels). For float32-exact attention on a GPU, run SequenceParallelConfig(backend="
      "'xla') under jax.default_matmul_precision('highest').")


def make_attention_fn(config: Optional[SequenceParallelConfig] = None,
                      mask: Optional[masks_lib.MaskSpec] = None, mesh=None) -> Callable:
  """An ``attention_fn`` for ``nn.MultiHeadDotProductAttention`` / ``nnx.MultiHeadAttention``.

  Flax's dense masks (bool, or float read as 0/1: an additive ``-inf`` mask is not a mask and
  belongs in ``bias``), ``bias`` (``[..., N, T, S]``, differentiable), ``is_causal`` and
  attention dropout (``dropout_rate``, ``dropout_rng``, ``deterministic``, ``broadcast_dropout``:
  one mask for every batch row and head, Flax's default) are honoured; the output dtype follows
  Flax's promotion of query, key and value. Rows with no visible key return 0 (Flax returns the
  mean of V). Under a ring, masks and biases are in layout order on both token axes.

  Dense masks are checked as far as their values can be read. A float mask with values other
  than 0 and 1 raises; under a zigzag or striped ring a mask built in natural token order
  (``nn.make_causal_mask``: lower-triangular by index, yet showing a query a later position)
  raises, naming ``masks.Causal()`` and ``layouts.permute``. Under ``jit``, where the values
  are not known while tracing, either makes the output NaN (loud, never silently wrong).

  Args:
    config: sequence-parallel config; with a mesh holding ``config.axis_name`` (given here or
      active through ``jax.set_mesh``), attention runs as a ring over that axis and inputs must be
      in ``config.layout`` order. A mesh without that axis raises.
    mask: a mask spec in global positions, ANDed with the dense mask the module passes.
    mesh: the mesh to run the ring on (None: the active mesh, if any).

  Returns:
    ``attention_fn(query, key, value, ...)`` naming every keyword both Flax modules pass.
  """
  spec = masks_lib.as_spec(mask)

  def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                   dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                   precision=None, module=None, force_fp32_for_softmax=False,
                   einsum_dot_general=None, qk_attn_weights_einsum=None,
                   attn_weights_value_einsum=None, is_causal=False):
    # The softmax is always float32 (force_fp32_for_softmax holds).
    del force_fp32_for_softmax
    _note_precision(precision, query, config)
    return _flax_attention(
        spec, query, key, value, config=config, mesh=mesh, bias=bias, mask=mask,
        dropout_rng=dropout_rng, dropout_rate=dropout_rate,
        broadcast_dropout=broadcast_dropout, deterministic=deterministic,
        dtype=dtype, module=module, qk_attn_weights_einsum=qk_attn_weights_einsum,
        attn_weights_value_einsum=attn_weights_value_einsum,
        einsum_dot_general=einsum_dot_general, is_causal=is_causal)

  return attention_fn


def _ring_attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                       dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                       precision=None, module=None, force_fp32_for_softmax=False,
                       einsum_dot_general=None, qk_attn_weights_einsum=None,
                       attn_weights_value_einsum=None):
  """``RingAttention``'s default attention_fn: reads its module's call from ``_CALL``."""
  del force_fp32_for_softmax
  tokens = _CALL.get()
  if tokens is None:
    raise RuntimeError("pallas_ring.nn._ring_attention_fn is RingAttention's internal "
                       "attention_fn; for other modules use make_attention_fn(...).")
  _note_precision(precision, query, tokens.config)
  return _flax_attention(
      masks_lib.as_spec(tokens.mask, "RingAttention.mask"), query, key, value,
      config=tokens.config, mesh=tokens.mesh, bias=bias, mask=mask, dropout_rng=dropout_rng,
      dropout_rate=dropout_rate, broadcast_dropout=broadcast_dropout,
      deterministic=deterministic, dtype=dtype, module=module,
      qk_attn_weights_einsum=qk_attn_weights_einsum,
      attn_weights_value_einsum=attn_weights_value_einsum,
      einsum_dot_general=einsum_dot_general, is_causal=False, tokens=tokens)


class RingAttention(nn.MultiHeadDotProductAttention):
  """``flax.linen.MultiHeadDotProductAttention`` on pallas_ring attention (see the module doc).

  Every field of the stock module keeps its meaning (``num_heads``, ``dtype``, ``param_dtype``,
  ``qkv_features``, ``out_features``, ``broadcast_dropout``, ``dropout_rate``, ``deterministic``,
  ``precision``, ``kernel_init``, ``out_kernel_init``, ``bias_init``, ``out_bias_init``,
  ``use_bias``, ``decode``, ``normalize_qk``, ``force_fp32_for_softmax``, the ``dot_general``
  fields), attention dropout included (``dropout_rate`` with ``deterministic=False`` and a
  'dropout' rng). What pallas_ring cannot do (``sow_weights=True``, custom attention einsums)
  raises with the fix; nothing is ignored.

  Beyond the stock module, a ``decode=True`` call with T > 1 tokens appends them to the cache at
  ``cache_index`` and attends them causally to the cache (a prompt prefilled in one call, run
  over the cache's shards under a mesh); the stock module accepts one token at a time. Under a
  mesh (Auto or Explicit axes, e.g. ``jax.make_mesh``'s) the cache stays sharded along its slots
  and each device writes its own slots. ``cache_dtype=jnp.float8_e4m3fn`` keeps the cache in
  FP8 (half of bf16's bytes, read as such by decode kernels that take FP8), quantized as it is
  written with one descale per batch row and head that the first write fixes: prefill the
  prompt in one call so that its scale sees the prompt (later chunks and tokens beyond
  ``cache_headroom`` times its maximum saturate).

  The call's dense ``mask`` (bool, or float 0/1 as Flax builds it) is in the tokens' order:
  under a zigzag or striped ring, layout order. Causal attention on a ring wants the ``mask``
  field (``masks.Causal()``), not ``nn.make_causal_mask``, which is in natural order: such a
  mask is refused (eager) or makes the output NaN (under ``jit``), as is a float mask with
  values other than 0 and 1 (an additive mask); see ``make_attention_fn``.

  Attributes:
    config: sequence-parallel config (axis, layout, strategy, blocks, backend).
    mask: mask spec in global positions (e.g. ``masks.Causal()``), ANDed with the call's dense
      ``mask``.
    mesh: mesh for the ring; None uses the mesh active through ``jax.set_mesh``. A mesh without
      ``config.axis_name`` raises; with no mesh at all, single-device ``flash_attention`` runs.
    attention_fn: None (pallas_ring attention) or any Flax ``attention_fn``, used as Flax does.
    cache_dtype: dtype of the decode cache's K/V (None: the projected keys', as Flax).
    cache_headroom: for an FP8 cache, the largest value it holds over the first write's
      absolute maximum (per batch row and head); larger later values saturate. The descales
      live in the cache (``cached_key_descale`` / ``cached_value_descale``, ``[..., N]``): a
      zero one is set by the next write, so zeroing them rescales, and calibrated ones can be
      written there instead.
  """

  config: Optional[SequenceParallelConfig] = None
  mask: Optional[masks_lib.MaskSpec] = None
  mesh: Any = None
  attention_fn: Optional[Callable[..., Array]] = None
  # dtype of cached_key / cached_value: None keeps the projected keys' dtype (Flax's); a float
  # dtype casts; float8_e4m3fn / float8_e5m2 store FP8 with float32 descales per batch row and
  # head (cache variables cached_key_descale / cached_value_descale [..., N]) set by the first
  # write where they are 0 (unset), then kept
  cache_dtype: Any = None
  # FP8 cache: the largest value held is the first write's absolute maximum times this
  cache_headroom: float = 4.0

  def __post_init__(self):
    if self.attention_fn is None:
      object.__setattr__(self, "attention_fn", _ring_attention_fn)
    parent = self.parent
    if parent is flax_module._unspecified_parent:  # (as Flax resolves it, below)
      parent = flax_module._context.module_stack[-1]
    prefix = _stock_name(type(self))
    if (self.name is None and prefix is not None and isinstance(parent, nn.Module)
        and not parent._state.in_setup and parent._initialization_allowed):
      # Auto-named as the stock module is (MultiHeadDotProductAttention_<i>, one counter with
      # it; CheckpointMultiHeadDotProductAttention_<i> under nn.remat, ...), so a stock model's
      # checkpoint loads into the swapped one unchanged.
      cursor = parent._state.autoname_cursor.get(prefix, 0)
      object.__setattr__(self, "name", f"{prefix}_{cursor}")
      parent._state.autoname_cursor[prefix] = cursor + 1
    super().__post_init__()

  def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, inputs_kv=None, mask=None,
               deterministic=None, dropout_rng=None, sow_weights=False, segment_ids=None,
               positions=None):
    """Flax's call (``inputs_q [..., T, D]``, ``inputs_k``/``inputs_v`` default to it), plus:

    Args:
      segment_ids: ``[B, T]`` document ids (layout order under a ring); self-attention only.
      positions: ``[T]`` / ``[B, T]`` global positions the mask compares (default: arange, or
        the layout's positions under a ring). When decoding, the query's position is the cache
        index and the keys' are the cache slots.
    """
    if self.attention_fn is not _ring_attention_fn and (segment_ids is not None or
                                                        positions is not None):
      raise ValueError("RingAttention(attention_fn=...) with a custom attention_fn cannot take "
                       "`segment_ids` or `positions`; pass a dense `mask` instead, or leave "
                       "attention_fn=None for pallas_ring attention.")
    kv_in = next((x for x in (inputs_kv, inputs_k) if x is not None), inputs_q)
    if (self.attention_fn is _ring_attention_fn and not self.decode
        and kv_in.shape[-2] != inputs_q.shape[-2]):  # cross-attention
      if segment_ids is not None:
        raise ValueError(
            f"RingAttention(segment_ids=...) is for self-attention, but the keys have "
            f"{kv_in.shape[-2]} tokens and the queries {inputs_q.shape[-2]}: for "
            "cross-attention pass a dense `mask` [..., 1, T, S] built from both sides' ids "
            "(q_ids[..., None, :, None] == kv_ids[..., None, None, :]).")
      if active_mesh(self.mesh, self.config) is not None:
        raise ValueError(
            f"RingAttention runs a ring over config.axis_name={self.config.axis_name!r} for "
            f"self-attention over one sharded sequence, but the keys have {kv_in.shape[-2]} "
            f"tokens and the queries {inputs_q.shape[-2]}: for cross-attention use a "
            "RingAttention without `config` (single-device flash_attention).")
    q_pos, kv_pos, index, append, spec = positions, None, None, None, self.mask
    if self.decode and self.cache_dtype is not None:
      self._check_cache_dtype()
    decoding = self.decode and self.has_variable("cache", "cache_index")
    chunk = decoding and inputs_q.shape[-2] > 1
    # Decoding with pallas_ring attention, the cache is written here (``_append``), not in Flax's
    # decode branch: under a mesh it stays sharded along its slots, and a chunk of T > 1 tokens
    # is written at once.
    own_write = decoding and self.attention_fn is _ring_attention_fn
    if decoding:
      if positions is not None or segment_ids is not None:
        raise ValueError("RingAttention(decode=True) derives positions from its cache; do not "
                         "pass `positions` or `segment_ids` while decoding.")
      cache_shape = self.get_variable("cache", "cached_key").shape
      max_len = cache_shape[-3]
      q_pos = self.get_variable("cache", "cache_index")[None]
      kv_pos = jnp.arange(max_len, dtype=jnp.int32)
      index = q_pos[0] if mask is None else None
      if own_write:
        append = self._append
        if mask is not None and not chunk:  # as Flax's decode branch: slots up to the index
          mask = nn.combine_masks(mask, jnp.broadcast_to(
              kv_pos <= q_pos[0], tuple(cache_shape[:-3]) + (1, 1, max_len)))
    if chunk:
      t = inputs_q.shape[-2]
      if mask is not None or self.attention_fn is not _ring_attention_fn:
        raise ValueError(
            f"RingAttention(decode=True) called with {t} tokens appends them to the cache and "
            "attends causally, which needs mask=None and attention_fn=None; pass a mask only "
            "with one token per call, or prefill with decode=False.")
      q_pos = q_pos + jnp.arange(t, dtype=jnp.int32)
      spec = masks_lib.Causal() if spec is None else masks_lib.as_spec(spec) & masks_lib.Causal()
    tokens = _Tokens(self.config, spec, self.mesh, segment_ids, q_pos, kv_pos,
                     single_device=bool(self.decode), cache_index=index, append=append)
    reset = _CALL.set(tokens)
    try:
      if own_write:  # Flax's decode branch skipped: the cache is written in _append
        object.__setattr__(self, "decode", False)
      out = super().__call__(inputs_q, inputs_k, inputs_v, inputs_kv=inputs_kv, mask=mask,
                             deterministic=deterministic, dropout_rng=dropout_rng,
                             sow_weights=sow_weights)
    finally:
      if own_write:
        object.__setattr__(self, "decode", True)
      _CALL.reset(reset)
    if self.decode and not decoding and self.cache_dtype is not None:
      self._retype_cache()
    if self.decode:
      self._shard_cache()
    return out

  def _check_cache_dtype(self):
    fix = ("use None (the keys' dtype), a 16/32-bit float such as jnp.bfloat16, or "
           "jnp.float8_e4m3fn / jnp.float8_e5m2 for an FP8 cache")
    try:
      dtype = jnp.dtype(self.cache_dtype)
    except TypeError:
      dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
      raise ValueError(f"RingAttention.cache_dtype={self.cache_dtype!r} is not a float dtype; "
                       f"{fix}.")
    if dtype.itemsize == 1 and dtype not in fp8.FP8_DTYPES:
      raise ValueError(f"RingAttention.cache_dtype={dtype} is an 8-bit float the attention "
                       f"kernels do not take with descales; {fix}.")
    if self.attention_fn is not _ring_attention_fn:
      raise ValueError("RingAttention.cache_dtype needs attention_fn=None: a custom attention_fn "
                       "runs Flax's own cache write, which keeps the keys' dtype. Set "
                       "cache_dtype=None or attention_fn=None.")
    if not 1.0 <= self.cache_headroom < float("inf"):
      raise ValueError(f"RingAttention.cache_headroom={self.cache_headroom!r} must be a finite "
                       "number >= 1 (the FP8 cache's range over its first write's maximum).")

  def _retype_cache(self):
    """The cache Flax's decode branch has just made (zeros), in ``cache_dtype``, with the FP8
    descales."""
    dtype = jnp.dtype(self.cache_dtype)
    for name in ("cached_key", "cached_value"):
      if not self.is_mutable_collection("cache") or not self.has_variable("cache", name):
        return
      x = self.get_variable("cache", name)  # [..., S, N, H]
      self.put_variable("cache", name, x.astype(dtype))
      if dtype in fp8.FP8_DTYPES:  # (0: unset, the next write sets it)
        self.put_variable("cache", f"{name}_descale", jnp.zeros(x.shape[:-3] + x.shape[-2:-1],
                                                                jnp.float32))

  def _append(self, key, value):
    """Writes a chunk's projected ``key, value [..., T, K, H]`` into the cache at
    ``cache_index`` (as Flax writes one token) and advances the index by T; an FP8 cache's
    descales are set by the first write that finds them unset (0).

    Returns:
      ``(cached_key, cached_value, last, descales, overflow)``: the updated caches, the chunk's
      last slot, the FP8 cache's ``k_descale`` / ``v_descale`` keywords (``[..., N]``; else
      empty) and, under jit, a traced flag of a chunk that runs past the cache's end (its output
      is poisoned; a concrete index raises here), else None.
    """
    cached = [self.get_variable("cache", n) for n in ("cached_key", "cached_value")]
    index = self.get_variable("cache", "cache_index")
    t, shape = key.shape[-3], cached[0].shape
    if key.shape[:-3] != shape[:-3] or key.shape[-2:] != shape[-2:] or t > shape[-3]:
      raise ValueError(
          f"Autoregressive cache shape error: the cache holds {shape} ([..., S, N, H]) and the "
          f"call's keys are {key.shape}; a decode-mode call must match the cache's batch and "
          f"heads with at most S={shape[-3]} tokens.")
    overflow = index + t > shape[-3]  # (Flax's write clamps the start: silently wrong)
    if not isinstance(overflow, jax.core.Tracer) and overflow:
      raise ValueError(
          f"RingAttention(decode=True): the call's {t} token(s) at cache_index={int(index)} need "
          f"slots up to {int(index) + t - 1}, past the cache's {shape[-3]} slots. Initialise the "
          "cache (module.init) with an input as long as the longest sequence to generate. (Under "
          "jit, where the index cannot be read, an overflowing call's output is NaN.)")
    mesh = active_mesh(self.mesh, self.config)
    chunks, descales = [], {}
    for x, c, name, word in zip((key, value), cached, ("cached_key", "cached_value"),
                                ("k_descale", "v_descale")):
      stored = self.get_variable("cache", f"{name}_descale")
      if (self.cache_dtype is not None and c.dtype != jnp.dtype(self.cache_dtype)) or (
          fp8.is_fp8(c) and stored is None):
        raise ValueError(
            f"RingAttention.cache_dtype={self.cache_dtype!r}, but the cache's {name} is "
            f"{c.dtype}{' without its descales' if fp8.is_fp8(c) else ''}: it was made by "
            "another module. Initialise the cache with this module (module.init).")
      if fp8.is_fp8(c):  # the descales a write sets where they are unset (0), then kept
        fresh = fp8.descale_of(x, c.dtype, self.cache_headroom)
        if mesh is not None:  # (batch rows where the cache's are, for Explicit axes too)
          spec = _descale_spec(stored.ndim, self.config)
          stored, fresh = constrain(stored, mesh, spec), constrain(fresh, mesh, spec)
        d = jnp.where((stored > 0) | jnp.isnan(stored), stored, fresh)  # (NaN: kept)
        self.put_variable("cache", f"{name}_descale", d)
        x, descales[word] = fp8.quantize_with(x, d, c.dtype), d
      chunks.append(x.astype(c.dtype))
    new = [_write_cache(c, x, index, mesh, self.config) for c, x in zip(cached, chunks)]
    self.put_variable("cache", "cached_key", new[0])
    self.put_variable("cache", "cached_value", new[1])
    self.put_variable("cache", "cache_index", index + t)
    return new[0], new[1], index + t - 1, descales, overflow if isinstance(
        overflow, jax.core.Tracer) else None

  def _shard_cache(self):
    """Under a mesh holding ``config.axis_name``: the cache ``[..., S, N, H]`` sharded along its
    slots over that axis (and its batch over ``config.batch_axes``), a sharding constraint that
    holds under ``jit`` and in checkpoints; decode steps attend it where it lies."""
    mesh = active_mesh(self.mesh, self.config)
    if mesh is None or not self.is_mutable_collection("cache"):
      return
    for name in ("cached_key", "cached_value"):
      x = self.get_variable("cache", name)
      check_heads(mesh, self.config, self.num_heads, x.shape[-2], kv_name="the cache")
      if self.attention_fn is _ring_attention_fn or has_explicit_axes(mesh):
        _check_cache_divides(x.shape, mesh, self.config)  # (else Flax's write: uneven is fine)
      self.put_variable("cache", name, constrain(x, mesh, _cache_spec(x.ndim, self.config)))
      if self.has_variable("cache", f"{name}_descale"):
        d = self.get_variable("cache", f"{name}_descale")
        self.put_variable("cache", f"{name}_descale",
                          constrain(d, mesh, _descale_spec(d.ndim, self.config)))


def _check_cache_divides(shape, mesh, config: SequenceParallelConfig) -> None:
  """Raises unless the mesh's axes divide a cache ``[B, ..., S, K, H]``'s slots and batch."""
  slots, r = shape[-3], mesh.shape[config.axis_name]
  if slots % r:
    raise ValueError(
        f"RingAttention(decode=True) shards its cache's {slots} slots over the {r} devices of "
        f"config.axis_name={config.axis_name!r}: the cache length (the input's length at "
        f"module.init) must be a multiple of {r}; initialise with {-(-slots // r) * r} tokens.")
  if len(shape) > 3:
    check_batch(mesh, config, shape[0], "RingAttention(decode=True)'s cache")


def _auto_outside(mesh, q):
  """The ``mesh`` field to run on. One with Explicit axes (``jax.make_mesh``'s default) used
  while no mesh is active, over projections whose types carry no sharding (no parameter lives
  on that mesh), runs with Auto axes: its shardings would otherwise enter the types of the
  module's output in a program without a mesh context, where differentiating Flax's projections
  under jit fails ("Contracting dimensions are sharded")."""
  if (not has_explicit_axes(mesh) or not isinstance(mesh, jax.sharding.Mesh)
      or not jax.sharding.get_abstract_mesh().empty
      or has_explicit_axes(jax.typeof(q).sharding.mesh)):
    return mesh
  return jax.sharding.Mesh(mesh.devices, mesh.axis_names,
                           axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names))


def _stock_name(cls) -> Optional[str]:
  """The auto-name prefix of the stock module that ``cls`` swaps in for: RingAttention's is
  MultiHeadDotProductAttention; a Flax transform's class of it (``nn.remat(RingAttention)``:
  CheckpointRingAttention, possibly nested) the same transforms' class of the stock module
  (CheckpointMultiHeadDotProductAttention); None for a user's subclass (and transforms of
  it), which Flax names by its own class."""
  prefix = ""
  while (cls is not RingAttention and cls.__module__ == nn.transforms.__name__
         and cls.__name__.endswith(cls.__bases__[0].__name__)):
    prefix += cls.__name__[:-len(cls.__bases__[0].__name__)]  # (Checkpoint, Vmap, ...)
    cls = cls.__bases__[0]
  return prefix + nn.MultiHeadDotProductAttention.__name__ if cls is RingAttention else None


def _cache_spec(ndim: int, config: SequenceParallelConfig, slots=True):
  """The PartitionSpec of a cache (or a chunk of it) ``[B, ..., S, K, H]`` under a mesh: batch
  over ``config.batch_axes``, slots over ``config.axis_name`` (``slots=False``: replicated),
  heads over ``config.head_axis`` (``decode_attention``'s)."""
  lead = (batch_spec(config), *([None] * (ndim - 4))) if ndim > 3 else ()  # (none: unbatched)
  return P(*lead, config.axis_name if slots else None, config.head_axis, None)


def _descale_spec(ndim: int, config: SequenceParallelConfig):
  """The PartitionSpec of an FP8 cache's descales ``[B, ..., K]``: batch rows and heads as the
  cache's."""
  lead = (batch_spec(config), *([None] * (ndim - 2))) if ndim > 1 else ()  # (none: unbatched)
  return P(*lead, config.head_axis)


def _write_cache(cache, chunk, index, mesh, config):
  """``cache [B, ..., S, K, H]`` with ``chunk [B, ..., T, K, H]`` written at slot ``index``.

  As ``lax.dynamic_update_slice`` (Flax's write; a start past ``S - T`` is clamped to it). Under
  a mesh the cache is sharded along its slots: each device writes the chunk's tokens that fall
  into its own slot range (a ``shard_map``), so the cache is never gathered and the write holds
  for Explicit mesh axes (``jax.make_mesh``'s default), where ``dynamic_update_slice`` of a
  replicated chunk into a sharded cache is a sharding type error, as for Auto ones.
  """
  if mesh is None:
    return lax.dynamic_update_slice(cache, chunk, (0,) * (cache.ndim - 3) + (index, 0, 0))
  s, t = cache.shape[-3], chunk.shape[-3]
  start = jnp.clip(jnp.asarray(index, jnp.int32), 0, s - t)

  def per_device(local, chunk_, start_):  # [B', ..., S/R, K, H], [B', ..., T, K, H], []
    c = local.shape[-3]
    slot = lax.axis_index(config.axis_name) * c + jnp.arange(c, dtype=jnp.int32)
    rel = slot - start_  # [S/R]: the chunk token each local slot takes, if in [0, T)
    inside = ((rel >= 0) & (rel < t))[:, None, None]
    taken = jnp.take(chunk_, jnp.clip(rel, 0, t - 1), axis=-3)
    return jnp.where(inside, taken, local)

  cache_spec, chunk_spec = _cache_spec(cache.ndim, config), _cache_spec(cache.ndim, config, False)
  args = (constrain(cache, mesh, cache_spec), constrain(chunk, mesh, chunk_spec), start)
  fn = jax.shard_map(per_device, mesh=mesh, in_specs=(cache_spec, chunk_spec, P()),
                     out_specs=cache_spec, check_vma=False)
  return fn(*args)


__all__ = ["RingAttention", "make_attention_fn"]
