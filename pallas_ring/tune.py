"""``python -m pallas_ring tune``: measure tile candidates on this device, cache the winners.

For one shape class (backend, dtype, heads, head dim, GQA group, mask, length), each pass's
candidates are checked against the ``xla`` backend on random inputs (a wrong candidate is
dropped, never timed) and then timed on the device (compiled, warmed up, ``block_until_ready``
around repeated calls, median of repeats). The fastest forward tiles and the fastest backward
tiles (timed as forward+backward with the forward winner) are merged into the tile cache, which
``block_sizes=None`` reads from then on (see ``kernels.tile_cache``).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from pallas_ring import bench, kernels, masks
from pallas_ring.attention import flash_attention
from pallas_ring.config import BlockSizes
from pallas_ring.kernels import tile_cache, tuning


@dataclasses.dataclass(frozen=True)
class Problem:
  """The shape class being tuned."""

  backend: str  # resolved kernel backend
  seq_len: int  # T = S
  heads: int  # N
  kv_heads: int  # K
  head_dim: int  # H
  dtype: str  # e.g. "bfloat16"
  mask: str  # causal | full | window:W | docs:L
  batch: int = 1  # B
  interpret: bool = False  # run Pallas kernels in interpret mode (CPU)


@dataclasses.dataclass
class Result:
  pass_: str  # "fwd" or "bwd"
  tiles: dict  # the candidate's BlockSizes fields
  seconds: Optional[float]  # median seconds per call; None when it failed
  error: str = ""  # why it failed (compile error, or its relative error)


def parse_mask(spec: str, seq_len: int):
  """``(mask, segment_ids or None)`` for a ``--mask`` value."""
  name, _, arg = spec.partition(":")
  if name == "causal":
    return masks.Causal(), None
  if name == "full":
    return masks.Full(), None
  if name == "window" and arg.isdigit():
    return masks.Causal() & masks.SlidingWindow(int(arg)), None
  if name == "docs" and arg.isdigit():
    seg = (jnp.arange(seq_len, dtype=jnp.int32) // int(arg))[None]
    return masks.Causal(), seg
  raise ValueError(f"--mask={spec!r} is not known: use causal, full, window:W or docs:L "
                   "(W, L in tokens).")


def candidates(backend: str, head_dim: int, interpret: bool) -> dict[str, list[dict]]:
  """Candidate tiles per pass for a backend (small sets in interpret mode)."""
  return kernels.get(backend).tuning_candidates(head_dim, interpret)


def _rel_err(got, ref) -> float:
  got = np.asarray(got, np.float64)
  ref = np.asarray(ref, np.float64)
  return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


class _Progress:
  """A one-line progress bar on stderr."""

  def __init__(self, total: int, width: int = 30):
    self.total, self.done, self.width = total, 0, width

  def step(self, label: str) -> None:
    self.done += 1
    filled = self.width * self.done // max(self.total, 1)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} "
                     f"{label[:60]:60s}")
    if self.done == self.total:
      sys.stderr.write("\n")
    sys.stderr.flush()


def tune(problem: Problem, passes=("fwd", "bwd"), iters: int = 10, reps: int = 5,
         tol: Optional[float] = None, log: Callable[[str], None] = print) -> dict[str, list]:
  """Measures every candidate of each pass; returns ``{pass: [Result, ...]}`` sorted by time."""
  p = problem
  dtype = jnp.dtype(p.dtype)
  tol = tol if tol is not None else (3e-2 if dtype.itemsize == 2 else 5e-3)
  mask, seg = parse_mask(p.mask, p.seq_len)
  ks = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(ks[0], (p.batch, p.seq_len, p.heads, p.head_dim), dtype)
  k = jax.random.normal(ks[1], (p.batch, p.seq_len, p.kv_heads, p.head_dim), dtype)
  v = jax.random.normal(ks[2], (p.batch, p.seq_len, p.kv_heads, p.head_dim), dtype)
  do = jax.random.normal(ks[3], q.shape, dtype)
  seg = None if seg is None else jnp.broadcast_to(seg, (p.batch, p.seq_len))

  def fwd_fn(backend, bs, interpret):
    return jax.jit(lambda q, k, v: flash_attention(
        q, k, v, mask=mask, segment_ids=seg, backend=backend, block_sizes=bs,
        interpret=interpret))

  def bwd_fn(backend, bs, interpret):
    f = fwd_fn(backend, bs, interpret)
    return jax.jit(lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do))

  refs = {"fwd": fwd_fn("xla", None, False)(q, k, v),
          "bwd": bwd_fn("xla", None, False)(q, k, v, do)}
  cands = candidates(p.backend, p.head_dim, p.interpret)
  progress = _Progress(sum(len(cands[x]) for x in passes))
  results: dict[str, list] = {}
  fwd_best: dict = {}
  for pass_ in passes:
    rows = []
    for tiles in cands[pass_]:
      progress.step(f"{pass_} {tiles}")
      bs = BlockSizes(**{**fwd_best, **tiles})
      try:
        if pass_ == "fwd":
          fn, args = fwd_fn(p.backend, bs, p.interpret), (q, k, v)
          err = _rel_err(fn(*args), refs["fwd"])
        else:
          fn, args = bwd_fn(p.backend, bs, p.interpret), (q, k, v, do)
          err = max(_rel_err(a, b) for a, b in zip(fn(*args), refs["bwd"]))
      except Exception as e:  # noqa: BLE001 - a candidate that does not compile is skipped
        rows.append(Result(pass_, tiles, None, f"{type(e).__name__}: {str(e)[:80]}"))
        continue
      if not err <= tol:
        rows.append(Result(pass_, tiles, None, f"relative error {err:.1e} > {tol:g}"))
        continue
      rows.append(Result(pass_, tiles, bench.timeit(fn, *args, iters=iters, reps=reps)))
    rows.sort(key=lambda r: (r.seconds is None, r.seconds or 0.0))
    results[pass_] = rows
    if pass_ == "fwd" and rows and rows[0].seconds is not None:
      fwd_best = dict(rows[0].tiles)
  return results


def winners(problem: Problem, results: dict[str, list]) -> dict[str, dict]:
  """Cache entries (key -> tiles) of each pass's fastest valid candidate."""
  kind = tuning.device_kind(problem.backend)
  mask, seg = parse_mask(problem.mask, problem.seq_len)
  shape = dict(dtype=problem.dtype, head_dim=problem.head_dim,
               group=problem.heads // problem.kv_heads,
               mask_cls=tile_cache.mask_class(mask, seg is not None), length=problem.seq_len)
  out = {}
  for pass_, rows in results.items():
    if rows and rows[0].seconds is not None:
      key = tile_cache.key(kind, problem.backend, pass_=pass_, **shape)
      out[key] = dict(rows[0].tiles)
  return out


def report(results: dict[str, list], top: int = 5, log: Callable[[str], None] = print) -> None:
  """A table of each pass's top candidates (and how many failed)."""
  for pass_, rows in results.items():
    ok = [r for r in rows if r.seconds is not None]
    log(f"{pass_}: {len(ok)} of {len(rows)} candidates valid "
        f"({'time ' + ('forward' if pass_ == 'fwd' else 'forward+backward')}, median)")
    best = ok[0].seconds if ok else None
    for r in ok[:top]:
      log(f"  {r.seconds * 1e3:9.3f} ms  {r.seconds / best:5.2f}x  {r.tiles}")
    for r in [r for r in rows if r.seconds is None][:3]:
      log(f"  failed: {r.tiles}: {r.error}")


__all__ = ["Problem", "Result", "tune", "winners", "report", "candidates", "parse_mask"]
