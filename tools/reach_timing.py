"""Issue 59's targets on the local GPUs: the reach-limited ring, balanced packed documents and
``strategy="auto"``, forward+backward, bf16 (float32 on CPU), MHA ``--heads``/``--heads``,
``--head-dim``, ``--tokens`` per device, timed interleaved on the device clock
(``timing.interleaved_samples``; the host's clock on CPU), sustained batches and lone calls:

* ``reach``: ``SlidingWindow(--window)`` and ``ChunkedCausal(--chunk)`` in the contiguous and
  zigzag layouts through ``ring_attention`` under ``shard_map``: the defaults (narrow halos
  gathered once and attended in one call), halos sent by ring steps
  (``RingVariants(gather_halos=False)``) and whole shards (``RingVariants(halo=False)``), against
  one device's own tokens' local work (``flash_attention`` on ``--tokens`` tokens; target:
  ring / local <= 1.3);
* ``pack``: a long-tail pack of 12 documents (causal): the ring in zigzag order against the
  ring on ``layouts.balance``, Ulysses and ``"auto"`` (target: zigzag / each >= 1.15 on 2 GPUs,
  >= 1.3 on 4), beside the work model's bound (the lock-step sum of each step's busiest
  device);
* ``strategies``: ``sharded_attention`` with each fixed strategy and ``"auto"`` for window,
  chunked, causal and dense masks, zigzag (target: auto within 5% of the best), and the
  rates ``auto.CostModel`` is fitted from (the local kernel's TFLOP/s, a ``ppermute``'s GB/s).

  NCCL_NVLS_ENABLE=0 PYTHONPATH=. python tools/reach_timing.py --tokens 32768
  XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu PYTHONPATH=. \\
    python tools/reach_timing.py --tokens 512          # CPU smoke run (small heads, 2 reps)
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from pallas_ring import SequenceParallelConfig, flash_attention, layouts, masks, ring_attention
from pallas_ring import balance, sharded_attention, timing
from pallas_ring.halo import RingVariants

LONG_TAIL = [700, 420, 260, 180, 130, 100, 80, 60, 40, 32, 28, 18]  # shares of the pack
WHOLE = RingVariants(halo=False)  # the ring before halos: whole shards every hop
STEPPED = RingVariants(gather_halos=False)  # halos sent by ring steps, not gathered at once
STRATEGIES = ("ring", "all_gather", "ulysses")


def _fwd_bwd(f):
  return jax.jit(lambda q, k, v: jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)),
                                          argnums=(0, 1, 2))(q, k, v))


def _ring(mesh, mask, layout, variants):
  """Forward+backward of ``ring_attention`` over the mesh's "sp" axis (global arrays in layout
  order)."""
  spec = P(None, "sp")
  f = lambda q, k, v: ring_attention(q, k, v, axis_name="sp", mask=mask, layout=layout,
                                     ring_variants=variants)
  return _fwd_bwd(jax.shard_map(f, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec,
                                check_vma=False))


def _sharded(mesh, mask, config, **kwargs):
  return _fwd_bwd(lambda *a: sharded_attention(*a, mesh=mesh, config=config, mask=mask,
                                               **kwargs))


class Timer:
  """Interleaved medians in ms of named calls: sustained batches and lone calls."""

  def __init__(self, reps: int, device: bool):
    self.reps, self.device = reps, device

  def __call__(self, calls: dict) -> dict:
    """``{name: (sustained ms, lone ms)}`` of ``{name: (jitted fn, args)}``."""
    both = {**calls, **{(n, "lone"): c for n, c in calls.items()}}
    with timing.clock("device" if self.device else "wall"):  # (one trace: jax#40260)
      got = timing.interleaved_samples(both, iters=3, reps=self.reps,
                                       batches={(n, "lone"): 1 for n in calls})
    return {n: (1e3 * statistics.median(got[n]), 1e3 * statistics.median(got[(n, "lone")]))
            for n in calls}


def _fmt(ms) -> str:
  return f"{ms[0]:8.2f} {ms[1]:8.2f}"


def reach(a, mesh, qkv, local_qkv, time, targets):
  """The reach table: per mask and layout, default / stepped / whole against local."""
  print(f"\n{'mask':30s} {'layout':10s} {'variant':8s} {'batch ms':>8s} {'lone ms':>8s} "
        "/local (batch, lone)")
  cases = [(m, l) for m in (masks.SlidingWindow(a.window), masks.ChunkedCausal(a.chunk))
           for l in ("contiguous", "zigzag")]
  calls = {}
  for mask, layout in cases:
    calls[mask, "local"] = (_fwd_bwd(lambda *x, m=mask: flash_attention(*x, mask=m)), local_qkv)
    for name, variants in (("default", None), ("stepped", STEPPED), ("whole", WHOLE)):
      if name in a.variants.split(","):
        calls[mask, layout, name] = (_ring(mesh, mask, layout, variants), qkv)
  got = time(calls)  # (all in one trace: jax#40260)
  for mask, layout in cases:
    local = got[mask, "local"]
    for name in a.variants.split(","):
      ms = got[mask, layout, name]
      ratio = [ms[i] / local[i] for i in (0, 1)]
      print(f"{mask!s:30s} {layout:10s} {name:8s} {_fmt(ms)}  {ratio[0]:.2f} {ratio[1]:.2f}",
            flush=True)
    print(f"{mask!s:30s} {layout:10s} {'local':8s} {_fmt(local)}", flush=True)
    if (mask, layout, "default") in got:
      ratio = got[mask, layout, "default"][0] / local[0]
      targets.append((f"{mask!s} {layout}: ring / local = {ratio:.2f}", "<= 1.3", ratio <= 1.3))


def _lockstep_work(seg, pos, r: int) -> np.ndarray:
  """``[R, R]`` visible causal pairs of query shard q against key shard (q - s) mod R at ring
  step s, for one row's layout-order segment ids and positions."""
  c = seg.size // r
  out = np.zeros((r, r))
  for qs in range(r):
    sq, pq = seg[qs * c:(qs + 1) * c], pos[qs * c:(qs + 1) * c]
    for s in range(r):
      ks = (qs - s) % r
      sk, pk = seg[ks * c:(ks + 1) * c], pos[ks * c:(ks + 1) * c]
      for d in np.unique(sq):
        out[qs, s] += np.searchsorted(np.sort(pk[sk == d]), pq[sq == d], side="right").sum()
  return out


def _pack(mesh, qkv):
  """``(calls, segment ids [1, T], placement)`` of the long-tail pack: the ring in zigzag order
  and on ``layouts.balance``, Ulysses and ``"auto"`` (both in the packed order)."""
  r, t = mesh.size, qkv[0].shape[1]
  lengths = np.round(np.asarray(LONG_TAIL) * t / sum(LONG_TAIL)).astype(int)
  lengths[0] += t - lengths.sum()
  seg = np.repeat(np.arange(len(lengths)), lengths)[None].astype(np.int32)
  placement = layouts.balance(seg, r)
  calls = {
      "zigzag": (_sharded(mesh, masks.Causal(), SequenceParallelConfig("sp", layout="zigzag"),
                          segment_ids=layouts.permute(seg, "zigzag", r)), qkv),
      "balanced": (_sharded(mesh, masks.Causal(), SequenceParallelConfig("sp"),
                            segment_ids=placement.permute(seg),
                            positions=jnp.asarray(placement.positions)), qkv)}
  # Ulysses attends every document on every device (a head group each): balanced by heads,
  # whatever the order; auto: what strategy="auto" picks for the pack.
  for s in ("ulysses", "auto"):
    if s != "ulysses" or qkv[0].shape[2] % r == 0:
      calls[s] = (_sharded(mesh, masks.Causal(), SequenceParallelConfig("sp", strategy=s),
                           segment_ids=seg), qkv)
  return calls, seg, placement


def pack(a, mesh, qkv, time, targets):
  """The long-tail pack: the zigzag ring against the balanced ring, Ulysses and auto."""
  r, t = mesh.size, qkv[0].shape[1]
  calls, seg, placement = _pack(mesh, qkv)
  zig = np.asarray(layouts.global_order(t, "zigzag", r))
  bound = {}
  for name, s, p in (("zigzag", seg[0][zig], zig), ("balanced", placement.permute(seg)[0],
                                                    np.asarray(placement.perm[0]))):
    w = _lockstep_work(s, p, r)
    bound[name] = w.max(axis=0).sum()
  with jax.set_mesh(mesh):
    got = time(calls)
  print(f"\nlong-tail pack (causal): work imbalance zigzag / balanced "
        f"{np.max(balance.contiguous_work(seg, r, 'zigzag')) / np.mean(placement.work):.3f} / "
        f"{placement.imbalance[0]:.3f}; lock-step work bound zigzag / balanced "
        f"{bound['zigzag'] / bound['balanced']:.2f}")
  for name, ms in got.items():
    print(f"  {name:9s} {_fmt(ms)}")
  from pallas_ring import auto
  (_, _, n, h), item = qkv[0].shape, jnp.dtype(qkv[0].dtype).itemsize
  print("  " + auto.choose(masks.Causal(), seq_len=t, heads=n, kv_heads=n, head_dim=h,
                           ring_size=r, layout="contiguous", itemsize=item,
                           segmented=True).describe())
  goal = 1.15 if r <= 2 else 1.3
  for name in got:
    if name != "zigzag":
      speed = [got["zigzag"][i] / got[name][i] for i in (0, 1)]
      print(f"  zigzag / {name} {speed[0]:.2f} (batch) {speed[1]:.2f} (lone)", flush=True)
      targets.append((f"long-tail pack: zigzag / {name} = {speed[0]:.2f}", f">= {goal}",
                      speed[0] >= goal))


def strategies(a, mesh, qkv, local_qkv, time, targets):
  """Each fixed strategy against ``"auto"``, and the rates the cost model is fitted from."""
  from pallas_ring import auto
  r, (b, t, n, h) = mesh.size, qkv[0].shape
  item = jnp.dtype(qkv[0].dtype).itemsize
  cases = [m for name, m in (("window", masks.SlidingWindow(a.window)),
                             ("chunked", masks.ChunkedCausal(a.chunk)),
                             ("causal", masks.Causal()), ("full", masks.Full()))
           if name in a.masks.split(",")]
  calls = {}
  for mask in cases:
    for s in STRATEGIES:
      if s != "ulysses" or n % r == 0:
        calls[mask, s] = (_sharded(mesh, mask, SequenceParallelConfig("sp", layout="zigzag",
                                                                      strategy=s)), qkv)
  # The cost model's rates: the local causal kernel's forward throughput (on every device at
  # once: under the mesh, arrays live on all of its devices), and one ppermute of a shard's K
  # and V (what a ring hop sends).
  calls["forward"] = (jax.jit(lambda *x: flash_attention(*x, mask=masks.Causal())),
                      jax.device_put(local_qkv, NamedSharding(mesh, P())))
  if not a.cpu:  # (a lone ppermute beside other programs can stall XLA:CPU's rendezvous)
    kv = jax.device_put(jnp.stack(qkv[1:]), NamedSharding(mesh, P(None, None, "sp")))
    calls["hop"] = (jax.jit(jax.shard_map(
        lambda x: jax.lax.ppermute(x, "sp", [(i, (i + 1) % r) for i in range(r)]), mesh=mesh,
        in_specs=P(None, None, "sp"), out_specs=P(None, None, "sp"), check_vma=False)), (kv,))
  with jax.set_mesh(mesh):
    got = time(calls)  # (all in one trace: jax#40260)
  print(f"\n{'mask':30s} " + " ".join(f"{s:>11s}" for s in STRATEGIES) + "   auto picks  "
        "auto / best (batch ms)")
  for mask in cases:
    row = {s: got[mask, s][0] for s in STRATEGIES if (mask, s) in got}
    pick = auto.choose(mask, seq_len=t, heads=n, kv_heads=n, head_dim=h, ring_size=r,
                       layout="zigzag", itemsize=item).strategy
    ratio = row[pick] / min(row.values())
    print(f"{mask!s:30s} " + " ".join(f"{row[s]:11.2f}" if s in row else f"{'-':>11s}"
                                      for s in STRATEGIES) + f"   {pick:11s}  {ratio:.3f}")
    targets.append((f"auto on {mask!s}: {pick} / best = {ratio:.3f}", "<= 1.05", ratio <= 1.05))
  tl = t // r
  flops = 4 * b * n * h * tl * (tl + 1) / 2 / (got["forward"][0] * 1e-3)
  print(f"cost model rates: causal forward {flops / 1e12:.1f} TFLOP/s per device", end="")
  if "hop" in got:
    sent = 2 * b * tl * n * h * item
    print(f"; a hop of a shard's K/V ({sent / 2**20:.0f} MiB) {got['hop'][0]:.3f} ms, "
          f"{sent / (got['hop'][0] * 1e-3) / 1e9:.0f} GB/s per device", end="")
  print()


def profile(a, mesh, qkv, local_qkv, which):
  """The first GPU's ops per call (``mosaic_gpu_sweep.profile``) of ``which``: "window" (the
  local call and the default contiguous ring), "zigzag" or "balanced" (the pack's). One trace
  per process on several GPUs (jax#40260)."""
  import os
  import sys
  import tempfile
  sys.path.insert(0, os.path.dirname(__file__))
  from mosaic_gpu_sweep import profile as ops_profile
  if which == "window":
    mask = masks.SlidingWindow(a.window)
    ops_profile(f"local {mask!s}", _fwd_bwd(lambda *x: flash_attention(*x, mask=mask)),
                local_qkv, tempfile.mkdtemp())
    ops_profile(f"ring {mask!s}", _ring(mesh, mask, "contiguous", None), qkv, tempfile.mkdtemp())
  else:
    fn, args = _pack(mesh, qkv)[0][which]
    with jax.set_mesh(mesh):
      ops_profile(f"pack {which}", fn, args, tempfile.mkdtemp())


def _args():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--tokens", type=int, default=32768, help="tokens per device")
  p.add_argument("--heads", type=int, default=None, help="N = K (default 16; CPU 2)")
  p.add_argument("--head-dim", type=int, default=None, help="H (default 128; CPU 32)")
  p.add_argument("--reps", type=int, default=None, help="timed batches (default 6; CPU 2)")
  p.add_argument("--window", type=int, default=None, help="default min(1024, tokens / 4)")
  p.add_argument("--chunk", type=int, default=None, help="default min(8192, tokens / 4)")
  p.add_argument("--parts", default="reach,pack,strategies",
                 help="which tables (also profile-window, profile-zigzag, profile-balanced: "
                 "the first GPU's ops per call)")
  p.add_argument("--masks", default="window,chunked,causal,full", help="the strategies part's")
  p.add_argument("--variants", default="default,stepped,whole", help="the ring's, in reach")
  p.add_argument("--clock", choices=("device", "wall"), default=None,
                 help="default: device on GPUs, wall on CPU")
  a = p.parse_args()
  for flag, value, known in (("--variants", a.variants, ("default", "stepped", "whole")),
                             ("--masks", a.masks, ("window", "chunked", "causal", "full"))):
    unknown = set(value.split(",")) - set(known)
    if unknown:
      p.error(f"{flag}: unknown {sorted(unknown)}; use {', '.join(known)}")
  a.cpu = jax.devices()[0].platform == "cpu"
  a.heads = a.heads or (2 if a.cpu else 16)
  a.head_dim = a.head_dim or (32 if a.cpu else 128)
  a.reps = a.reps or (2 if a.cpu else 6)
  a.window = a.window or min(1024, a.tokens // 4)
  a.chunk = a.chunk or min(8192, a.tokens // 4)
  a.dtype = jnp.float32 if a.cpu else jnp.bfloat16
  return a


def main():
  a = _args()
  r = jax.device_count()
  mesh = jax.make_mesh((r,), ("sp",), axis_types=(AxisType.Auto,))
  t, n, h = a.tokens * r, a.heads, a.head_dim
  keys = jax.random.split(jax.random.key(0), 3)
  # Inputs placed as the ring holds them (sharded over "sp"); the local call's on one device.
  sharded = NamedSharding(mesh, P(None, "sp"))
  qkv = tuple(jax.device_put(jax.random.normal(kk, (1, t, n, h), a.dtype), sharded)
              for kk in keys)
  local_qkv = tuple(jax.device_put(x[:, :a.tokens], jax.devices()[0]) for x in qkv)
  time = Timer(a.reps, device=(a.clock or ("wall" if a.cpu else "device")) == "device")
  print(f"{jax.devices()[0].device_kind} x{r}, jax {jax.__version__}, {a.tokens} tokens per "
        f"device, N=K={n}, H={h}, {jnp.dtype(a.dtype).name}, fwd+bwd, "
        f"{'device' if time.device else 'host'} clock, median of {a.reps} (batch ms, lone ms)")
  targets = []
  parts = a.parts.split(",")
  if "reach" in parts:
    reach(a, mesh, qkv, local_qkv, time, targets)
  if "pack" in parts:
    pack(a, mesh, qkv, time, targets)
  for which in ("window", "zigzag", "balanced"):
    if f"profile-{which}" in parts:
      profile(a, mesh, qkv, local_qkv, which)
  if "strategies" in parts:
    strategies(a, mesh, qkv, local_qkv, time, targets)
  print("\nissue 59 targets:")
  for text, goal, met in targets:
    print(f"  {'met   ' if met else 'MISSED'} {text} (target {goal})")


if __name__ == "__main__":
  main()
