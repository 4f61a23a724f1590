"""Compiles pallas_ring's TPU kernels with default arguments for every TPU generation (libtpu,
no TPU needed) and reports compile seconds and each program's VMEM.

The matrix: generation (v4, v5e, v5p, v6e; one chip, or the topology's 4 chips for the ring) x
dtype (bfloat16, float32, float16) x program (forward, forward+backward, the ring's
forward+backward, whose steps add into accumulators, and decode) x head dim (64, 128, 192/128:
DeepSeek-style MLA, q/k 192 and v 128; 256) x mask (causal, documents). Shapes: B=1, T=4096 per
chip, N=K=8 (8-head blocks read in place: the most VMEM per program); decode is one token of
B=2 rows against a 4096-slot cache, "documents" there meaning ragged ``kv_lengths``. Every call
leaves ``block_sizes``, ``backend`` and ``interpret`` at their defaults, traced under
``jax.set_mesh`` of the topology (the target chip's tiles). The VMEM of a program is the
kernels' own measure (``pallas_tpu.tiles._Vmem``: pipelined blocks, scratch, the body's
temporaries and a reserve), recorded for every pass::

    python tools/tpu_compile_matrix.py                      # the whole matrix (~25 min, 2 cores)
    python tools/tpu_compile_matrix.py --generations v4 --dtypes bfloat16 --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import itertools
import json
import sys
import time

import pallas_ring  # noqa: F401  (first: it quiets libtpu before JAX loads it)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

TOPOLOGIES = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}
DTYPES = ("bfloat16", "float32", "float16")
PROGRAMS = ("forward", "forward+backward", "ring", "decode")
HEAD_DIMS = ((64, None), (128, None), (192, 128), (256, None))  # (q/k H, v Hv; None: H)
MASKS = ("causal", "documents")
SEQ_LEN, HEADS = 4096, 8


@dataclasses.dataclass(frozen=True)
class Cell:
  """One compile of the matrix."""

  generation: str  # "v4", "v5e", "v5p" or "v6e"
  dtype: str  # "bfloat16", "float32" or "float16"
  program: str  # one of PROGRAMS
  head_dim: int  # H of q and k
  mask: str  # "causal" or "documents"
  value_dim: int | None = None  # Hv of v (None: H)

  @property
  def heads(self) -> str:
    """The head dims as the tables write them: ``H`` or ``H/Hv``."""
    return f"{self.head_dim}" + (f"/{self.value_dim}" if self.value_dim else "")


@dataclasses.dataclass
class Result:
  """What compiling one cell gave."""

  cell: Cell
  seconds: float  # trace + lower + compile on this host
  ok: bool
  error: str = ""  # the first line of the compiler's error
  passes: list = dataclasses.field(default_factory=list)  # (pass, bq, bk, VMEM MiB, capacity MiB)
  temp_mib: float = 0.0  # XLA temporaries of the program (HBM)


def _mesh(topology: str, chips: int, axis: str):
  from pallas_ring.aot import topology_devices
  devices = topology_devices(topology)[:chips]
  return jax.sharding.Mesh(np.array(devices), (axis,))


def _program(cell: Cell):
  """``(fn, args, mesh)`` of one cell."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  from pallas_ring import (SequenceParallelConfig, decode_attention, flash_attention, masks,
                           sharded_attention)
  topology, dt = TOPOLOGIES[cell.generation], jnp.dtype(cell.dtype)
  h, hv, docs = cell.head_dim, cell.value_dim or cell.head_dim, cell.mask == "documents"
  grad = lambda f: jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1, 2))
  if cell.program == "decode":
    mesh = _mesh(topology, 1, "x")
    sd = lambda shape, d=dt: jax.ShapeDtypeStruct(shape, d, sharding=NamedSharding(mesh, P()))
    lengths = np.array([4096, 1500], np.int32) if docs else None
    fn = lambda q, k, v: decode_attention(q, k, v, kv_lengths=lengths)
    return fn, (sd((2, 1, HEADS, h)), sd((2, SEQ_LEN, HEADS, h)),
                sd((2, SEQ_LEN, HEADS, hv))), mesh
  seg = lambda t: jnp.asarray(np.arange(t)[None] // 1000, jnp.int32) if docs else None
  if cell.program == "ring":
    mesh = _mesh(topology, 4, "sp")
    t = 4 * SEQ_LEN
    sd = lambda shape: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, P(None, "sp")))
    cfg = SequenceParallelConfig(axis_name="sp", layout="zigzag")
    fn = lambda q, k, v: sharded_attention(q, k, v, mesh=mesh, config=cfg, mask=masks.Causal(),
                                           segment_ids=seg(t))
    return grad(fn), (sd((1, t, HEADS, h)), sd((1, t, HEADS, h)), sd((1, t, HEADS, hv))), mesh
  mesh = _mesh(topology, 1, "x")
  sd = lambda d: jax.ShapeDtypeStruct((1, SEQ_LEN, HEADS, d), dt,
                                      sharding=NamedSharding(mesh, P()))
  fn = lambda q, k, v: flash_attention(q, k, v, mask=masks.Causal(), segment_ids=seg(SEQ_LEN))
  return (fn if cell.program == "forward" else grad(fn)), (sd(h), sd(h), sd(hv)), mesh


def compile_cell(cell: Cell) -> Result:
  """Compiles one cell, recording each kernel pass's tiles and VMEM."""
  from pallas_ring.kernels import pallas_tpu
  passes = []
  fit = pallas_tpu.tiles._fit  # pylint: disable=protected-access

  def recording(make, plan, bq, bk, cfg, like, which):
    p, vmem = fit(make, plan, bq, bk, cfg, like, which)
    c = p.kernel.keywords["cfg"]
    tiles = (c.block_q, c.block_kv) if which == "forward" else (c.block_q_bwd, c.block_kv_bwd)
    if vmem is not None:
      passes.append((which, *tiles, round(vmem.total / 2**20, 2), vmem.capacity // 2**20))
    return p, vmem

  pallas_tpu.tiles._fit = recording
  start = time.perf_counter()
  try:
    fn, args, mesh = _program(cell)
    with jax.set_mesh(mesh):
      compiled = jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes / 2**20
    return Result(cell, time.perf_counter() - start, True, passes=passes, temp_mib=temp)
  except Exception as e:  # noqa: BLE001 - a failed cell is reported, the matrix goes on
    first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
    return Result(cell, time.perf_counter() - start, False, first[:300], passes)
  finally:
    pallas_tpu.tiles._fit = fit


def cells(generations=tuple(TOPOLOGIES), dtypes=DTYPES, programs=PROGRAMS, head_dims=HEAD_DIMS,
          masks=MASKS):
  return [Cell(gen, dt, prog, h, mask, hv) for gen, dt, prog, (h, hv), mask
          in itertools.product(generations, dtypes, programs, head_dims, masks)]


def summary(results: list[Result]) -> str:
  """Per generation: cells compiled, compile seconds (median, max) and the largest VMEM of a
  program against the chip's capacity."""
  lines = [f"{'gen':5s} {'ok':>7s} {'median s':>8s} {'max s':>6s} {'max VMEM MiB':>12s} "
           f"{'of MiB':>6s}  largest program"]
  for gen in dict.fromkeys(r.cell.generation for r in results):
    rs = [r for r in results if r.cell.generation == gen]
    secs = [r.seconds for r in rs]
    top = max(((p[3], p[4], r, p) for r in rs for p in r.passes), default=None,
              key=lambda x: x[0])
    where = "-" if top is None else (f"{top[2].cell.dtype} {top[2].cell.program} "
                                     f"H={top[2].cell.heads} {top[2].cell.mask}: {top[3][0]} "
                                     f"{top[3][1]}x{top[3][2]}")
    lines.append(f"{gen:5s} {sum(r.ok for r in rs):3d}/{len(rs):<3d} {np.median(secs):8.1f} "
                 f"{max(secs):6.1f} {top[0] if top else 0:12.2f} {top[1] if top else 0:6d}  "
                 f"{where}")
  return "\n".join(lines)


def _head_dims(text: str) -> tuple[int, int | None]:
  """``"192/128"`` -> ``(192, 128)``, ``"64"`` -> ``(64, None)``."""
  h, _, hv = text.partition("/")
  return int(h), int(hv) if hv else None


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--generations", nargs="+", default=list(TOPOLOGIES), choices=list(TOPOLOGIES))
  p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
  p.add_argument("--programs", nargs="+", default=list(PROGRAMS), choices=list(PROGRAMS))
  p.add_argument("--head-dims", nargs="+", type=_head_dims, default=list(HEAD_DIMS),
                 help="H or H/Hv (q/k and v head dims), e.g. 128 192/128")
  p.add_argument("--masks", nargs="+", default=list(MASKS), choices=list(MASKS))
  p.add_argument("--json", help="also write every cell's result to this file")
  args = p.parse_args()
  todo = cells(args.generations, args.dtypes, args.programs, args.head_dims, args.masks)
  print(f"# {datetime.date.today()} JAX {jax.__version__}, libtpu "
        f"{importlib.metadata.version('libtpu')}; {len(todo)} cells", flush=True)
  results = []
  for cell in todo:
    r = compile_cell(cell)
    results.append(r)
    state = "ok" if r.ok else f"FAILS {r.error}"
    print(f"{cell.generation:4s} {cell.dtype:8s} {cell.program:16s} H={cell.heads:<7s} "
          f"{cell.mask:9s} {r.seconds:6.1f} s  {state}  {r.passes}", flush=True)
  print(summary(results))
  if args.json:
    with open(args.json, "w") as f:
      json.dump([dict(dataclasses.asdict(r.cell), seconds=r.seconds, ok=r.ok, error=r.error,
                      passes=r.passes, temp_mib=r.temp_mib) for r in results], f, indent=1)
  sys.exit(0 if all(r.ok for r in results) else 1)


if __name__ == "__main__":
  main()
