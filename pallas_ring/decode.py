"""``decode_attention``: a few new query tokens against a long KV cache (flash-decoding).

A backend with a dedicated decode kernel (``Backend.decode``; Triton) runs the steps below in
one launch that derives positions, lengths and its tile range itself (``_local_kernel``), then
merges the chunks. Otherwise one device runs four steps, all around the backends' forward
kernels (the same contract as ``flash_attention``):

1. **Pack.** The ``G = N / K`` query heads that share a kv head, times the ``T`` query tokens,
   become the rows of that kv head's query tile (``[B, T*G, K, H]``, rows ordered ``(t, g)``),
   so each K/V tile is read once per kv head. (Not with ALiBi, whose slope is per query head:
   the kernel then maps its N heads onto the K kv heads itself.)
2. **Split.** The cache's slots are cut into ``P`` contiguous chunks that become a batch axis of
   the kernel call (``[B, S, K, H] -> [B * P, S / P, K, H]``, a free reshape), so ``B * K * P``
   programs stream the cache at once. ``P`` fills the device (``Backend.decode_programs``) or is
   ``BlockSizes.kv_splits``.
3. **Attend.** Each chunk runs the forward kernel with its slots' positions. Slots at or past a
   row's ``kv_lengths`` form another segment; the plan lists each chunk's tiles from its first
   live one to its last (``block_sparse.range_plan``: no sort, a few fused ops), so tiles past
   a length or outside a sliding window are never loaded.
4. **Merge.** The chunks' ``(o, lse)`` merge by the log-sum-exp rule the ring uses, then the
   sinks.

With a mesh, the cache is sharded along its slots over ``config.axis_name``: each device runs the
above over its own slot range (global positions) and the devices' results merge the same way
after one all-gather of the small ``[B, T, N, H]`` results and their lse.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from pallas_ring import block_sparse, call, fp8, kernels, operands, pair, sharded, validation
from pallas_ring import masks as masks_lib
from pallas_ring.config import SequenceParallelConfig
from pallas_ring.kernels import common, tuning

# A chunk streams at least this many slots: shorter ones cost more in launch and merge than
# their parallelism gains.
MIN_CHUNK = 512

_NO_GRAD = (
    "decode_attention is forward only (inference against a KV cache): it has no gradient. To "
    "train, call pallas_ring.flash_attention (or ring_attention / sharded_attention), which is "
    "differentiable.")


def _forward_only(fn):
  """``fn`` whose differentiation (any mode) raises ``_NO_GRAD``."""
  f = jax.custom_jvp(fn)

  def jvp(primals, tangents):
    raise NotImplementedError(_NO_GRAD)

  f.defjvp(jvp)
  return f


def num_splits(programs: int, base: int, slots: int, block_kv: int) -> int:
  """The most chunks ``P`` (with ``base * P <= programs``) that cut ``slots`` into equal chunks of
  whole ``block_kv`` tiles, each of at least ``MIN_CHUNK`` slots; 1 when none does (or when
  ``slots`` is not a multiple of ``block_kv``). ``P`` divides ``slots / block_kv``, so the
  split is a reshape, never a copy."""
  if slots % block_kv:
    return 1
  tiles = slots // block_kv
  fits = lambda p: tiles % p == 0 and base * p <= programs and slots // p >= MIN_CHUNK
  return max([p for p in range(1, tiles + 1) if fits(p)], default=1)


def _pack(q, kv_heads: int):
  """``[B, T, N, H] -> [B, T*G, K, H]``: row ``t*G + g`` of kv head k is q head ``k*G + g``."""
  b, t, n, h = q.shape
  g = n // kv_heads
  return q.reshape(b, t, kv_heads, g, h).transpose(0, 1, 3, 2, 4).reshape(b, t * g, kv_heads, h)


def _unpack(o, lse, t: int):
  """Inverse of ``_pack`` on ``o [B, T*G, K, H]`` and ``lse [B, K, T*G]``."""
  b, rows, kh, h = o.shape
  g = rows // t
  o = o.reshape(b, t, g, kh, h).transpose(0, 1, 3, 2, 4).reshape(b, t, kh * g, h)
  lse = lse.reshape(b, kh, t, g).transpose(0, 1, 3, 2).reshape(b, kh * g, t)
  return o, lse


def _merge_stacked(o, lse):
  """``(o [B, T, N, H], lse [B, N, T])`` of partial results over disjoint slots stacked along a
  leading axis (``[P, B, T, N, H]``, ``[P, B, N, T]``), by the log-sum-exp rule."""
  if o.shape[0] == 1:
    return o[0], lse[0]
  return common.merge_reduced(o, lse, functools.partial(jnp.max, axis=0),
                              functools.partial(jnp.sum, axis=0))


def _xp(x):
  """numpy for what is known while tracing (numpy arrays, Python ints), else jax.numpy."""
  return np if isinstance(x, (np.ndarray, int)) else jnp


def _split(x, p: int):
  """``[B, ...] -> [B * P, ...]``: each row repeated for the P chunks of its cache."""
  return _xp(x).broadcast_to(x[:, None], (x.shape[0], p) + x.shape[1:]).reshape(
      (x.shape[0] * p,) + x.shape[1:])


def _chunk_infos(q_pos, lengths, offset, p: int, c: int, tp: int, sp: int):
  """TokenInfo of the queries of every chunk (``[B * P, Tp]``) and of the chunks' slots
  (``[B * P, Sp]``): global positions, and with ``lengths`` the slots past a row's length as
  another segment (never visible). Numpy where known while tracing, so their block bounds are
  constants."""
  b, rows = q_pos.shape
  slots = offset + _xp(offset).arange(p * c, dtype=np.int32)  # [S] global positions
  kv_pos = _xp(slots).broadcast_to(slots.reshape(1, p, c), (b, p, c)).reshape(b * p, c)
  q_seg = kv_seg = None
  if lengths is not None:
    q_seg = np.zeros((b * p, rows), np.int32)
    kv_seg = (slots[None] >= lengths[:, None]).astype(jnp.int32).reshape(b * p, c)
  info = lambda pos, seg, padded: block_sparse.pad_token_info(block_sparse.TokenInfo(pos, seg),
                                                              padded)
  return info(_split(q_pos, p), q_seg, tp), info(kv_pos, kv_seg, sp)


def _local_on(backend, interpret, q, k, v, q_pos, lengths, offset, terms, *,
              settings: call.Settings, total: int):
  """``(o [B, T, N, H], lse [B, N, T])`` in the accumulation dtype, before sinks, of the queries
  against this device's cache ``k, v [B, S, K, H]``, whose slot ``j`` has global position
  ``offset + j``.

  Args:
    q_pos: int32 ``[B, T]`` query positions, or None for the default: the last T slots below
      each row's length (known while tracing without ``lengths``, so that the block plan is
      built ahead, in numpy, when ``offset`` is too).
    lengths: int32 ``[B]`` visible slots per row (global), or None (every slot).
    offset: the global position of this device's first slot (an int, or traced on a mesh).
    terms: the in-kernel optional operands (``operands``; per query head, so a dedicated
      decode kernel, which packs a kv head's query heads into rows, serves only calls without).
    total: the cache's slots over every device (global S).
  """
  b, t, n, _ = q.shape
  s, kh, hv = k.shape[1], k.shape[2], v.shape[-1]
  h = pair.kernel_head_dim(q, v)
  impl = kernels.get(backend)
  if impl.decode is not None and not terms:
    out = _local_kernel(impl, interpret, q, k, v, q_pos, lengths, offset, settings=settings,
                        total=total)
    if out is not None:
      return out
  if not impl.forward_reads_fp8_kv:
    k, v = _widened(k, v, q.dtype)
  pack = not terms
  rows, heads = (t * (n // kh), kh) if pack else (t, n)
  tiles = tuning.resolve(backend, settings.block_sizes, rows, s, h)
  # (an FP8 cache was widened above, or a forward kernel reads it: not ``decode_programs(fp8)``)
  p = settings.block_sizes.kv_splits or num_splits(
      impl.decode_programs(interpret), b * heads, s, tiles.block_kv)
  if s % p:
    raise ValueError(f"block_sizes.kv_splits={p} does not divide the cache's {s} slots (per "
                     "device); pass a divisor of it, or None to choose automatically.")
  c = s // p  # slots per chunk
  acc = common.acc_dtype(q.dtype)
  if q_pos is None:
    last = np.full((b, 1), total, np.int32) if lengths is None else lengths[:, None]
    q_pos = last - t + np.arange(t, dtype=np.int32)  # [B, T]
  if pack:  # [B, T*G, K, H], [B, T*G]
    q, q_pos = _pack(q, kh), _xp(q_pos).repeat(q_pos, rows // t, axis=1)
  tp = tuning.padded_len(rows, tiles.block_q)
  sp = tuning.padded_len(c, tiles.block_kv)
  hp = impl.padded_head_dim(h)
  cfg = pair.kernel_config(tiles, mask=settings.mask, scale=settings.scale,
                           softcap=settings.softcap, q_len=rows, kv_len=c, out_dtype=acc,
                           interpret=interpret)
  ops = common.Operands(*_chunk_infos(q_pos, lengths, offset, p, c, tp, sp),
                        **operands.repeat_batch(terms, p))  # (batch rows: [B * P, ...])
  pad = pair.pad_tokens
  kc, vc = (pad(x.reshape(b * p, c, kh, x.shape[-1]), sp, hp) for x in (k, v))
  # (no sort: a few fused ops, or numpy constants when the positions are known while tracing)
  plan = block_sparse.BlockPlan(*map(jnp.asarray, block_sparse.range_plan(
      settings.mask, ops.q_info, ops.kv_info, block_q=tiles.block_q, block_kv=tiles.block_kv,
      q_len=rows, kv_len=c)))
  o, lse = impl.forward(pad(_split(q, p), tp, hp), kc, vc, ops, plan, cfg)
  o = o[:, :rows, :, :hv].astype(acc).reshape(b, p, rows, heads, hv)
  lse = lse[:, :, :rows].reshape(b, p, heads, rows)
  o, lse = _merge_stacked(jnp.moveaxis(o, 1, 0), jnp.moveaxis(lse, 1, 0))
  return _unpack(o, lse, t) if pack else (o, lse)


def _local_kernel(impl, interpret, q, k, v, q_pos, lengths, offset, *,
                  settings: call.Settings, total: int):
  """``_local_on`` through the backend's dedicated decode kernel (``Backend.decode``): pack the
  rows, one launch, merge the chunks. None when the cache's tiles do not cut into whole chunks
  of the requested ``kv_splits`` (the generic path then serves the call)."""
  b, t, n, _ = q.shape
  s, kh, hv = k.shape[1], k.shape[2], v.shape[-1]
  h = pair.kernel_head_dim(q, v)
  g = n // kh
  if not impl.decode_reads_fp8:
    k, v = _widened(k, v, q.dtype)
  rows = t * g
  tiles = tuning.resolve(impl.name, settings.block_sizes, rows, s, h)
  bk = tiles.block_kv
  rp, hp = impl.tile_caps(rows, s)[0], impl.padded_head_dim(h)
  sp = tuning.padded_len(s, bk)
  programs = impl.decode_programs(interpret, fp8=fp8.is_fp8(k))
  p = settings.block_sizes.kv_splits or num_splits(programs, b * kh, sp, bk)
  if sp % (p * bk):
    return None
  pad = lambda x, *to: jnp.pad(x, [(0, m - d) for d, m in zip(x.shape, to)])
  # [B, T, N, H] -> [B, K, T*G, H] (rows ordered (t, g)), padded to [B, K, R, Hp]
  qk = _pack(q, kh).transpose(0, 2, 1, 3)
  if q_pos is not None:  # [B, T] -> [B, R]
    q_pos = pad(jnp.repeat(jnp.asarray(q_pos, jnp.int32), g, axis=1), b, rp)
  if lengths is None:
    lengths = np.full((b,), total, np.int32)
  offset = (np.full((1,), offset, np.int32) if isinstance(offset, int)
            else jnp.reshape(offset, (1,)).astype(jnp.int32))
  cfg = common.DecodeConfig(settings.mask, settings.scale, settings.softcap, tokens=t, group=g,
                            chunks=p, block_kv=bk, slots=s, num_warps=tiles.num_warps,
                            num_stages=tiles.num_stages, interpret=interpret)
  o, lse = impl.decode(pad(qk, b, kh, rp, hp), pair.pad_tokens(k, sp, hp),
                       pair.pad_tokens(v, sp, hp), q_pos, lengths, offset, cfg)
  # o [B, K, P, R, Hp] -> [P, B, R, K, Hp] and lse [B, K, P, R] -> [P, B, K, R]: the chunks
  # merge into the packed layout [B, R, K, Hp] / [B, K, R].
  o, lse = _merge_stacked(o.transpose(2, 0, 3, 1, 4), jnp.moveaxis(lse, 2, 0))
  return _unpack(o[:, :rows, :, :hv], lse[:, :, :rows], t)


def _widened(k, v, dtype):
  """An FP8 cache widened to ``dtype`` in XLA, for kernels that do not read FP8."""
  return tuple(x.astype(dtype) if fp8.is_fp8(x) else x for x in (k, v))


def _check(q, k_cache, kv_lengths, mesh_size: int):
  """Checks what ``call.check`` does not: cache and query lengths, ``kv_lengths``."""
  b, t = q.shape[0], q.shape[1]
  s = k_cache.shape[1]
  if t > s:
    raise ValueError(f"`q` has T={t} tokens but the cache has S={s} slots (k_cache shape "
                     f"{tuple(k_cache.shape)}): decode_attention attends a few new tokens that are "
                     "already written into a longer cache. Write them into the cache first, or "
                     "use flash_attention for a whole prompt.")
  if s % mesh_size:
    raise ValueError(f"the cache's S={s} slots do not split evenly over the {mesh_size} devices "
                     "of config.axis_name; allocate a cache whose length is a multiple of it.")
  if kv_lengths is not None:
    kv_lengths = np.asarray(kv_lengths) if isinstance(kv_lengths, (list, tuple)) else kv_lengths
    shape = tuple(jnp.shape(kv_lengths))
    if shape != (b,):
      raise ValueError(f"`kv_lengths` has shape {shape}; expected [B] = ({b},): the number of "
                       "filled cache slots of each batch row.")
    if not jnp.issubdtype(jnp.result_type(kv_lengths), jnp.integer):
      raise TypeError(f"`kv_lengths` has dtype {jnp.result_type(kv_lengths)}; it must be an "
                      "integer array (cast with `.astype(jnp.int32)`).")
    if not isinstance(kv_lengths, jax.core.Tracer) and b:  # (traced: ``_lengths_outside``)
      values = np.asarray(kv_lengths)  # (on the host: no staging into a trace)
      lo, hi = int(values.min()), int(values.max())
      if lo < 0 or hi > s:
        raise ValueError(f"`kv_lengths` holds values from {lo} to {hi}; each must be between 0 "
                         f"and the cache's S={s} slots (the number of filled slots of its row). "
                         "Grow the cache, or stop generating when a row's cache is full.")


def _lengths_outside(kv_lengths, s: int):
  """A traced bool scalar, True when traced ``kv_lengths`` leave ``[0, S]`` (for
  ``validation.poison``); None for concrete ones, which ``_check`` reads."""
  if not isinstance(kv_lengths, jax.core.Tracer):
    return None
  return jnp.any((kv_lengths < 0) | (kv_lengths > s))


def decode_attention(q, k_cache, v_cache, *, kv_lengths=None, q_positions=None,
                     mask=masks_lib.Causal(), sinks=None, softcap=None, scale=None,
                     alibi_slopes=None, mesh=None, config: Optional[SequenceParallelConfig] = None,
                     block_sizes=None, backend: str = "auto", interpret=None,
                     return_lse: bool = False, q_descale=None, k_descale=None, v_descale=None,
                     out_dtype=None):
  """Attention of a few new query tokens against a long KV cache (forward only).

  Args:
    q: ``[B, T, N, H]``, T small (1 for greedy decoding, a few for speculative decoding).
    k_cache, v_cache: ``[B, S, K, H]``; ``N % K == 0``. Key positions are the slot indices.
    kv_lengths: int ``[B]`` filled slots per row, each in ``[0, S]`` (default S); slots at or
      past a row's length are invisible and never read. Lengths outside raise where they are
      concrete and make the output NaN under ``jit``.
    q_positions: int ``[T]`` or ``[B, T]``; default ``kv_lengths[:, None] - T + arange(T)`` (the
      queries are the last T tokens written into the cache).
    mask: a mask spec in global positions (default ``Causal()``).
    sinks, softcap, scale, alibi_slopes: as ``flash_attention``.
    mesh, config: with a mesh (given or active through ``jax.set_mesh``) holding
      ``config.axis_name``, the caches are sharded along S over that axis in contiguous slot
      ranges (``config.batch_axes`` shard B, ``config.head_axis`` the heads); q and kv_lengths
      are replicated over it. The config's ``strategy`` and ``ulysses_axis`` are the prefill's:
      decode attends the cache where it lies (replicated over a ``ulysses_axis``).
    block_sizes: ``BlockSizes`` (its ``kv_splits`` sets the number of cache chunks); default
      ``config.block_sizes``.
    backend: a kernel backend, or ``"auto"`` (with a ``config``: its ``backend``).
    interpret: as ``flash_attention``.
    return_lse: also return ``lse [B, N, T]``.
    q_descale, k_descale, v_descale: float32 descales of FP8 (``float8_e4m3fn`` /
      ``float8_e5m2``) operands, a scalar or ``[B, K]`` each (``pallas_ring.quantize_fp8``).
    out_dtype: the output's dtype; default q's, bfloat16 when q is FP8.
      An FP8 cache stays FP8 in memory: k's descale is folded into q and v's into the output
      (``fp8.fold``), and the GPU decode kernel and the TPU kernels widen each tile as they read
      it (the XLA backend widens the cache first).

  Returns:
    ``[B, T, N, Hv]`` in ``out_dtype`` (and lse): ``flash_attention`` of the same positions with the
    slots past each length invisible. Rows with no visible slot are 0.
  """
  cfg = config
  if cfg is not None and not isinstance(cfg, SequenceParallelConfig):
    raise TypeError(f"`config` must be a SequenceParallelConfig or None, got "
                    f"{type(cfg).__name__}.")
  if mesh is not None and cfg is None:
    raise ValueError("decode_attention(mesh=...) needs config=SequenceParallelConfig(axis_name="
                     "...) naming the mesh axis the cache is sharded over.")
  run_mesh = sharded.active_mesh(mesh, cfg)
  r = 1 if run_mesh is None else run_mesh.shape[cfg.axis_name]
  _check(q, k_cache, kv_lengths, r)
  q, k_cache, v_cache, v_scale, out_dtype = fp8.fold(
      q, k_cache, v_cache, q_descale, k_descale, v_descale, out_dtype,
      names=("q", "k_cache", "v_cache"))
  checked = call.check(
      q, k_cache, v_cache, mask=mask, q_positions=q_positions, softcap=softcap,
      scale=scale, operands=dict(alibi_slopes=alibi_slopes, sinks=sinks),
      block_sizes=block_sizes if block_sizes is not None or cfg is None else cfg.block_sizes,
      backend=cfg.backend if backend == "auto" and cfg is not None else backend,
      interpret=interpret, return_lse=return_lse, decode=True)
  b, t = q.shape[0], q.shape[1]
  s = k_cache.shape[1]
  lengths = None if kv_lengths is None else jnp.asarray(kv_lengths, jnp.int32)
  q_pos = checked.arrays.q_positions
  if q_pos is not None:
    q_pos = jnp.broadcast_to(jnp.asarray(q_pos, jnp.int32).reshape(-1, t), (b, t))
  terms = checked.arrays.terms
  args = (q, k_cache, v_cache, q_pos, lengths, terms.get("sinks"), operands.in_kernel(terms))
  # (float32 out of the kernels where v's descale still multiplies it)
  static = dict(settings=checked.settings, total=s, platforms=tuple(checked.per_platform.items()),
                out_dtype=q.dtype if v_scale is None else jnp.dtype(jnp.float32))
  if run_mesh is None:
    fn = functools.partial(_decode, **static)
  else:
    sharded.check_axes(run_mesh, cfg)
    sharded.check_batch(run_mesh, cfg, b, "q")
    sharded.check_heads(run_mesh, cfg, q.shape[2], k_cache.shape[2], kv_name="the caches")
    fn = functools.partial(_decode_sharded, mesh=run_mesh, config=cfg, **static)
  return validation.poison(fp8.cast_output(_forward_only(fn)(*args), out_dtype, v_scale),
                           _lengths_outside(kv_lengths, s))


def _finish(o, lse, sinks, dtype, settings: call.Settings):
  o, lse = pair.finish_forward(o, lse, sinks, dtype)
  return (o, lse) if settings.return_lse else o


@functools.partial(jax.jit, static_argnames=("settings", "platforms", "total", "out_dtype"))
def _decode(q, k, v, q_pos, lengths, sinks, terms, *, settings, platforms, total, out_dtype):
  """One device: ``_local_on`` on the platform's backend, then the sinks."""
  local = functools.partial(_local_on, settings=settings, total=total)
  o, lse = kernels.dispatch(local, dict(platforms), q, k, v, q_pos, lengths, 0, terms)
  return _finish(o, lse, sinks, out_dtype, settings)


@functools.partial(jax.jit, static_argnames=("mesh", "config", "settings", "platforms", "total",
                                             "out_dtype"))
def _decode_sharded(q, k, v, q_pos, lengths, sinks, terms, *, mesh, config, settings,
                    platforms, total, out_dtype):
  """shard_map over the cache's slots: each device attends its own, the results merge."""
  sp, head = config.axis_name, config.head_axis
  batch = sharded.batch_spec(config)
  rep, cache, rows = P(batch), P(batch, sp, head), P(batch, None, head)  # [B], [B, S, K, H], q
  local = functools.partial(_local_on, settings=settings, total=total)

  def per_device(q_, k_, v_, pos_, len_, sinks_, terms_):
    offset = lax.axis_index(sp) * k_.shape[1]
    o, lse = kernels.dispatch(local, dict(platforms), q_, k_, v_, pos_, len_, offset, terms_)
    # One small all-gather of every device's (o, lse) (a latency-bound collective: one beats
    # the pmax and two psums of a merge across the axis), then the merge on each device.
    h = o.shape[-1]
    both = jnp.concatenate([o, jnp.swapaxes(lse, -1, -2)[..., None]], axis=-1)  # [B, T, N, H+1]
    both = lax.all_gather(both, sp)  # [R, B, T, N, H+1]
    o, lse = _merge_stacked(both[..., :h], jnp.swapaxes(both[..., h], -1, -2))
    return _finish(o, lse, sinks_, out_dtype, settings)

  optional = lambda x, spec: None if x is None else spec
  term_specs = operands.specs(terms, batch=batch, heads=head, rows=None)
  in_specs = (rows, cache, cache, optional(q_pos, P(batch, None)), optional(lengths, rep),
              optional(sinks, P(head)), term_specs)
  out_specs = (rows, P(batch, head, None)) if settings.return_lse else rows  # lse [B, N, T]
  args = [sharded.constrain(x, mesh, s_)
          for x, s_ in zip((q, k, v, q_pos, lengths, sinks), in_specs)]
  args.append({name: sharded.constrain(x, mesh, term_specs[name]) for name, x in terms.items()})
  fn = jax.shard_map(per_device, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                     check_vma=False)
  return fn(*args)


__all__ = ["decode_attention", "num_splits"]
