"""Timing for the benchmarks (``pallas_ring.bench``, ``tools/``): batches of calls timed by the
host's clock or on the device, interleaved across implementations, and the result rows.

A batch is ``iters`` calls, or more for short calls: enough to last ``MIN_BATCH_S``, so that the
fixed cost of starting and synchronizing a batch (tens of microseconds) is not counted as kernel
time; the median of ``reps`` batches is reported. ``clock`` picks how a batch is timed: by the
host's clock, or on the device (``device_spans`` of a profiler trace). TFLOP/s count visible
(query, key) pairs only: ``4 * B * N * pairs * H`` forward, 3.5x that forward+backward.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import glob
import gzip
import json
import shutil
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np



MIN_BATCH_S = 0.05  # the shortest timed batch of calls, in seconds
# How a batch is timed: "wall", the host's clock from its first dispatch to its end; "device",
# the span of the GPUs' ops from a profiler trace (``device_spans``), which leaves out the
# host's dispatch and synchronization.
_CLOCK = contextvars.ContextVar("pallas_ring_bench_clock", default="wall")


@contextlib.contextmanager
def clock(kind: str):
  """Times the batches inside the context by ``kind``: ``"wall"`` (the default) or
  ``"device"`` (``bench --device-time``)."""
  if kind not in ("wall", "device"):
    raise ValueError(f"bench.clock({kind!r}): use 'wall' or 'device'.")
  token = _CLOCK.set(kind)
  try:
    yield
  finally:
    _CLOCK.reset(token)


_MAX_BATCH = 2000  # the most calls in one batch


def _batch(fn, args, iters: int, min_batch_s: float) -> int:
  """Calls per timed batch of a warmed-up ``fn``: ``iters``, raised so that a batch lasts about
  ``min_batch_s``."""
  t0 = time.perf_counter()
  for _ in range(iters):
    out = fn(*args)
  jax.block_until_ready(out)
  secs = time.perf_counter() - t0
  return int(min(_MAX_BATCH, max(iters, iters * min_batch_s / max(secs, 1e-9))))


def _batch_seconds(fn, args, calls: int) -> float:
  """Seconds per call over one batch of ``calls`` calls."""
  t0 = time.perf_counter()
  for _ in range(calls):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) / calls


def timeit(fn, *args, iters=10, reps=5) -> float:
  """Median seconds per call of a jitted ``fn`` (compiled and warmed up first)."""
  return statistics.median(interleaved_samples({"fn": (fn, args)}, iters, reps)["fn"])


def balanced_orders(n: int) -> list:
  """Orders of ``n`` implementations (a Williams design: a balanced Latin square) in which each
  takes every place equally often and follows every other one equally often: ``n`` orders for
  even ``n`` (and one), ``2 n`` (the orders and their reverses) for odd ``n``."""
  first, lo, hi = [0], 1, n - 1
  while lo <= hi:  # 0, 1, n-1, 2, n-2, ...
    first.append(lo)
    lo += 1
    if lo <= hi:
      first.append(hi)
      hi -= 1
  orders = [[(i + r) % n for i in first[:n]] for r in range(n)]
  return orders if n % 2 == 0 or n == 1 else orders + [o[::-1] for o in orders]


def interleaved_samples(calls, iters=10, reps=5, min_batch_s=MIN_BATCH_S, batches=None) -> dict:
  """Seconds per call of each ``name: (jitted fn, args)``, one sample per repetition, the
  repetitions interleaved across the calls, so that clock and thermal drift during a run hit
  every implementation alike. The repetitions run the calls in ``balanced_orders``, ``reps``
  rounded up to whole rounds of them, so that no implementation takes one place more often than
  another (a call's place in a round moves its time; BENCHMARKS.md's opening says how much,
  and what noise remains). Each sample is a batch of at least
  ``iters`` calls lasting at least ``min_batch_s`` (0: exactly ``iters``; ``_batch``), or
  ``batches[name]`` calls where given (1: lone calls, timed beside sustained batches in the same
  trace: on several GPUs the first call after a profiler trace stops can fail, jax#40260)."""
  batch = {}
  for name, (fn, args) in calls.items():
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    batch[name] = (batches or {}).get(name) or _batch(fn, args, iters, min_batch_s)
  names = list(calls)
  orders = balanced_orders(len(names))
  samples = []  # (implementation, seconds per call by the host's clock)
  device = _CLOCK.get() == "device"
  trace_dir = tempfile.mkdtemp(prefix="pallas_ring_bench_") if device else None
  try:
    with jax.profiler.trace(trace_dir) if trace_dir else contextlib.nullcontext():
      for rep in range(-(-reps // len(orders)) * len(orders)):
        for i in orders[rep % len(orders)]:
          fn, args = calls[names[i]]
          with jax.profiler.TraceAnnotation(f"sample {len(samples)}"):
            samples.append((names[i], _batch_seconds(fn, args, batch[names[i]])))
    if trace_dir:
      spans = device_spans(trace_dir, [f"sample {j}" for j in range(len(samples))])
      samples = [(name, spans[j][0] / batch[name]) for j, (name, _) in enumerate(samples)]
  finally:
    if trace_dir:
      shutil.rmtree(trace_dir, ignore_errors=True)
  return {name: [secs for n, secs in samples if n == name] for name in names}


def trace_events(trace_dir: str, all_gpus: bool = False) -> tuple[list, list]:
  """``(GPU ops, host events)`` of the newest profiler trace under ``trace_dir``: the complete
  events of the first GPU (of every GPU with ``all_gpus``), sorted by start, and those of the
  host (microsecond ``ts``, ``dur``; ``pid`` tells the GPUs apart)."""
  path = sorted(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True))[-1]
  with gzip.open(path) as f:
    events = json.load(f)["traceEvents"]
  procs = {e["pid"]: str(e.get("args", {}).get("name")) for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  gpus = sorted(pid for pid, name in procs.items() if "GPU" in name)
  spans = [e for e in events if e.get("ph") == "X"]
  timed = gpus if all_gpus else gpus[:1]
  ops = sorted((e for e in spans if e["pid"] in timed), key=lambda e: e["ts"])
  return ops, [e for e in spans if e["pid"] not in gpus]


def device_spans(trace_dir: str, names) -> list:
  """``[(span, busy, ops)]`` of the profiler trace under ``trace_dir``, one per host annotation
  in ``names`` (each around calls it synchronized): the GPU ops (of every GPU) that start inside
  it, their span in seconds from the first one's start to the last one's end on any GPU (so a
  device that finishes early does not hide one that finishes late), the busiest GPU's sum of
  durations, and the number of ops.

  Raises:
    RuntimeError: an annotation holds no GPU op (no GPU, or a trace without device events).
  """
  ops, host = trace_events(trace_dir, all_gpus=True)
  marks = {e["name"]: e for e in host}
  starts = np.array([e["ts"] for e in ops])
  out = []
  for name in names:
    m = marks[name]
    mine = ops[np.searchsorted(starts, m["ts"]):np.searchsorted(starts, m["ts"] + m["dur"],
                                                                "right")]
    if not mine:
      raise RuntimeError(f"the profiler trace holds no GPU op inside {name!r}: device timing "
                         "(bench.clock('device')) needs a GPU that the profiler traces.")
    end = max(e["ts"] + e.get("dur", 0) for e in mine)
    busy = {}
    for e in mine:
      busy[e["pid"]] = busy.get(e["pid"], 0) + e.get("dur", 0)
    out.append(((end - mine[0]["ts"]) * 1e-6, max(busy.values()) * 1e-6, len(mine)))
  return out


def timeit_interleaved(calls, iters=10, reps=5, min_batch_s=MIN_BATCH_S) -> dict:
  """Median seconds per call of each ``name: (jitted fn, args)`` (``interleaved_samples``)."""
  return {name: statistics.median(ts)
          for name, ts in interleaved_samples(calls, iters, reps, min_batch_s).items()}


def visible_pairs(t: int, kind: str, window: int = 1024, doc: int = 1024) -> int:
  q = np.arange(t, dtype=np.int64)
  if kind == "full":
    return t * t
  if kind == "causal":
    return t * (t + 1) // 2
  if kind == "window":
    return int(np.sum(np.minimum(q, window) + 1))
  if kind == "documents":
    return (t // doc) * doc * (doc + 1) // 2
  raise ValueError(kind)


def random_inputs(b, t, n, h, dtype=jnp.bfloat16, seed=0, kv_heads=None):
  """Standard normal ``(q [B, T, N, H], k, v [B, T, K, H], do [B, T, N, H])`` from ``seed``
  (``K = kv_heads or N``)."""
  ks = jax.random.split(jax.random.key(seed), 4)
  kh = kv_heads or n
  q = jax.random.normal(ks[0], (b, t, n, h), dtype)
  k = jax.random.normal(ks[1], (b, t, kh, h), dtype)
  v = jax.random.normal(ks[2], (b, t, kh, h), dtype)
  do = jax.random.normal(ks[3], (b, t, n, h), dtype)
  return q, k, v, do


def fwd_bwd(f):
  """``jit(run)`` with ``run(q, k, v, do) = (f(q, k, v), its vjp at do)``: a training step's
  attention, forward and backward."""

  def run(q, k, v, do):
    out, vjp = jax.vjp(f, q, k, v)
    return out, vjp(do)
  return jax.jit(run)


def _peak_gib():
  """Peak bytes in use per device so far, in GiB (0 where the backend keeps no statistics)."""
  return [(d.memory_stats() or {}).get("peak_bytes_in_use", 0) / 2**30 for d in jax.devices()]


@dataclasses.dataclass
class Row:
  case: str  # e.g. "T=16384 causal"
  impl: str  # implementation and its configuration
  pass_: str  # "fwd" or "fwd+bwd"
  ms: float  # median milliseconds per call
  tflops: float  # on visible pairs
  ratio: str = ""  # ours vs the baseline, when both exist


def plot(rows, path: str, title: str = "") -> None:
  """Saves a horizontal bar chart of ``rows`` (``Row``) to ``path``: one group of bars per case
  and pass, one bar (and legend entry) per implementation, TFLOP/s on visible pairs."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  groups = list(dict.fromkeys((r.case, r.pass_) for r in rows))
  impls = list(dict.fromkeys(r.impl for r in rows))
  height = 0.8 / len(impls)
  fig, ax = plt.subplots(figsize=(9, 1.0 + 0.3 * len(groups) * max(len(impls), 2) / 2))
  for k, impl in enumerate(impls):
    at = {(r.case, r.pass_): r.tflops for r in rows if r.impl == impl}
    ys = [g for g, key in enumerate(groups) if key in at]
    ax.barh([y + (k - (len(impls) - 1) / 2) * height for y in ys],
            [at[groups[y]] for y in ys], height, label=impl)
  ax.set_yticks(range(len(groups)), [f"{case}, {pass_}" for case, pass_ in groups], fontsize=8)
  ax.invert_yaxis()
  ax.set_xlabel("TFLOP/s (visible pairs)")
  ax.set_title(title, fontsize=9)
  ax.legend(fontsize=8, loc="lower right")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _tflops(pairs, b, n, h, secs, pass_):
  f = 4 * b * n * pairs * h * (3.5 if pass_ == "fwd+bwd" else 1.0)
  return f / secs / 1e12
