"""``sharded_attention``: global arrays + a mesh + a SequenceParallelConfig -> shard_map(ring)."""

from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from pallas_ring import auto, balance, call, fp8, layouts, operands, packing, ring, ulysses
from pallas_ring import validation
from pallas_ring.config import RingVariants, SequenceParallelConfig


def _mesh_axes(mesh) -> tuple:
  return tuple(getattr(mesh, "axis_names", ()))


def active_mesh(mesh, config: Optional[SequenceParallelConfig]):
  """The mesh to run the ring on, or None for single-device attention.

  With a ``config``, a mesh given here or active through ``jax.set_mesh`` must hold
  ``config.axis_name``: inputs are then in layout order, and attending over them on one device
  would be silently wrong. Without a config, or without any mesh, attention runs on one device.
  """
  if config is None:
    return None
  given = mesh is not None
  if not given:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
      return None
  if config.axis_name not in _mesh_axes(mesh):
    where = "the `mesh` given" if given else "the active mesh (jax.set_mesh)"
    raise ValueError(
        f"SequenceParallelConfig.axis_name={config.axis_name!r} is not an axis of {where}, whose "
        f"axes are {_mesh_axes(mesh)}. Name one of those axes in the config, build the mesh with "
        f"a {config.axis_name!r} axis, or call outside any mesh (and without `mesh=`) to run "
        "single-device attention on naturally ordered tokens.")
  return mesh


def batch_spec(config: SequenceParallelConfig):
  """The PartitionSpec entry of the batch dimension: None, one axis, or a tuple of axes."""
  batch = config.batch_axes or None
  return batch[0] if batch is not None and len(batch) == 1 else batch


def check_axes(mesh, config: SequenceParallelConfig):
  names = tuple(mesh.axis_names)
  fields = [("axis_name", config.axis_name)] + [("batch_axes", a) for a in config.batch_axes]
  for field in ("head_axis", "ulysses_axis"):
    if getattr(config, field) is not None:
      fields.append((field, getattr(config, field)))
  for field, axis in fields:
    if axis not in names:
      raise ValueError(f"SequenceParallelConfig.{field}={axis!r} is not an axis of the mesh, whose "
                       f"axes are {names}. Name an existing axis or build the mesh with it, e.g. "
                       f"jax.make_mesh((..), {names[:-1] + (axis,)}).")


def check_heads(mesh, config: SequenceParallelConfig, n: int, kv_heads: int,
                kv_name: str = "k/v") -> None:
  """Raises unless ``config.head_axis`` (if any) divides the ``n`` query and ``kv_heads`` key /
  value heads."""
  if config.head_axis is None:
    return
  hs = mesh.shape[config.head_axis]
  if n % hs or kv_heads % hs:
    raise ValueError(f"head_axis={config.head_axis!r} has {hs} devices but q has {n} heads and "
                     f"{kv_name} {kv_heads}: both must be multiples of {hs}.")


def axes_size(mesh, axes) -> int:
  """The number of devices along ``axes`` (an axis name or a tuple of them) of ``mesh``."""
  n = 1
  for a in (axes if isinstance(axes, tuple) else (axes,)):
    n *= mesh.shape[a]
  return n


def has_explicit_axes(mesh) -> bool:
  """Whether ``mesh`` (or an abstract one) has an Explicit axis (``jax.make_mesh``'s default)."""
  return any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def check_batch(mesh, config: SequenceParallelConfig, b: int, what: str) -> None:
  """Raises unless the devices of ``config.batch_axes`` divide the batch ``b`` of ``what``."""
  batch = batch_spec(config)
  if batch is not None and b % axes_size(mesh, batch):
    raise ValueError(f"{what}'s batch size {b} is not divisible by the "
                     f"{axes_size(mesh, batch)} devices of batch_axes={config.batch_axes}; use "
                     "a batch that is a multiple of it.")


def constrain(x, mesh, spec):
  """Puts ``x`` on ``mesh`` with ``spec`` (Explicit axes: reshard; Auto axes: a constraint)."""
  if x is None:
    return None
  abstract = isinstance(mesh, jax.sharding.AbstractMesh)
  sharding = spec if abstract else NamedSharding(mesh, spec)
  if has_explicit_axes(mesh) and hasattr(jax, "reshard"):
    return jax.reshard(x, sharding)
  return jax.lax.with_sharding_constraint(x, sharding)


def sharded_attention(q, k, v, *, mesh=None, config: SequenceParallelConfig, mask=None,
                      segment_ids=None, positions=None, dense_mask=None, sinks=None, softcap=None,
                      scale=None, interpret=None, return_lse: bool = False, bias=None,
                      alibi_slopes=None, dropout_rate: float = 0.0, dropout_rng=None,
                      cu_seqlens=None, dropout_broadcast: bool = False, q_descale=None,
                      k_descale=None, v_descale=None, out_dtype=None, quantize=None):
  """Sequence-parallel attention over global arrays in layout order.

  Args:
    q: ``[B, T, N, H]``; k, v: ``[B, T, K, H]``, tokens in ``config.layout`` order (see
      ``layouts.permute``).
    mesh: a ``jax.sharding.Mesh`` holding ``config.axis_name`` (and batch / head axes); None
      uses the mesh set with ``jax.set_mesh``.
    config: the SequenceParallelConfig.
    mask: a mask spec in global positions.
    segment_ids: ``[B, T]`` in layout order; sharded with the tokens.
    positions: ``[T]`` or ``[B, T]`` global positions in layout order; default from the layout.
      A ``layouts.Placement`` (or its ``positions``) is checked against the layout and ring
      size it was built for.
    dense_mask: bool (or float 0/1) broadcastable to ``[B, N, T, T]``, rows and columns in
      layout order, like the tokens (O(T^2) memory: prefer mask specs and segment ids). A mask
      built from token indices (``flax.linen.make_causal_mask``) is in natural order, not layout
      order: under a zigzag or striped layout (or given ``positions``) one that is
      lower-triangular in index order yet shows a query a later position raises, naming the fix
      (``mask=masks.Causal()``, or ``layouts.permute`` on both token axes). A float mask holding
      other values than 0 and 1 (an additive ``0 / -inf`` mask belongs in ``bias``) raises.
      Under ``jit``, where the values cannot be read, either misuse makes the output (and lse)
      NaN instead of silently wrong.
    sinks: ``[N]``; softcap, scale, interpret: as ``flash_attention``.
    return_lse: also return ``lse [B, N, T]``.
    bias: additive logit bias broadcastable to ``[B, N, T, T]``, rows and columns in layout
      order (sharded over the query rows; differentiable).
    alibi_slopes: ``[N]`` or ``[B, N]`` ALiBi slopes (global positions).
    dropout_rate, dropout_rng, dropout_broadcast: as ``flash_attention``: the mask hashes the
      global batch index, query head and positions, so it is the unsharded call's.
    cu_seqlens: int ``[D + 1]`` cumulative lengths of sequences packed along the naturally
      ordered sequence (B must be 1); excludes ``segment_ids``. Each token's index in that
      sequence is its layout position, or a ``Placement``'s position (its original index);
      other ``positions`` beside it raise.
    q_descale, k_descale, v_descale, out_dtype: as ``flash_attention`` (FP8 q, k, v of one
      dtype: the ring's forward steps in FP8 on Hopper, and K/V sent in FP8).
    quantize: as ``flash_attention`` (scales over the whole sequence): FP8 training, every
      strategy.

  Returns:
    ``[B, T, N, Hv]`` in layout order, in ``out_dtype`` (and lse).
  """
  if not isinstance(config, SequenceParallelConfig):
    raise TypeError(f"`config` must be a SequenceParallelConfig, got {type(config).__name__}.")
  if mesh is None:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
      raise ValueError("`mesh` is None and no mesh is active: pass mesh=... or call inside "
                       "`with jax.set_mesh(mesh):`.")
  check_axes(mesh, config)
  _check_eager_autodiff(mesh, q)
  placement = balance.placement_of(positions)
  if isinstance(positions, balance.Placement):
    placement, positions = positions, positions.positions
  packing.check_positions(cu_seqlens, positions, placement is not None,
                          "positions=placement (a layouts.Placement) or none")
  q, k, v, descales, compute, out_dtype = fp8.prepare(q, k, v, q_descale, k_descale, v_descale,
                                                      out_dtype, quantize_to=quantize)
  checked = call.check(
      q, k, v, mask=mask, segment_ids=segment_ids, q_positions=positions, kv_positions=positions,
      operands=dict(dense_mask=dense_mask, bias=bias, alibi_slopes=alibi_slopes, sinks=sinks,
                    fp8_descales=descales),
      softcap=softcap, scale=scale, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
      dropout_broadcast=dropout_broadcast, block_sizes=config.block_sizes,
      backend=config.backend, interpret=interpret, return_lse=return_lse,
      names=("positions", "positions"), dtype=compute, quantize=quantize)
  r = mesh.shape[config.axis_name]
  b, t, n, _ = q.shape
  if config.strategy == "auto":
    choice = auto_choice(q, k, mesh, config, checked, positions, cu_seqlens)
    config = config.replace(strategy=choice.strategy)
  if k.shape[1] != t:
    raise ValueError(f"sharded_attention is self-attention over one sharded sequence: q has "
                     f"T={t} tokens (shape {tuple(q.shape)}) but k/v have {k.shape[1]} (shape "
                     f"{tuple(k.shape)}). Use flash_attention for cross-attention.")
  layouts.check_length(t, config.layout, r, argname="q.shape[1] (sequence length)")
  if placement is not None:
    placement.check(layout=config.layout, ring_size=r, seq_len=t,
                    where=f"sharded_attention(positions=placement.positions) over "
                          f"{config.axis_name!r}")
  batch = batch_spec(config)
  check_batch(mesh, config, b, "q")
  head = config.head_axis
  check_heads(mesh, config, n, k.shape[2])
  uly_field = "axis_name" if config.strategy == "ulysses" else "ulysses_axis"
  uly_axis = getattr(config, uly_field)
  if uly_axis is not None:
    u = mesh.shape[uly_axis]
    ulysses.check_heads(n // (1 if head is None else mesh.shape[head]), u, uly_field, uly_axis)
    if config.strategy == "ulysses_ring" and (t // r) % u:
      raise ValueError(f"strategy='ulysses_ring' splits each of the {r} ring chunks of "
                       f"{t // r} tokens over the {u} devices of ulysses_axis="
                       f"{config.ulysses_axis!r}: the sequence length {t} must be a multiple of "
                       f"{math.lcm(r * u, layouts.divisor(config.layout, r))}. Pad the sequence.")
  if cu_seqlens is not None:
    packing.check_cu_seqlens("cu_seqlens", cu_seqlens, t, b, segment_ids)
  # Traced (under jit): flags that poison the output, since the values cannot be read here.
  misuse = [operands.dense_mask_misuse(dense_mask),
            natural_order_mask(checked.arrays.terms.get("dense"), positions, config.layout, r),
            validation.int32_overflow(segment_ids, positions), packing.misuse(cu_seqlens, t)]
  # One compiled program per static setting, so eager calls are as fast as jitted ones.
  out = _run(q, k, v, checked.arrays, cu_seqlens, mesh=mesh, config=config,
             settings=checked.settings, platforms=tuple(checked.per_platform.items()),
             batch=batch)
  return validation.poison(fp8.cast_output(out, out_dtype), *misuse)


def natural_order_mask(dense, positions, layout: str, ring_size: int, name: str = "dense_mask"):
  """Catches a dense mask built in natural (index) order given over layout-ordered tokens.

  A dense mask's rows and columns follow the tokens' order: under a zigzag or striped layout (or
  given ``positions``) index order is not position order, so a mask built from token indices
  (``flax.linen.make_causal_mask``, a ``tril``) is wrong there. It is recognised as a mask that
  is lower-triangular in index order and yet lets a query see a key at a later position (no
  mask built from layout-ordered data is both, short of a bug).

  Args:
    dense: the checked bool mask ``[Bm, Nm, T, T]`` in layout order, or None.
    positions: the call's ``positions`` (``[T]`` / ``[B, T]``) or None (the layout's).
    layout, ring_size: the layout of the tokens over the ring.
    name: how the caller names the mask (for the error).

  Returns:
    None (nothing to check, or concrete values that pass), or a traced bool scalar that is True
    for such a mask (the caller poisons its output). Concrete values that fail raise ValueError.
  """
  if dense is None or (positions is None and (layout == "contiguous" or ring_size == 1)):
    return None
  t = dense.shape[-1]
  pos = layouts.positions(t, layout, ring_size) if positions is None else jnp.asarray(positions)
  pos = pos[:, None] if pos.ndim == 2 else pos  # [B|1, 1|., T]: rows of the [Bm, Nm, T, T] mask
  later = pos[..., None, :] > pos[..., :, None]  # [., ., T, T]: the key is at a later position
  i = jnp.arange(t)
  index_lower = jnp.all(~dense | (i[None, :] <= i[:, None]))
  sees_later = jnp.any(dense & later)
  bad = index_lower & sees_later
  if isinstance(bad, jax.core.Tracer):
    return bad
  if bool(bad):
    at = tuple(int(a[0]) for a in np.nonzero(np.asarray(dense & later)))
    rows = np.asarray(pos).reshape(-1, t)  # [B|1, T]
    qp, kp = (int(rows[min(at[0], len(rows) - 1), j]) for j in (at[2], at[3]))
    raise ValueError(
        f"`{name}` is lower-triangular in token index order, as a mask built in natural order "
        f"is (e.g. flax.linen.make_causal_mask), but the tokens are in layout={layout!r} order "
        f"over a ring of {ring_size}, where index order is not position order: the query at "
        f"index {at[2]} (position {qp}) would see the key at index {at[3]} (position {kp}). A "
        "dense mask's rows and columns are in layout order, like the tokens. For causal "
        "attention pass mask=pallas_ring.masks.Causal() (a spec on global positions) instead "
        "of a dense mask; otherwise build the mask from layout-ordered data, or permute a "
        "natural-order mask on both token axes: layouts.permute(layouts.permute(m, layout, R, "
        "axis=-1), layout, R, axis=-2). (Under jit, where the values cannot be read, such a "
        "mask makes the output NaN.)")
  return None


def auto_choice(q, k, mesh, config: SequenceParallelConfig, checked, positions=None,
                cu_seqlens=None):
  """What ``strategy="auto"`` runs for this call (``auto.choose``'s cost model), per device's
  head group (``head_axis`` divides the heads); segment ids or ``cu_seqlens`` mark a pack."""
  hs = 1 if config.head_axis is None else mesh.shape[config.head_axis]
  return auto.choose(checked.settings.mask, seq_len=q.shape[1], heads=q.shape[2] // hs,
                     kv_heads=max(1, k.shape[2] // hs), head_dim=q.shape[3],
                     ring_size=mesh.shape[config.axis_name], layout=config.layout,
                     itemsize=jnp.dtype(k.dtype).itemsize,
                     derived_positions=positions is None and checked.arrays.q_positions is None,
                     segmented=checked.arrays.segment_ids is not None or cu_seqlens is not None,
                     variants=config.ring_variants or RingVariants())


def _check_eager_autodiff(mesh, q) -> None:
  """Differentiating outside ``jit`` over a mesh with Explicit axes (``jax.make_mesh``'s default)
  fails inside JAX ("Length of device assignment 1 is not equal to the size of the mesh") unless
  the mesh is active: say so here, with the fix."""
  if not has_explicit_axes(mesh) or not jax.sharding.get_abstract_mesh().empty:
    return
  x, differentiated = q, False
  while isinstance(x, jax.core.Tracer):  # eager: autodiff / vmap tracers over a concrete array
    kind = type(x).__name__  # (JVPTracer, LinearizeTracer: .primal; BatchTracer: .val)
    primal = getattr(x, "primal", None) if kind in ("JVPTracer", "LinearizeTracer") else None
    batched = getattr(x, "val", None) if kind == "BatchTracer" else None
    if primal is None and batched is None:
      return  # under jit (or another transformation): JAX handles the mesh there
    x, differentiated = (batched, differentiated) if primal is None else (primal, True)
  if differentiated:
    raise ValueError(
        "sharded_attention is differentiated outside jit over a mesh with Explicit axes "
        f"(axis_types={tuple(str(t) for t in mesh.axis_types)}, jax.make_mesh's default), which "
        "JAX cannot do unless the mesh is active. Wrap the call in `with jax.set_mesh(mesh):` "
        "(the README's pattern), jit the differentiated function, or build the mesh with "
        "axis_types=(jax.sharding.AxisType.Auto, ...).")


@functools.partial(jax.jit, static_argnames=("mesh", "config", "settings", "platforms", "batch"))
def _run(q, k, v, arrays: call.Arrays, cu_seqlens, *, mesh, config, settings, platforms, batch):
  """shard_map of the ring over a checked call's global arrays (``call.check``)."""
  sp, head, ua = config.axis_name, config.head_axis, config.ulysses_axis
  tokens = sp if ua is None else (sp, ua)  # the axes the sequence is sharded over
  tok = P(batch, tokens, head, None)
  seq = P(batch, tokens)
  positions = arrays.q_positions
  pos_spec = None
  if positions is not None:
    pos_spec = P(tokens) if positions.ndim == 1 else P(batch, tokens)
  uly = config.strategy == "ulysses"
  a2a = sp if uly else ua  # the all-to-all's axis, or None
  # Optional operands (``operands``): query rows sharded with the ring's queries (Ulysses: every
  # row), heads over the head axis and the all-to-all's (each device's own heads after the
  # exchange), keys whole.
  heads = tuple(a for a in (head, a2a) if a is not None) or None
  term_specs = operands.specs(arrays.terms, batch=batch, heads=heads, rows=None if uly else sp)
  out_specs = (tok, P(batch, head, tokens)) if settings.return_lse else tok

  def per_shard(q_, k_, v_, seg_, pos_, terms_, seeds_, cu_):
    offsets = None
    if seeds_ is not None:  # dropout hashes global batch rows and heads
      index = lambda axes, size: 0 if axes is None else jax.lax.axis_index(axes) * size
      offsets = jnp.asarray([index(batch, q_.shape[0]), index(head, q_.shape[2])], jnp.int32)
    shard = call.Arrays(seg_, seg_, pos_, pos_, terms_, seeds_, offsets)
    checked = call.Checked(settings, shard, dict(platforms))
    if a2a is not None:
      return ulysses.run(q_, k_, v_, checked, axis_name=a2a, layout=config.layout,
                         cu_seqlens=cu_, ring_axis=None if uly else sp,
                         scan_unroll=config.scan_unroll, variants=config.ring_variants)
    return ring.run(q_, k_, v_, checked, axis_name=sp, layout=config.layout,
                    strategy=config.strategy, scan_unroll=config.scan_unroll, cu_seqlens=cu_,
                    variants=config.ring_variants)

  in_specs = (tok, tok, tok, None if arrays.segment_ids is None else seq, pos_spec, term_specs,
              None if arrays.seeds is None else P(), None if cu_seqlens is None else P())
  args = [constrain(x, mesh, s) for x, s in zip(
      (q, k, v, arrays.segment_ids, positions), in_specs)]
  args.append({k_: constrain(x, mesh, term_specs[k_]) for k_, x in arrays.terms.items()})
  args += [constrain(x, mesh, s) for x, s in zip((arrays.seeds, cu_seqlens), in_specs[6:])]
  fn = jax.shard_map(per_shard, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                     check_vma=False)
  return fn(*args)


__all__ = ["sharded_attention", "active_mesh", "axes_size", "batch_spec", "check_axes",
           "check_batch", "constrain", "has_explicit_axes"]
