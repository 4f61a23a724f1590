"""Host time per call of our forward+backward on a GPU, beside its device time: is a short
call bound by the host's dispatch? (One call of the device tool.)

    python tools/host_overhead.py [DIR] [shape words]   # default: docs (16 causal documents
                                                        # of 1024, fwd and fwd+bwd)
    XLA_FLAGS=--xla_gpu_enable_command_buffer= python tools/host_overhead.py  # no CUDA graphs

For each pass it prints: the seconds per call of a loop that only dispatches (no wait), of a
batch by the host's clock (dispatch and wait) and by the device clock (``bench.clock``), the
device span of a call synchronized alone, and the host events of a profiler trace that take the
most time per call (the thread that launches the kernels).
"""

import collections
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, "tools")
from mosaic_gpu_sweep import _FWD_SHAPES  # noqa: E402
from pallas_ring import bench  # noqa: E402
from pallas_ring.attention import flash_attention  # noqa: E402


def _host_events(d, calls):
  """The host events of the newest trace under ``d`` by total time per call (top 20)."""
  per, count = collections.Counter(), collections.Counter()
  for e in bench.trace_events(d)[1]:
    per[e["name"][:80]] += e.get("dur", 0) / calls
    count[e["name"][:80]] += 1
  return [(name, us, count[name] / calls) for name, us in per.most_common(20)]


def main(d="/tmp/host", *only):
  only = only or ("docs",)
  for name, t, n, kh, h, mask, kind, dt in _FWD_SHAPES:
    if name.split()[0] not in only:
      continue
    q, k, v, do = bench.random_inputs(1, t, n, h, kv_heads=kh, dtype=dt)
    seg = (jnp.arange(t, dtype=jnp.int32) // 1024)[None] if kind == "documents" else None
    attn = lambda q, k, v: flash_attention(q, k, v, mask=mask, segment_ids=seg,
                                           backend="pallas_mosaic_gpu")
    for pass_, f, args in (("fwd", jax.jit(attn), (q, k, v)),
                           ("fwd+bwd", bench.fwd_bwd(attn), (q, k, v, do))):
      jax.block_until_ready(f(*args))
      calls = 200
      dispatch, wall = [], []
      for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
          out = f(*args)
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        t2 = time.perf_counter()
        dispatch.append((t1 - t0) / calls)
        wall.append((t2 - t0) / calls)
      with bench.clock("device"):
        batch = statistics.median(bench.interleaved_samples({"f": (f, args)}, reps=5)["f"])
        one = statistics.median(bench.interleaved_samples({"f": (f, args)}, iters=1, reps=20,
                                                          min_batch_s=0.0)["f"])
      print(f"{name} {pass_}: dispatch only {statistics.median(dispatch) * 1e6:.0f} us/call, "
            f"batch (host clock) {statistics.median(wall) * 1e6:.0f}, batch (device clock) "
            f"{batch * 1e6:.0f}, one call alone (device) {one * 1e6:.0f}", flush=True)
      trace = f"{d}/{pass_}"
      with jax.profiler.trace(trace):
        for _ in range(20):
          out = f(*args)
        jax.block_until_ready(out)
      for ev, us, per_call in _host_events(trace, 20):
        print(f"    {us:8.1f} us/call {per_call:5.1f}x  {ev}", flush=True)




if __name__ == "__main__":
  print(jax.__version__, jax.devices()[0].device_kind, flush=True)
  main(*sys.argv[1:])
