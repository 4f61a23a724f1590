"""``strategy="auto"``: ring, all_gather or ulysses chosen per call by a simple cost model.

Each strategy's time for one layer's forward on one device is modelled from two rates and two
factors:

* compute: ``4 * (T / R) * T * f * N * H`` flops (QK^T and PV) at ``flops_per_s``, where ``f``
  is the share of (query, key) pairs the mask leaves visible (``visible_fraction``);
* communication: the bytes each device sends (``aot.bytes_moved``'s formulas, the ring's hops
  from ``reach.ring_reach``, each hop the share of a shard its halo sends, ``halo.share``) at
  ``bytes_per_s``.

The ring overlaps its sends with the kernels, so it costs ``max(compute * ring_slowdown, comm)``
plus a fixed ``step_s`` per hop (a kernel launch and a collective's latency): its kernels, one
per step beside NCCL's, run a little slower than one call over the whole sequence. all_gather and
Ulysses send before they compute: ``comm + compute``. With segment ids or ``cu_seqlens``
(packed documents) and a ring that takes hops, the strategies that split the queries by tokens
(ring, all_gather) pay ``packed_imbalance``, an empirical factor for what a pack costs them: the
busiest device's work, which a lock-step ring waits for at every step, and the ring's sends of
whole shards that hold little visible work. Ulysses splits heads and attends every document on
every device, balanced whatever the packing. (Segment ids that only mark padding pay it too.)
Ulysses needs N divisible by the axis size. The cheapest wins; ties go to the ring, then
Ulysses.

The ``CostModel`` defaults are fitted to H100 measurements (BENCHMARKS.md, "Choosing a
strategy"; ``tools/reach_timing.py --parts strategies,pack``); ``step_s`` is stated, not
fitted. The choice depends on the rates' ratio and the factors only.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from pallas_ring import halo as halo_lib
from pallas_ring import masks as masks_lib
from pallas_ring import reach as reach_lib
from pallas_ring import ulysses


@dataclasses.dataclass(frozen=True)
class CostModel:
  """The rates and factors ``choose`` models each strategy's time with."""

  flops_per_s: float = 600e12  # attention kernel throughput per device (bf16 causal forward)
  bytes_per_s: float = 280e9  # collective bandwidth per device, one direction (a ppermute)
  step_s: float = 20e-6  # fixed cost of one ring step (launch, collective latency)
  ring_slowdown: float = 1.035  # the ring's per-step kernels against one whole-sequence call
  packed_imbalance: float = 1.4  # ring / all_gather factor on packed documents (with hops)


@dataclasses.dataclass(frozen=True)
class Choice:
  """What ``choose`` picked and why."""

  strategy: str  # "ring" | "all_gather" | "ulysses"
  seconds: tuple  # ((strategy, modelled seconds), ...) of every candidate, cheapest first
  reach: tuple  # the ring's (forward, backward) hops

  def describe(self) -> str:
    costs = ", ".join(f"{s} {t * 1e6:.0f} us" for s, t in self.seconds)
    return (f"strategy='auto' chose {self.strategy!r} (modelled forward per device: {costs}; "
            f"ring hops forward/backward {self.reach[0]}/{self.reach[1]})")


def visible_fraction(spec: masks_lib.MaskSpec, seq_len: int) -> float:
  """Roughly the share of (query, key) pairs ``spec`` leaves visible over ``seq_len`` tokens:
  a window's width over T, a half for causal masks, all for the rest."""
  left, right = reach_lib.key_bounds(spec)
  if left is not None and right is not None:
    return min(1.0, (left + right + 1) / seq_len)
  return 0.5 if masks_lib.is_causal(spec) or left is not None or right is not None else 1.0


def choose(spec: masks_lib.MaskSpec, *, seq_len: int, heads: int, kv_heads: int,
           head_dim: int, ring_size: int, layout: str, itemsize: int,
           derived_positions: bool = True, ulysses_heads: Optional[int] = None,
           variants: halo_lib.RingVariants = halo_lib.RingVariants(),
           segmented: bool = False, model: CostModel = CostModel()) -> Choice:
  """The strategy of least modelled time (module docstring) for one call.

  Args:
    spec: the mask spec.
    seq_len: T, tokens of the whole sequence; heads, kv_heads, head_dim: N, K, H per device's
      head group; ring_size: R, devices of the sequence axis; layout: the token layout.
    itemsize: bytes per element of K/V.
    derived_positions: False when the caller gives positions (the ring then goes all the way).
    ulysses_heads: the query heads Ulysses would split (None: ``heads``).
    variants: the ring's variants (``RingVariants(halo=False)``: whole shards every hop).
    segmented: whether the call has segment ids or ``cu_seqlens`` (packed documents, whose
      work per token shard is uneven).
    model: the rates (``CostModel``).
  """
  r, t = ring_size, seq_len
  reach = (reach_lib.ring_reach(spec, t, layout, r) if derived_positions and r > 1
           else (r - 1, 0))
  compute = 4 * (t / r) * t * visible_fraction(spec, t) * heads * head_dim / model.flops_per_s
  kv_shard = 2 * (t / r) * kv_heads * head_dim * itemsize  # one device's K and V
  hops = sum(reach)
  by_tokens = compute * (model.packed_imbalance if segmented and hops else 1.0)  # ring, gather
  # Each hop of a chain sends its halo's share of a shard (``halo.share``; 1 without a halo).
  chains = [(d, n) for d, n in ((1, reach[0]), (-1, reach[1])) if n]
  sent = sum(n * (halo_lib.share(spec, t, layout, r, (d, n), variants) if derived_positions
                  else 1.0) for d, n in chains) * kv_shard
  seconds = {
      "ring": max(by_tokens * model.ring_slowdown, sent / model.bytes_per_s)
              + hops * model.step_s,
      "all_gather": (r - 1) * kv_shard / model.bytes_per_s + by_tokens,
  }
  n = heads if ulysses_heads is None else ulysses_heads
  try:
    ulysses.check_heads(n, r, "axis_name", "")
    kv = kv_heads * ulysses.kv_repeats(kv_heads, r)
    # q, k, v out and o back: (R-1)/R of the device's (T/R) tokens each
    sent = (r - 1) / r * (t / r) * head_dim * itemsize * (2 * n + 2 * kv)
    seconds["ulysses"] = sent / model.bytes_per_s + compute
  except ValueError:
    pass
  preference = ("ring", "ulysses", "all_gather")  # (ties)
  order = sorted(seconds.items(), key=lambda kv_: (kv_[1], preference.index(kv_[0])))
  return Choice(order[0][0], tuple(order), reach)


__all__ = ["Choice", "CostModel", "choose", "visible_fraction"]
