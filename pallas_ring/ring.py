"""Ring attention: the kernel contract run over the R shards of a sequence-parallel mesh axis.

``ring_attention`` is called per shard inside ``shard_map``. Forward: ``lax.scan`` over ring steps;
each step first issues the ``ppermute`` of the next K/V (with the segment ids and caller-given
positions; on GPU one packed buffer; layout positions are derived from the source rank), then
takes that step's block plan of *global* positions and runs the kernel on the current K/V,
which merges its ``(o, lse)`` into the running float32 result (``common.merge``, guarded for
``-inf``; the Mosaic GPU kernel merges in its epilogue); a step with no live block is skipped
(``lax.cond``). Sinks enter once, after the last step.

Reach: where the positions are the layout's own, K/V travel only as far as the mask reaches
(``reach.ring_reach``): ``forward`` hops toward higher ranks and ``backward`` hops toward lower
ones (a bidirectional ring for zigzag and striped shards), each direction a chain of steps as
above; a window over contiguous shards takes one step, chunks that end on shard edges none.
Caller-given positions (data, e.g. a ``layouts.Placement``) keep the whole ring, R - 1 hops.
Halos: a chain of a bounded mask sends only the slice of a shard some device sees
(``halo.halo_runs``, e.g. a window's last ``left`` tokens of a contiguous shard) and runs the pair
kernel on it; its dK/dV come home as that slice (``halo.RingVariants(halo=False)``: whole shards).
Where the mask reaches no other shard, ``run`` calls flash attention on the local shard; where it
reaches only small slices, it receives them once and attends to local K/V plus the slices in one
call (``halo_gather``; ``RingVariants(gather_halos=False)``: the ring steps above).

Backward: one ``custom_vjp`` around the whole ring (residuals: local q, k, v, o, lse, not the
forward's stacked K/V: ``tools/ring_memory.py``). A second scan rotates K/V with the dK/dV
accumulators (one step behind their shard, so every send overlaps a kernel), reusing the final
lse and ``delta = sum(o * do)``; dQ accumulates locally, and each step adds its dK/dV to those
received with its shard (inside the kernels on TPU, whose outputs take the received buffers: at
2M tokens on a v5e-8 that is 3 GiB per chip less). Where the backend's backward fuses
(Mosaic GPU), the local pair runs whole at the first step, its dK/dV added once the others' come
home (``RingVariants.whole_local_pair``); elsewhere its dQ first and its dK/dV last (the
contract's ``parts``), so the accumulated dK/dV's hop home overlaps that kernel instead of
ending the backward exposed.
Forward and backward build their plans from the same positions, so they make the same skip
decisions. When the positions follow the layout and no segment ids or dense mask shape the plan,
the ring's ``plans.Planner`` builds the plans of every (rank, source) pair while tracing and a
step selects its own; otherwise each step builds its plan on device.

On GPU a ``lax.cond`` costs a host round trip per step, so empty steps run the kernel (which
skips their tiles), and XLA:GPU keeps one collective in flight, so a step's sends are one buffer
(``sends``; the forward sends on the buffer it received). ``strategy="all_gather"`` gathers K/V
(and token info) once, runs one kernel call and reduce-scatters dK/dV (only the slices a bounded
mask reaches, as the ring). Internal API (``tools/ring_step_cost.py`` times a step through it):
``RingStatic`` and ``pair_forward`` / ``pair_backward`` (one step's pair; its block plan:
``RingStatic.planner.plan(ops, backward, rank, source)``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_ring import attention, block_sparse, call, fp8, kernels, layouts, operands, packing
from pallas_ring import pair, plans, validation
from pallas_ring import halo as halo_lib
from pallas_ring import halo_gather
from pallas_ring import reach as reach_lib
from pallas_ring.config import STRATEGIES, BlockSizes
from pallas_ring.sends import packer, rotate, send
from pallas_ring.kernels import common, tile_cache, tuning


RING_STRATEGIES = ("ring", "all_gather")  # the strategies run by ``run``


@dataclasses.dataclass(frozen=True)
class RingStatic:
  """Static description of one ring call."""

  cfg: common.KernelConfig  # kernel config of one (q shard, kv shard) pair
  backend: str  # resolved kernel backend
  axis_name: Any  # mesh axis of the ring
  ring_size: int  # R
  strategy: str  # "ring" | "all_gather"
  unroll: int  # scan unroll
  kv_padded: int  # all_gather: padded length of the gathered K/V (ring: padded shard length)
  # The block plans of every step. Its ``positions`` is a ``plans.RingLayout`` when the kv
  # positions follow the layout: each step derives them from the source rank instead of
  # receiving them; None when the caller passed positions (they rotate).
  planner: plans.Planner
  # Skip steps with no live block by lax.cond. On GPU a conditional costs a host round trip per
  # step, so the Triton backend runs the kernel, which skips empty tiles itself.
  use_cond: bool = True
  # Pack each step's sends into one buffer (XLA:GPU keeps one collective in flight at a time,
  # so separate permutes would not all overlap the kernel); forward steps send on what came.
  pack_sends: bool = False
  forward_received: bool = True
  whole_local_pair: bool = False  # the local pair's backward in one call (``RingVariants``'s rule)
  dropout_broadcast: bool = False  # one dropout mask for every batch row and head
  quantize: Any = None  # ``call.Settings.quantize`` where the kernels read FP8, else None
  # (forward, backward): how many hops K/V travel toward higher and lower ranks
  # (``reach.ring_reach``); None: the whole ring, (R - 1, 0).
  reach: Optional[Tuple[int, int]] = None
  # The slice each chain sends (``halo.make``, aligned with ``chains``; None: the whole shard);
  # empty: whole shards everywhere.
  halos: Tuple[Optional[halo_lib.Halo], ...] = ()

  def halo(self, chain: Optional[int]) -> Optional[halo_lib.Halo]:
    """The slice chain ``chain`` (an index of ``chains``; None: the local pair) sends."""
    return None if chain is None or not self.halos else self.halos[chain]

  def for_pair(self, chain: Optional[int]) -> "RingStatic":
    """This ring with the kernel config and planner of chain ``chain``'s pairs."""
    h = self.halo(chain)
    return self if h is None else dataclasses.replace(self, cfg=h.cfg, planner=h.planner)

  @property
  def chains(self) -> Tuple[Tuple[int, int], ...]:
    """``(direction, hops)`` of each direction K/V travel in: +1 toward higher ranks (device r
    holds the shard of r - step at a step), -1 toward lower ranks."""
    f, b = (self.ring_size - 1, 0) if self.reach is None else self.reach
    return tuple((d, n) for d, n in ((1, f), (-1, b)) if n > 0)

  @property
  def layout_positions(self) -> Optional[Tuple[int, str]]:
    """(T, layout) when the kv positions follow the layout, else None."""
    pos = self.planner.positions
    return None if pos is None else (pos.seq_len, pos.layout)


class _Fixed(NamedTuple):
  """Operands that stay on this device (not rotated)."""

  # The in-kernel operands (``operands``); those that span the keys hold this shard's query
  # rows and every kv shard's columns (layout order, each padded like K/V: [.., Tp, R * Sp]).
  terms: dict
  seeds: Optional[Any]  # the dropout words (``call.Arrays``), or None
  offsets: Optional[Any]  # (as seeds)


def _moving_info(st: RingStatic, info: block_sparse.TokenInfo):
  """The token info that travels with K/V: segment ids, and positions unless derived."""
  return (info.positions if st.layout_positions is None else None, info.segment_ids)


def _step_info(st: RingStatic, moving, src, padded_len: int, halo=None) -> block_sparse.TokenInfo:
  """Token info of kv shard ``src`` (its slice ``halo``, or all of it) from what came with it."""
  pos, seg = moving
  if pos is None:
    t, layout = st.layout_positions
    pos = layouts.positions(t, layout, st.ring_size, src)[None]
    if halo is not None:
      return block_sparse.TokenInfo(halo_lib.take(pos, halo.runs, halo.padded, mode="edge"), seg)
    pos = jnp.pad(pos, ((0, 0), (0, padded_len - pos.shape[1])), mode="edge")
  return block_sparse.TokenInfo(pos, seg)


def _sent(st: RingStatic, local, chain: int):
  """What chain ``chain`` sends of the local ``(kv, moving)``: all of it, or its halo's slice
  (K/V zero-padded, segment ids edge-padded; halos only run on derived positions)."""
  h = st.halo(chain)
  if h is None:
    return local
  (k, v), (_, seg) = local
  cut = lambda x, mode="constant": halo_lib.take(x, h.runs, h.padded, mode=mode)
  return (cut(k), cut(v)), (None, None if seg is None else cut(seg, "edge"))


def _cols(x, axis: int, src, width: int, halo=None):
  """Kv shard ``src``'s columns (``width`` of them, or its slice ``halo``) of ``x``'s key
  ``axis``."""
  x = lax.dynamic_slice_in_dim(x, src * width, width, axis=axis)
  return x if halo is None else halo_lib.take(x, halo.runs, halo.padded, axis=axis)


def _step_ops(st: RingStatic, q, q_info, kv_info, fixed: _Fixed, src, width: int, halo=None):
  """The Operands of (this q shard, kv shard ``src``, or its slice ``halo``): the key columns
  of that shard of each operand that spans the keys, and the dropout keys of its (global) key
  positions."""
  terms = operands.map_axis(fixed.terms, operands.KEYS,
                            lambda x, axis: _cols(x, axis, src, width, halo))
  return pair.kernel_operands(q_info, kv_info, terms, fixed.seeds, fixed.offsets, q.shape[0],
                              q.shape[2], broadcast=st.dropout_broadcast)


def pair_forward(st: RingStatic, q, k, v, ops: common.Operands,
                  acc: Optional[common.Partial] = None, plan=None) -> common.Partial:
  """Kernel forward of one (q shard, kv shard) pair merged into ``acc`` (the earlier pairs'
  result, or None), skipped when its plan (default: the planner's for ``ops``) has nothing live."""
  plan = st.planner.plan(ops) if plan is None else plan
  b, tp, n, hv = *q.shape[:3], v.shape[-1]
  dt = common.acc_dtype(q.dtype)

  def run():
    o, lse = kernels.get(st.backend).forward(q, k, v, ops, plan, st.cfg, acc)
    return common.Partial(o.astype(dt), lse)

  def skip():
    if acc is not None:
      return acc
    return common.Partial(jnp.zeros((b, tp, n, hv), dt), jnp.full((b, n, tp), -jnp.inf, dt))

  return lax.cond(plan.any_live, run, skip) if st.use_cond else run()


def pair_backward(st: RingStatic, q, k, v, do, lse, delta, ops: common.Operands, dq=None,
                   parts=common.BOTH, plan=None, dkv=None):
  """``(dq, dk, dv, dterms)`` of one pair (dterms: ``{name: cotangent}`` of the differentiable
  operands' columns of this kv shard, ``pair.ops_grad``), its dq added to ``dq`` (the earlier
  pairs', or None) and its dk, dv to ``dkv = (dk, dv)`` (this shard's so far, or None;
  lowerings add both inside their kernels where they can). ``parts=common.DQ`` computes only dq
  and dterms, ``common.DKV`` only dk and dv (the others None, dterms empty). ``plan``: the
  backward's (default: the planner's for ``ops``)."""
  want_dq, want_dkv = common.wants(parts)
  plan = st.planner.plan(ops, backward=True) if plan is None else plan
  with_terms = want_dq and pair.differentiable(ops)

  def run():
    grads = kernels.get(st.backend).backward(q, k, v, do, lse, delta, ops, plan, st.cfg, dq,
                                             parts, dkv)
    return (*grads, pair.ops_grad(q, k, v, do, lse, delta, ops, st.cfg) if with_terms else {})

  def skip():
    zeros = lambda x: jnp.zeros(x.shape, common.acc_dtype(q.dtype))
    dq_ = (zeros(q) if dq is None else dq) if want_dq else None
    dk, dv = ((zeros(k), zeros(v)) if dkv is None else dkv) if want_dkv else (None, None)
    terms = {name: jnp.zeros(getattr(ops, name).shape, getattr(ops, name).dtype)
             for name in pair.differentiable(ops)} if with_terms else {}
    return dq_, dk, dv, terms

  return lax.cond(plan.any_live, run, skip) if st.use_cond else run()


def _gather(x, st):
  """All-gathers a ``[B, L, ...]`` shard along the sequence and pads it to ``st.kv_padded``."""
  if x is None:
    return None
  x = lax.all_gather(x, st.axis_name, axis=1, tiled=True)
  return jnp.pad(x, [(0, 0), (0, st.kv_padded - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def _gather_info(info, st):
  return block_sparse.TokenInfo(_gather(info.positions, st), _gather(info.segment_ids, st))


def _ring_forward(st: RingStatic, q, kv, q_info, kv_info, fixed: _Fixed):
  """Returns ``(o, lse)`` in the accumulation dtype over all kv shards (before sinks); ``kv``:
  this shard's ``(k, v)``."""
  rank = lax.axis_index(st.axis_name)
  sp = kv[0].shape[1]
  if st.strategy == "all_gather":
    ops = _step_ops(st, q, q_info, _gather_info(kv_info, st), fixed, 0, st.kv_padded)
    return pair_forward(st, q, _gather(kv[0], st), _gather(kv[1], st), ops,
                         plan=st.planner.plan(ops, False, rank, 0))

  def compute(kv, moving, src, acc=None, chain=None):
    sub, h = st.for_pair(chain), st.halo(chain)
    ops = _step_ops(sub, q, q_info, _step_info(sub, moving, src, sp, h), fixed, src, sp, h)
    return pair_forward(sub, q, kv[0], kv[1], ops, acc, sub.planner.plan(ops, False, rank, src))

  # Each step first sends its K/V on (a chain's halo: only its slice), so the send overlaps this
  # step's kernel, which merges its result into the running one. Each direction's first send
  # overlaps the local pair.
  local = (kv, _moving_info(st, kv_info))
  sent = [_sent(st, local, i) for i in range(len(st.chains))]
  packers = [packer(x, st) for x in sent]
  first = [send(pack(x), st, d) for x, (pack, _), (d, _) in zip(sent, packers, st.chains)]
  acc = compute(*local, rank)
  for i, ((d, n), held, (pack, unpack)) in enumerate(zip(st.chains, first, packers)):
    acc = _forward_chain(st, functools.partial(compute, chain=i), rank, held, d, n, acc, pack,
                         unpack)
  return tuple(acc)


def _forward_chain(st: RingStatic, compute, rank, held, d: int, n: int, acc, pack, unpack):
  """Steps 1 .. n of the K/V travelling in direction ``d`` (``held``: step 1's as they came;
  ``pack``, ``unpack``: ``sends.packer``'s), merged into ``acc``; the last is not sent on."""
  src = lambda step: (rank - d * step) % st.ring_size

  def body(carry, step):
    acc, held = carry
    kv = unpack(held)
    nxt = send(held if st.forward_received else pack(kv), st, d)
    return (compute(*kv, src(step), acc), nxt), None

  if n > 1:
    steps = jnp.arange(1, n, dtype=jnp.int32)  # (int32 under x64 too)
    (acc, held), _ = lax.scan(body, (acc, held), steps, unroll=st.unroll)
  return compute(*unpack(held), src(n), acc)


def _ring_backward(st: RingStatic, q, kv, do, lse, delta, q_info, kv_info, fixed: _Fixed, step_kv):
  """``(dq, dk, dv, dterms)``; dterms: ``{name: cotangent}`` of the differentiable operands of
  ``fixed.terms``, in their full-width layout. ``step_kv``: a step's K/V as the kernels take them
  (FP8 ones travel as they are: ``fp8.ring_operands``)."""
  r = st.ring_size
  rank = lax.axis_index(st.axis_name)
  sp = kv[0].shape[1]
  if st.strategy == "all_gather":
    ops = _step_ops(st, q, q_info, _gather_info(kv_info, st), fixed, 0, st.kv_padded)
    dq, dk, dv, dterms = pair_backward(st, q, *step_kv([_gather(x, st) for x in kv]), do, lse,
                                        delta, ops, plan=st.planner.plan(ops, True, rank, 0))
    scatter = lambda x: lax.psum_scatter(x[:, :sp * r], st.axis_name, scatter_dimension=1,
                                         tiled=True)
    return dq, scatter(dk), scatter(dv), dterms

  def put(full, name, step, src, h):
    """A step's cotangent columns of operand ``name`` written into its full-width one: each
    step owns the columns of its kv shard (or slice)."""
    axis = operands.BY_NAME[name].axis(operands.KEYS)
    if h is not None:
      step = halo_lib.put(_cols(full, axis, src, sp), step, h.runs, axis=axis)
    return lax.dynamic_update_slice_in_dim(full, step.astype(full.dtype), src * sp, axis)

  def compute(kv, moving, src, dterms, dq=None, parts=common.BOTH, dkv=None, chain=None):
    """This step's pair: ``dq`` so far plus its own, ``dkv = (dk, dv)`` so far of the shard
    (or chain ``chain``'s slice of it) it holds plus its own, and ``dterms`` (``parts``: only
    dq and dterms, or only dk and dv)."""
    sub, h = st.for_pair(chain), st.halo(chain)
    ops = _step_ops(sub, q, q_info, _step_info(sub, moving, src, sp, h), fixed, src, sp, h)
    dq, dk, dv, step = pair_backward(sub, q, *step_kv(kv), do, lse, delta, ops, dq, parts,
                                     sub.planner.plan(ops, True, rank, src), dkv)
    dterms = {name: put(full, name, step[name], src, h) for name, full in dterms.items()}
    return dq, None if dk is None else (dk, dv), dterms

  # dK/dV travel with the shard they belong to, one step behind it: each step first sends the
  # next K/V and the finished dK/dV of the previous step's shard, so both overlap the kernels.
  # After a direction's last step its dK/dV go home (one collective; on the whole ring that is
  # the next device). The local pair runs whole, first, where the backend's backward fuses
  # (``whole_local_pair``: one call cheaper than two), else in two halves: its dQ first, while
  # the first K/V travel, and its dK/dV last, while the other devices' sum of this shard's dK/dV
  # makes its way home (so that hop overlaps a kernel too).
  # A chain with a halo sends its slice and gets the slice's dK/dV home.
  local = (kv, _moving_info(st, kv_info))
  first = [rotate(_sent(st, local, i), st, d) for i, (d, _) in enumerate(st.chains)]
  dterms = {name: jnp.zeros(x.shape, common.acc_dtype(q.dtype)) for name, x in fixed.terms.items()
            if operands.BY_NAME[name].differentiable}
  whole = st.whole_local_pair
  dq, own, dterms = compute(*local, rank, dterms, parts=common.BOTH if whole else common.DQ)
  home, slices = None, []
  for i, ((d, n), held) in enumerate(zip(st.chains, first)):
    dq, dkv, dterms = _backward_chain(st, functools.partial(compute, chain=i), rank, held, d, n,
                                      dq, dterms)
    back = rotate(dkv, st, -d * n)
    if st.halo(i) is not None:  # a slice's dK/dV: added into the local pair's at its runs
      slices.append((st.halo(i).runs, back))
    else:
      home = back if home is None else jax.tree.map(jnp.add, home, back)
  if whole:
    dkv = own if home is None else jax.tree.map(jnp.add, own, home)
  else:
    _, dkv, _ = compute(*local, rank, {}, parts=common.DKV, dkv=home)
  for runs, back in slices:
    dkv = tuple(halo_lib.put(x, y, runs, add=True) for x, y in zip(dkv, back))
  return (dq, *dkv, dterms)


def _backward_chain(st: RingStatic, compute, rank, held, d: int, n: int, dq, dterms):
  """Steps 1 .. n of the K/V travelling in direction ``d`` (``held``: step 1's): ``(dq, dkv,
  dterms)``, ``dkv`` the dK/dV of the shard of the last step (on the device ``n`` hops from its
  own). Each step's dK/dV are added to those received with its shard (inside the kernels where
  the lowering can: no second buffer for the sum)."""
  src = lambda step: (rank - d * step) % st.ring_size
  nxt = rotate(held, st, d) if n > 1 else None  # step 1 sends its K/V on unless it is the last
  dq, dkv, dterms = compute(*held, src(1), dterms, dq)
  if n == 1:
    return dq, dkv, dterms

  def body(carry, step):
    dq, held, dkv, dterms = carry
    nxt, dkv_in = rotate((held, dkv), st, d)
    dq, dkv, dterms = compute(*held, src(step), dterms, dq, dkv=dkv_in)
    return (dq, nxt, dkv, dterms), None

  carry = (dq, nxt, dkv, dterms)
  if n > 2:
    carry, _ = lax.scan(body, carry, jnp.arange(2, n, dtype=jnp.int32), unroll=st.unroll)
  dq, held, dkv, dterms = carry
  dkv_in = rotate(dkv, st, d)  # the last shard's K/V go nowhere
  return compute(*held, src(n), dterms, dq, dkv=dkv_in)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _ring(q, k, v, sinks, q_info, kv_info, fixed, st):
  return _ring_fwd(q, k, v, sinks, q_info, kv_info, fixed, st)[0]


def _ring_fwd(q, k, v, sinks, q_info, kv_info, fixed, st):
  descales = fixed.terms.get("fp8")
  # ``quantize=``: q, k, v quantized here, so K/V travel as FP8; primals: their dtypes
  (q, k, v), primals = fp8.quantized_primals(q, k, v, descales, st.quantize)
  o, lse = _ring_forward(st, q, (k, v), q_info, kv_info, fixed)
  o, lse = pair.finish_forward(o, lse, sinks, fp8.compute_dtype(q, descales))
  return (o, lse), (q, k, v, sinks, q_info, kv_info, fixed, primals, o, lse)


def _ring_bwd(st, res, cts):
  q, k, v, sinks, q_info, kv_info, fixed, primals, o, lse = res
  # FP8 q, k, v: K/V sent in FP8, read as FP8 or dequantized by each step (``ring_operands``)
  (q, kv, step_kv, terms), cotangents = fp8.ring_operands(q, k, v, fixed.terms, primals,
                                                        kernels.get(st.backend))
  do, dlse = cts  # dlse: None when zero (pair.defvjp_symbolic)
  delta = common.row_delta(o, do, dlse)
  run = pair.first_order_only(functools.partial(_ring_backward, st, step_kv=step_kv))
  dq, dk, dv, dterms = run(q, kv, do.astype(fp8.compute_dtype(q, fixed.terms.get("fp8"))), lse,
                           delta, q_info, kv_info, fixed._replace(terms=terms))
  # This shard's rows only: shard_map's transpose of the replicated sinks sums the ring.
  dsinks = None if sinks is None else pair.sinks_grad(sinks, lse, delta).astype(sinks.dtype)
  none = lambda tree: jax.tree.map(lambda _: None, tree)
  dfixed = none(fixed)._replace(terms={name: dterms[name].astype(x.dtype) if name in dterms
                                       else None for name, x in fixed.terms.items()})
  return (*cotangents(dq, dk, dv), dsinks, none(q_info), none(kv_info), dfixed)


pair.defvjp_symbolic(_ring, _ring_fwd, _ring_bwd)


def ring_attention(q, k, v, *, axis_name, mask=None, layout: str = "contiguous", segment_ids=None,
                   positions=None, dense_mask=None, sinks=None, softcap=None, scale=None,
                   block_sizes: Optional[BlockSizes] = None, backend: str = "auto",
                   interpret=None, strategy: str = "ring", scan_unroll: int = 1,
                   return_lse: bool = False, bias=None, alibi_slopes=None,
                   dropout_rate: float = 0.0, dropout_rng=None, cu_seqlens=None,
                   dropout_broadcast: bool = False, dropout_batch_offset=0,
                   dropout_head_offset=0, ring_variants: Optional[halo_lib.RingVariants] = None,
                   q_descale=None, k_descale=None, v_descale=None, out_dtype=None,
                   quantize=None):
  """Attention of this device's query shard against the K/V shards of the whole ring.

  Call inside ``shard_map`` (or any context where ``axis_name`` is bound).

  Args:
    q: ``[B, T/R, N, H]`` this device's queries, in layout order.
    k, v: ``[B, T/R, K, H]`` this device's keys and values.
    axis_name: the sequence-parallel mesh axis.
    mask: a mask spec in global positions (default Full).
    layout: ``"contiguous" | "zigzag" | "striped"``: which global positions this shard holds.
    segment_ids: ``[B, T/R]`` this shard's segment ids (sharded like the tokens); they rotate
      with K/V.
    positions: ``[T/R]`` or ``[B, T/R]`` global positions of this shard; default from
      ``layouts.positions(T, layout, R, rank)``.
    dense_mask: bool broadcastable to ``[B, N, T/R, T]``: this shard's query rows against all
      keys in layout order.
    sinks, softcap, scale, block_sizes, backend, interpret: as ``flash_attention``.
    strategy: ``"ring"`` (ppermute K/V each step) or ``"all_gather"`` (gather K/V once).
    scan_unroll: unroll factor of the ring scan.
    return_lse: also return this shard's ``lse [B, N, T/R]``.
    bias: additive logit bias broadcastable to ``[B, N, T/R, T]``: this shard's query rows
      against all keys in layout order (differentiable).
    alibi_slopes, dropout_rate, dropout_rng, dropout_broadcast, dropout_batch_offset,
      dropout_head_offset: as ``flash_attention``; ALiBi and the dropout hash use global
      positions, so the result does not depend on the layout or ring size.
    cu_seqlens: int ``[D + 1]`` cumulative lengths of sequences packed along the *global*,
      naturally ordered sequence (B must be 1); each token's sequence comes from its layout
      position, and tokens past ``cu_seqlens[-1]`` are padding (output 0). Excludes
      ``segment_ids`` and ``positions``.
    q_descale, k_descale, v_descale, out_dtype: as ``flash_attention``; FP8 operands are
      dequantized here, as each device's descales may differ (not so in sharded_attention).
    quantize: as ``flash_attention``; the scales are the maxima over the whole ring, so that
      K/V travel and are attended as FP8.
    ring_variants: a ``RingVariants`` (None: its defaults: halos on, small halos gathered once,
      ``halo_gather``); e.g. ``RingVariants(halo=False)`` sends whole shards every step.

  Returns:
    ``[B, T/R, N, Hv]`` in ``out_dtype`` (and lse when ``return_lse``).
  """
  layouts.check_layout(layout)
  if strategy not in RING_STRATEGIES:
    hint = (" Ulysses exchanges heads across the axis: run it through sharded_attention."
            if strategy in STRATEGIES else "")
    raise ValueError(f"`strategy`={strategy!r} is not a strategy of ring_attention; use one of "
                     f"{RING_STRATEGIES}.{hint}")
  try:
    r = lax.axis_size(axis_name)
  except NameError as e:
    raise ValueError(
        f"ring_attention(axis_name={axis_name!r}) must run where that mesh axis is bound: inside "
        f"`jax.shard_map(..., mesh=mesh)` over a mesh with a {axis_name!r} axis. For global arrays "
        "call pallas_ring.sharded_attention(q, k, v, mesh=mesh, config=...), which does that."
    ) from e
  q, k, v, descales, compute, out_dtype = fp8.prepare(
      q, k, v, q_descale, k_descale, v_descale, out_dtype, read_fp8=False, quantize_to=quantize,
      axis_name=axis_name)
  checked = call.check(
      q, k, v, kv_shards=r, mask=mask, segment_ids=segment_ids, kv_segment_ids=segment_ids,
      q_positions=positions, kv_positions=positions,
      operands=dict(dense_mask=dense_mask, bias=bias, alibi_slopes=alibi_slopes, sinks=sinks,
                    fp8_descales=descales),
      softcap=softcap, scale=scale, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
      dropout_offsets=(dropout_batch_offset, dropout_head_offset),
      dropout_broadcast=dropout_broadcast, block_sizes=block_sizes, backend=backend,
      interpret=interpret, return_lse=return_lse, names=("positions", "positions"),
      dtype=compute, quantize=quantize)
  b, t = q.shape[:2]
  if k.shape[1] != t:
    raise ValueError(f"ring_attention needs equal q and k/v shard lengths (self-attention over "
                     f"one sharded sequence), got q {t} and k/v {k.shape[1]}.")
  if cu_seqlens is not None:
    packing.check_cu_seqlens("cu_seqlens", cu_seqlens, t * r, b, segment_ids)
    packing.check_positions(cu_seqlens, positions, False, "no positions (the layout's)")
  if ring_variants is not None and not isinstance(ring_variants, halo_lib.RingVariants):
    raise ValueError(f"`ring_variants`={ring_variants!r} is not a RingVariants: pass "
                     "pallas_ring.halo.RingVariants(...) or None (the defaults).")
  out = run(q, k, v, checked, axis_name=axis_name, layout=layout, strategy=strategy,
            scan_unroll=scan_unroll, cu_seqlens=cu_seqlens, variants=ring_variants)
  # (values cannot be read under jit: a float dense mask's misuse, x64 ids or positions beyond
  # int32 and invalid cu_seqlens make the output NaN)
  return validation.poison(fp8.cast_output(out, out_dtype),
                           operands.dense_mask_misuse(dense_mask),
                           validation.int32_overflow(segment_ids, positions),
                           packing.misuse(cu_seqlens, t * r))


def run(q, k, v, checked: call.Checked, *, axis_name, layout: str, strategy: str,
        scan_unroll: int, cu_seqlens=None, variants: Optional[halo_lib.RingVariants] = None):
  """``ring_attention`` of a checked call (``call.check``, with ``kv_shards`` the ring size)
  over this device's shards: derives what depends on the device's rank and runs the ring;
  nothing is checked again. ``variants``: the ring's schedule variants (None: defaults)."""
  variants = halo_lib.RingVariants() if variants is None else variants
  r = lax.axis_size(axis_name)
  t = q.shape[1]
  arrays = checked.arrays
  segment_ids, kv_segment_ids = arrays.segment_ids, arrays.kv_segment_ids
  layout_pos = layouts.positions(t * r, layout, r, lax.axis_index(axis_name))
  if cu_seqlens is not None:  # sequences of the natural order: each token's by its position
    # (given positions here are a Placement's, B = 1: the tokens' original indices)
    index = layout_pos if arrays.q_positions is None else arrays.q_positions.reshape(-1)
    segment_ids = packing.packed_segment_ids(cu_seqlens, index, packing.Q_PAD)
    kv_segment_ids = packing.packed_segment_ids(cu_seqlens, index, packing.KV_PAD)
  if r == 1:  # (default positions stay None: flash_attention's own, whose plan is built ahead)
    arrays = arrays._replace(segment_ids=segment_ids, kv_segment_ids=kv_segment_ids)
    return attention.run(q, k, v, checked._replace(arrays=arrays))
  positions = arrays.q_positions
  derived = positions is None
  if derived:
    positions = layout_pos
    # (both strategies: the slices a local mask reaches are all either would gather)
    local = not operands.spanning(arrays.terms, operands.KEYS)
    mask = checked.settings.mask
    if local and reach_lib.ring_reach(mask, t * r, layout, r) == (0, 0):
      # The mask reaches no other shard (e.g. chunks inside shards): flash attention on this
      # shard, without the ring's float32 accumulators (BENCHMARKS.md, "Reach-limited ring").
      arrays = arrays._replace(segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                               q_positions=layout_pos, kv_positions=layout_pos)
      return attention.run(q, k, v, checked._replace(arrays=arrays))
    pieces = local and halo_gather.pieces(mask, t * r, layout, r, variants)
    if pieces:  # it reaches small slices of other shards: receive them, attend once
      return halo_gather.run(q, k, v, checked, segment_ids, kv_segment_ids, layout_pos, pieces,
                             axis_name=axis_name, layout=layout)
  on = functools.partial(_ring_on, settings=checked.settings, axis_name=axis_name, ring_size=r,
                         layout=layout, derived_positions=derived, strategy=strategy,
                         scan_unroll=scan_unroll,
                         variants=variants)
  with pair.forward_mode_errors():
    return kernels.dispatch(on, checked.per_platform, q, k, v, segment_ids, kv_segment_ids,
                            positions, arrays.terms, arrays.seeds, arrays.offsets)


def _ring_on(backend, interpret, q, k, v, segment_ids, kv_segment_ids, positions, terms, seeds,
             offsets, *, settings: call.Settings, axis_name, ring_size, layout, derived_positions,
             strategy, scan_unroll, variants: halo_lib.RingVariants):
  """``ring_attention`` on one resolved backend: pads to its tiles, runs the ring, un-pads."""
  cs, r, derived = settings, ring_size, derived_positions
  impl = kernels.get(backend)
  (q, k, v), terms, _, quantize = fp8.for_backend(impl, q, k, v, terms, cs.quantize)
  b, t, _, _ = q.shape
  h, hv = pair.kernel_head_dim(q, v), v.shape[-1]
  gather = strategy == "all_gather"
  tiles = tuning.resolve(backend, cs.block_sizes, t, t * r if gather else t, h,
                         dtype=q.dtype if quantize is None else quantize,
                         group=q.shape[2] // k.shape[2],
                         mask_class=tile_cache.mask_class(cs.mask, segment_ids is not None))
  info = block_sparse.make_token_info(t, b, positions, segment_ids)
  kv_info = block_sparse.make_token_info(t, b, positions, kv_segment_ids)
  blocks_q, blocks_kv = (tiles.block_q, tiles.block_q_bwd), (tiles.block_kv, tiles.block_kv_bwd)
  if gather:  # K/V are gathered unpadded and padded once as a whole
    tp = tuning.padded_len(t, *blocks_q)
    kv_padded, shard_len = tuning.padded_len(t * r, *blocks_kv), t
  else:  # every shard is padded alike; its padding is masked by the local key index
    tp = tuning.padded_len(t, *blocks_q, *blocks_kv)
    kv_padded, shard_len = tp, tp
    kv_info = block_sparse.pad_token_info(kv_info, tp)
  q_info = block_sparse.pad_token_info(info, tp)
  hp = tuning.padded_head_dim(backend, h)
  cfg = pair.kernel_config(tiles, mask=cs.mask, scale=cs.scale, softcap=cs.softcap, q_len=t,
                           kv_len=t * r if gather else t, out_dtype=common.acc_dtype(q.dtype),
                           interpret=interpret, dropout_rate=cs.dropout_rate)
  gpu = impl.platform == "gpu"
  planner = plans.for_config(cfg, tp, kv_padded,
                             plans.RingLayout(t * r, layout, r, gather) if derived else None)
  # The ring goes as far as the mask reaches, where the positions are the layout's own.
  reach = reach_lib.ring_reach(cs.mask, t * r, layout, r) if derived and not gather else None
  whole = variants.whole_local_pair
  if whole is None:  # (where one call is cheaper than its halves: the fused backward)
    whole = impl.fuses_backward(cfg, hp, segments=segment_ids is not None,
                                fp8="fp8" in terms or quantize is not None)
  st = RingStatic(cfg, backend, axis_name, r, strategy, scan_unroll, kv_padded, planner,
                  use_cond=not gpu, pack_sends=gpu, forward_received=variants.forward_received,
                  whole_local_pair=whole,
                  dropout_broadcast=cs.dropout_broadcast, quantize=quantize, reach=reach)
  if reach is not None:  # each chain sends only the slice of a shard the mask sees (a halo)
    halos = tuple(halo_lib.make(cfg, planner, c, blocks_kv, variants, tuning.padded_len)
                  for c in st.chains)
    st = dataclasses.replace(st, halos=halos if any(halos) else ())

  def pad_cols(x, axis):
    """Key columns: each kv shard padded to its padded length (ring), or the gathered axis
    padded once (all_gather)."""
    if gather:
      return jnp.pad(x, [(0, kv_padded - t * r if a == axis else 0) for a in range(x.ndim)])
    x = x.reshape(*x.shape[:axis], r, t, *x.shape[axis + 1:])
    x = jnp.pad(x, [(0, tp - t if a == axis + 1 else 0) for a in range(x.ndim)])
    return x.reshape(*x.shape[:axis], r * tp, *x.shape[axis + 2:])

  padded = operands.pad(terms, queries=tp, keys=t * r)  # (rows; columns below)
  fixed = _Fixed(operands.in_kernel(operands.map_axis(padded, operands.KEYS, pad_cols)), seeds,
                 offsets)
  pad = pair.pad_tokens
  out, lse = _ring(pad(q, tp, hp), pad(k, shard_len, hp), pad(v, shard_len, hp),
                   terms.get("sinks"), q_info, kv_info, fixed, st)
  out = out[:, :t, :, :hv]
  return (out, lse[:, :, :t]) if cs.return_lse else out


__all__ = ["ring_attention"]
