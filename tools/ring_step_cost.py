"""Per-step device work of the ring outside its kernels, on one GPU (no communication).

    python tools/ring_step_cost.py [TOKENS_PER_GPU] [backend] [TRACE_DIR]

One ring step of ``ring.py`` on one (q shard, kv shard) pair, N=16, H=128, bf16, dense, timed
interleaved (``bench.interleaved_samples``, median of 7 batches of at least 50 ms):

    fwd kernel          the pair's forward alone (o in float32 and lse)
    fwd + merge         the same, then ``common.merge`` into a running (o, lse) in XLA
    fwd merging         the kernel given the running (o, lse) (``acc``): what a ring step runs
    bwd kernels         the pair's backward alone (float32 dq, dk, dv)
    bwd + accumulate    the same, then ``dq + dq_s`` and ``dkv_in + stack([dk_s, dv_s])`` in XLA
    bwd adding dq       the kernels given the running dq (``dq_acc``), then the dK/dV add: what a
                        ring step runs
    pack + unpack       the bytes of the step's sends (K/V and dK/dV) packed into one buffer and
                        unpacked (``sends.rotate`` without its ppermute; GPU rings pack)
    ... plan ahead      the same step with its plan selected from those built while tracing
                        (``plans.Planner``; rank and source are arguments, as under
                        ``shard_map``) instead of built on device from its positions; also for
                        a causal zigzag pair (rank 1, source 0 of 4), whose plans differ by pair

The differences are what each step spends around the kernels, which a ring on several GPUs
cannot hide behind its sends (they run on the same stream as the kernels). It first checks that
merging in the kernel gives what merging after it does.
"""

from __future__ import annotations

import statistics
import sys

import jax
import jax.numpy as jnp
from jax import lax

from pallas_ring import bench, block_sparse, layouts, masks, pair, plans, ring, sends
from pallas_ring.kernels import common, tuning


def main(tokens=8192, backend="pallas_mosaic_gpu", trace_dir=None):
  """Times the calls above; with ``trace_dir``, first prints the GPU ops of each plan-ahead pair
  (``mosaic_gpu_sweep.profile``: time per op, ops per call) from profiler traces there."""
  tokens = int(tokens)
  b, n, h, r = 1, 16, 128, 4
  q, k, v, do = bench.random_inputs(b, tokens, n, h)
  tiles = tuning.resolve(backend, None, tokens, tokens, h, dtype=q.dtype, group=1,
                         mask_class="full")
  cfg = pair.kernel_config(tiles, mask=masks.Full(), scale=h ** -0.5, softcap=None,
                           q_len=tokens, kv_len=tokens, out_dtype=jnp.float32,
                           interpret=False)
  st = ring.RingStatic(cfg, backend, "x", r, "ring", 1, tokens,
                       plans.for_config(cfg, tokens, tokens), use_cond=False, pack_sends=True)
  info = lambda rank: block_sparse.make_token_info(
      tokens, b, jnp.arange(tokens, dtype=jnp.int32) + rank * tokens, None)
  ops = common.Operands(info(1), info(0), None, None, None, None)
  f32 = jnp.float32
  o_acc = jax.random.normal(jax.random.key(7), q.shape, f32)
  lse_acc = jax.random.normal(jax.random.key(8), (b, n, tokens), f32) + 10.0
  _, lse = ring.pair_forward(st, q, k, v, ops)
  delta = jax.random.normal(jax.random.key(9), (b, n, tokens), f32)
  dq_acc = jax.random.normal(jax.random.key(10), q.shape, f32)
  dkv_acc = jax.random.normal(jax.random.key(11), (2, *k.shape), f32)

  def fwd(q, k, v):
    return tuple(ring.pair_forward(st, q, k, v, ops))

  def fwd_merge(q, k, v, o_acc, lse_acc):
    return common.merge(o_acc, lse_acc, *ring.pair_forward(st, q, k, v, ops))

  def fwd_merging(q, k, v, o_acc, lse_acc):
    return tuple(ring.pair_forward(st, q, k, v, ops, common.Partial(o_acc, lse_acc)))

  def bwd(q, k, v, do, lse, delta):
    return ring.pair_backward(st, q, k, v, do, lse, delta, ops)[:3]

  def bwd_acc(q, k, v, do, lse, delta, dq_acc, dkv_acc):
    dq, dk, dv = ring.pair_backward(st, q, k, v, do, lse, delta, ops)[:3]
    return dq_acc + dq, dkv_acc + jnp.stack([dk, dv])

  def bwd_adding(q, k, v, do, lse, delta, dq_acc, dkv_acc):
    dq, dk, dv = ring.pair_backward(st, q, k, v, do, lse, delta, ops, dq_acc)[:3]
    return dq, dkv_acc + jnp.stack([dk, dv])

  def ahead(mask, layout, device):
    """``(st, device_ops, plan_of)``: a pair of ``layout`` under ``mask`` (rank and source as
    traced arguments), its Operands with positions computed on device, and its plan
    (``plan_of(rank, src, backward)``): built on device from those positions when ``device``
    (the planner knows no layout), else selected from those built ahead."""
    c = pair.kernel_config(tiles, mask=mask, scale=h ** -0.5, softcap=None, q_len=tokens,
                           kv_len=tokens, out_dtype=f32, interpret=False)
    planner = plans.for_config(
        c, tokens, tokens, None if device else plans.RingLayout(r * tokens, layout, r, False))
    s = ring.RingStatic(c, backend, "x", r, "ring", 1, tokens, planner,
                        use_cond=False, pack_sends=True)
    pos = lambda rank: block_sparse.make_token_info(
        tokens, b, layouts.positions(r * tokens, layout, r, rank))
    dev = lambda rank, src: common.Operands(pos(rank), pos(src), None, None, None, None)
    plan = lambda rank, src, bwd=False: s.planner.plan(dev(rank, src), bwd, rank, src)
    return s, dev, plan

  def fwd_ahead(mask, layout, device):
    s, dev, plan = ahead(mask, layout, device)
    return lambda q, k, v, o_acc, lse_acc, rank, src: tuple(ring.pair_forward(
        s, q, k, v, dev(rank, src), common.Partial(o_acc, lse_acc), plan(rank, src)))

  def bwd_ahead(mask, layout, device):
    s, dev, plan = ahead(mask, layout, device)

    def run(q, k, v, do, lse, delta, dq_acc, dkv_acc, rank, src):
      dq, dk, dv = ring.pair_backward(s, q, k, v, do, lse, delta, dev(rank, src), dq_acc,
                                      plan=plan(rank, src, True))[:3]
      return dq, dkv_acc + jnp.stack([dk, dv])
    return run

  def pack(k, v, dkv_acc):  # (the barrier stands in for the ppermute between the two)
    leaves = [jnp.stack([k, v]), dkv_acc]
    return sends.unpack_buffers(lax.optimization_barrier(sends.pack_buffers(leaves)), leaves)

  bwd_args = (q, k, v, do, lse, delta, dq_acc, dkv_acc)
  calls = {
      "fwd kernel": (jax.jit(fwd), (q, k, v)),
      "fwd + merge": (jax.jit(fwd_merge), (q, k, v, o_acc, lse_acc)),
      "fwd merging": (jax.jit(fwd_merging), (q, k, v, o_acc, lse_acc)),
      "bwd kernels": (jax.jit(bwd), (q, k, v, do, lse, delta)),
      "bwd + accumulate": (jax.jit(bwd_acc), bwd_args),
      "bwd adding dq": (jax.jit(bwd_adding), bwd_args),
      "pack + unpack": (jax.jit(pack), (k, v, dkv_acc)),
  }
  ranks = (jnp.int32(1), jnp.int32(0))  # (rank 1's q against rank 0's K/V)
  for label, mask, layout in (("", masks.Full(), "contiguous"),
                              ("causal zigzag ", masks.Causal(), "zigzag")):
    for device, what in ((True, "plan on device"), (False, "plan ahead")):
      calls[f"{label}fwd merging, {what}"] = (
          jax.jit(fwd_ahead(mask, layout, device)), (q, k, v, o_acc, lse_acc, *ranks))
      calls[f"{label}bwd adding dq, {what}"] = (
          jax.jit(bwd_ahead(mask, layout, device)), (*bwd_args, *ranks))
  ahead_pairs = [(f"{label}{p}, plan on device", f"{label}{p}, plan ahead")
                 for label in ("", "causal zigzag ") for p in ("fwd merging", "bwd adding dq")]
  pairs = [("fwd + merge", "fwd merging"), ("bwd + accumulate", "bwd adding dq")] + ahead_pairs
  for after, inside in pairs:
    (fa, aa), (fi, ai) = calls[after], calls[inside]
    for x, y in zip(jax.tree.leaves(fa(*aa)), jax.tree.leaves(fi(*ai))):
      err = float(jnp.linalg.norm((x - y).ravel()) / jnp.linalg.norm(x.ravel()))
      print(f"  {inside} vs {after}: relative difference {err:.1e}", flush=True)
      assert err < 1e-3, (inside, err)  # (merged in the kernel before rounding to 16 bits)
  if trace_dir:
    import mosaic_gpu_sweep  # (beside this file)
    for name, (f, args) in calls.items():
      if "plan" in name:
        mosaic_gpu_sweep.profile(name, f, args, f"{trace_dir}/{name.replace(' ', '_')}")
  samples = bench.interleaved_samples(calls, reps=7)
  print(f"{jax.__version__} {jax.devices()[0].device_kind} {backend} {tokens} tokens/GPU, "
        f"N={n} H={h} bf16, dense", flush=True)
  med = {name: statistics.median(ts) * 1e3 for name, ts in samples.items()}
  for name, ts in samples.items():
    print(f"  {name:44s} {med[name]:8.3f} ms ({min(ts) * 1e3:.3f}-{max(ts) * 1e3:.3f})")
  for base, names in (("fwd kernel", ("fwd + merge", "fwd merging")),
                      ("bwd kernels", ("bwd + accumulate", "bwd adding dq")),
                      *((device, (ahead,)) for device, ahead in ahead_pairs)):
    print("  over " + base + ": " + ", ".join(
        f"{name} +{med[name] - med[base]:.3f} ms ({(med[name] / med[base] - 1) * 100:.1f}%)"
        for name in names), flush=True)


if __name__ == "__main__":
  main(*sys.argv[1:])
