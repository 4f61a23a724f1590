"""Command line: ``python -m pallas_ring demo | bench | compile | tune``."""

from __future__ import annotations

import argparse
import math
import os
import sys


def _ensure_devices(n: int = 8) -> None:
  """On a CPU-only machine, ask XLA for ``n`` virtual devices (before JAX initialises)."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def demo(args) -> int:
  """Ring attention over every device, each mask and layout, checked against the reference."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import AxisType

  from pallas_ring import block_sparse, layouts, masks, reference
  from pallas_ring.config import SequenceParallelConfig
  from pallas_ring.sharded import sharded_attention

  r = jax.device_count()
  t, b, n, kh, h = args.seq_len, 1, 4, 2, args.head_dim
  if t % (2 * r):
    print(f"demo: --seq-len {t} must be a multiple of {2 * r} (2 zigzag chunks on each of {r} "
          f"devices), e.g. --seq-len {max(1, round(t / (2 * r))) * 2 * r}.", file=sys.stderr)
    return 2
  blk = math.gcd(16, t // (2 * r))  # the work table's tiles: whole ones in each zigzag chunk
  if args.strategy == "ulysses":  # (its heads split over the devices)
    n = r * 4 // np.gcd(r, 4)
  print(f"devices: {r} x {jax.devices()[0].device_kind} ({jax.default_backend()}), "
        f"jax {jax.__version__}; T={t}, N={n}, K={kh}, H={h}, {args.dtype}, tile {blk}, "
        f"strategy {args.strategy}")
  mesh = jax.make_mesh((r,), ("sp",), axis_types=(AxisType.Auto,))
  rng = np.random.default_rng(0)
  dtype = jnp.dtype(args.dtype)
  # Inputs in the run's dtype; the reference computes in float32 on the same (rounded) values.
  q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype).astype(
      jnp.float32) for shape in ((b, t, n, h), (b, t, kh, h), (b, t, kh, h)))
  docs = jnp.asarray(np.sort(rng.integers(0, 6, (b, t)), axis=1), jnp.int32)
  cases = {"causal": (masks.Causal(), None), "window 32": (masks.SlidingWindow(32), None),
           "documents": (masks.Causal(), docs), "full": (masks.Full(), None)}
  print("work = live (non-empty) tiles a device computes, summed over the R ring steps, as a "
        "fraction of one full\n"
        "       (T/R x T/R) pair: lower is less work; a device's time is its work, the ring's time "
        "the largest.\n"
        "max/mean = imbalance: the busiest device's work over the average (1.00 = all equal).\n"
        "total = all devices' work together; for causal, zigzag does the least total work at "
        "balance 1.00.\n"
        "errors: max |out - ref| and max relative error of dQ, dK, dV against the dense "
        "reference.\n")
  header = (f"{'mask':10s} {'layout':10s} {'work per device':40s} {'total':>6s} "
            f"{'max/mean':>8s} {'max |err|':>9s} {'grad err':>9s}")
  print(header)
  print("-" * len(header))
  worst = worst_grad = 0.0
  loss_w = jnp.cos(jnp.arange(h, dtype=jnp.float32))  # the loss is sum(out * loss_w)
  grads = lambda f: jax.grad(lambda *a: jnp.sum(f(*a) * loss_w), argnums=(0, 1, 2))
  for (name, (mask, seg)), layout in [(c, l) for c in cases.items() for l in layouts.LAYOUTS]:
    perm = lambda x: None if x is None else layouts.permute(x, layout, r)
    seg_l = perm(seg)
    per_device = np.zeros((r, r))  # [device, step] live-tile fraction
    tl = t // r
    for d in range(r):
      qpos = layouts.positions(t, layout, r, d)
      q_seg = None if seg_l is None else seg_l[:, d * tl:(d + 1) * tl]
      for s in range(r):
        src = (d - s) % r
        kv_seg = None if seg_l is None else seg_l[:, src * tl:(src + 1) * tl]
        plan = block_sparse.make_plan(
            mask, block_sparse.make_token_info(tl, b, qpos, q_seg),
            block_sparse.make_token_info(tl, b, layouts.positions(t, layout, r, src), kv_seg),
            block_q=blk, block_kv=blk, q_len=tl, kv_len=tl)
        per_device[d, s] = float(block_sparse.live_fraction(plan).mean())
    cfg = SequenceParallelConfig(axis_name="sp", layout=layout, backend=args.backend,
                                 strategy=args.strategy)
    ours = lambda q_, k_, v_: layouts.unpermute(sharded_attention(
        *(perm(x).astype(dtype) for x in (q_, k_, v_)), mesh=mesh, config=cfg, mask=mask,
        segment_ids=seg_l), layout, r).astype(jnp.float32)
    ref = lambda q_, k_, v_: reference.attention(q_, k_, v_, mask=mask, segment_ids=seg)[0]
    err = float(jnp.max(jnp.abs(jax.jit(ours)(q, k, v) - ref(q, k, v))))
    # Gradients: largest relative error ||got - ref|| / ||ref|| over dQ, dK, dV.
    grad_err = max(float(jnp.linalg.norm(a - b_) / jnp.linalg.norm(b_))
                   for a, b_ in zip(jax.jit(grads(ours))(q, k, v), grads(ref)(q, k, v)))
    worst, worst_grad = max(worst, err), max(worst_grad, grad_err)
    work = per_device.sum(axis=1)
    cells = " ".join(f"{w:4.2f}" for w in work)
    print(f"{name:10s} {layout:10s} {cells:40s} {work.sum():6.2f} "
          f"{work.max() / max(work.mean(), 1e-9):8.2f} {err:9.2e} {grad_err:9.2e}")
    if args.verbose:
      print("  live fraction [device x step]:\n" + "\n".join(
          "   " + " ".join(f"{x:4.2f}" for x in row) for row in per_device))
  if dtype != jnp.float32:  # 16-bit inputs and outputs
    tol = 5e-2
  else:
    tol = 1e-4 if jax.default_backend() == "cpu" else 1e-2  # GPU float32 dots run as TF32
  ok = worst < tol and worst_grad < tol
  print(f"\nagainst the dense reference: max |err| {worst:.2e}, gradients' relative error "
        f"{worst_grad:.2e} (tolerance {tol:g}) -> {'OK' if ok else 'FAILED'}")
  return 0 if ok else 1


def compile_cmd(args) -> int:
  from pallas_ring.aot import compile_ring, topology_devices
  from pallas_ring.config import SequenceParallelConfig, load_preset
  try:  # a bad preset or topology: one line naming the valid choices
    preset = load_preset(args.config) if args.config else None
    topology = args.topology or (preset and preset.topology) or DEFAULT_TOPOLOGY
    topology_devices(topology)
  except (ValueError, OSError, ImportError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  cfg = preset.config if preset else SequenceParallelConfig(axis_name="sp", layout="zigzag")
  unused = {f: getattr(cfg, f) for f in ("batch_axes", "head_axis") if getattr(cfg, f)}
  if cfg.backend not in ("auto", "pallas_tpu"):
    unused["backend"] = cfg.backend
  if unused:  # (compile_ring's program: B=1, the sequence over every chip)
    print("note: compiling B=1, the sequence sharded over every chip, with pallas_tpu: the "
          f"config's {', '.join(f'{k}={v!r}' for k, v in unused.items())} are not used",
          file=sys.stderr, flush=True)
  cfg = cfg.replace(batch_axes=(), head_axis=None)
  if args.strategy == "ulysses_ring" and cfg.ulysses_axis is None:
    print("error: --strategy ulysses_ring needs a --config whose mesh has a Ulysses axis, e.g. "
          "--config tpu_v5p_16_ulysses_ring", file=sys.stderr)
    return 2
  if args.strategy is not None:  # (another strategy than the preset's drops its Ulysses axis)
    cfg = cfg.replace(strategy=args.strategy, ulysses_axis=(
        cfg.ulysses_axis if args.strategy == "ulysses_ring" else None))
  ulysses = {}
  if cfg.ulysses_axis is not None and preset and preset.mesh_axes:
    ulysses = dict(ulysses_size=preset.mesh_shape[preset.mesh_axes.index(cfg.ulysses_axis)])
  print(f"compiling sharded_attention for {topology}: causal mask, bfloat16, B=1, "
        f"T={args.seq_len} tokens over the slice, N={args.heads}, K={args.kv_heads}, "
        f"H={args.head_dim}, strategy={cfg.strategy}, layout={cfg.layout}", flush=True)
  if cfg.strategy == "auto":
    _print_auto_choice(cfg, topology_devices(topology).size, args)
  for backward in (False, True):
    program = "forward+backward" if backward else "forward"
    print(f"  {program} ...", end=" ", flush=True)
    rep = compile_ring(topology, cfg, seq_len=args.seq_len, heads=args.heads,
                       kv_heads=args.kv_heads, head_dim=args.head_dim, backward=backward,
                       **ulysses)
    gib = lambda x: f"{x / 2**30:.3f} GiB"
    print(f"compiled in {rep.compile_seconds:.1f} s\n"
          f"    {rep.num_devices} x {rep.device_kind}: {rep.kernels} Mosaic kernels; per device: "
          f"arguments {gib(rep.argument_bytes)}, outputs {gib(rep.output_bytes)}, "
          f"temporaries {gib(rep.temp_bytes)}", flush=True)
    if rep.permutes:
      print(f"    {rep.permutes} collective permutes: "
            f"{'some overlap' if rep.permutes_overlap_kernels else 'NONE overlaps'} the kernels",
            flush=True)
    if rep.all_to_alls:
      how = ("some overlap the kernels" if rep.all_to_alls_overlap_kernels else
             "none overlaps a kernel (XLA runs them between the kernels)")
      print(f"    {rep.all_to_alls} all-to-alls: {how}", flush=True)
  _print_bytes_moved(rep.num_devices, ulysses.get("ulysses_size", 2), args)
  return 0


def _print_auto_choice(cfg, chips: int, args) -> None:
  """What ``strategy="auto"`` runs for the compiled call, and its modelled costs."""
  from pallas_ring import auto, masks
  choice = auto.choose(masks.Causal(), seq_len=args.seq_len, heads=args.heads,
                       kv_heads=args.kv_heads, head_dim=args.head_dim, ring_size=chips,
                       layout=cfg.layout, itemsize=2)
  print(f"  {choice.describe()}", flush=True)


def _print_bytes_moved(chips: int, u: int, args) -> None:
  """Bytes each device sends per attention layer, per strategy, on paper (bf16)."""
  from pallas_ring.aot import bytes_moved
  shape = dict(seq_len=args.seq_len, heads=args.heads, kv_heads=args.kv_heads,
               head_dim=args.head_dim)
  print(f"bytes each device sends per layer (on paper, bf16; T={args.seq_len}, N={args.heads}, "
        f"K={args.kv_heads}, H={args.head_dim}, {chips} chips):")
  rows = [("ring", dict(ring=chips)), ("all_gather", dict(ring=chips))]
  if args.heads % chips == 0:
    rows.append(("ulysses", dict(ring=chips)))
  if chips % u == 0 and args.heads % u == 0:
    rows.append((f"ulysses_ring ({chips // u} x {u})", dict(ring=chips // u, ulysses=u)))
  mib = lambda x: f"{x / 2**20:9.1f} MiB"
  for name, kw in rows:
    fwd, both = bytes_moved(name.split()[0], **kw, **shape)
    print(f"  {name:22s} forward {mib(fwd)}, forward+backward {mib(both)}")


DEFAULT_TOPOLOGY = "v5e:2x4"


def tune_cmd(args) -> int:
  """Measures tile candidates for one shape class and merges the winners into the cache."""
  import jax
  from pallas_ring import kernels, tune
  from pallas_ring.kernels import tile_cache
  backend = kernels.native_backend(args.dtype) if args.backend == "auto" else args.backend
  interpret = args.interpret or kernels.interprets(backend, jax.default_backend())
  if interpret and not args.interpret:  # (as flash_attention's interpret=None)
    print(f"note: {backend}'s kernels do not run on {jax.default_backend()}: timing them in "
          "interpret mode (keep --seq-len small)", flush=True)
  problem = tune.Problem(backend=backend, seq_len=args.seq_len, heads=args.heads,
                         kv_heads=args.kv_heads, head_dim=args.head_dim,
                         dtype=args.dtype, mask=args.mask, batch=args.batch,
                         interpret=interpret)
  print(f"tuning {problem} on {jax.devices()[0].device_kind}", flush=True)
  results = tune.tune(problem, passes=tuple(args.passes.split(",")), iters=args.iters,
                      reps=args.reps)
  tune.report(results)
  entries = tune.winners(problem, results)
  if not entries:
    print("no valid candidate: nothing written")
    return 1
  path = tile_cache.store(entries)
  for key, tiles in entries.items():
    print(f"cached {key}: {tiles}")
  print(f"tile cache: {path}")
  return 0


def _positive(text: str) -> int:
  """An argparse type: an integer >= 1."""
  try:
    value = int(text)
  except ValueError:
    value = 0
  if value < 1:
    raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
  return value


def _passes(text: str) -> str:
  """An argparse type: ``fwd``, ``bwd`` or both, comma-separated."""
  if not text or not set(text.split(",")) <= {"fwd", "bwd"}:
    raise argparse.ArgumentTypeError(f"{text!r}: expected fwd, bwd or fwd,bwd")
  return text


def _backend(text: str) -> str:
  """An argparse type: a registered kernel backend or ``auto`` (imports JAX only when given)."""
  from pallas_ring import kernels
  if text not in kernels.backend_names():
    raise argparse.ArgumentTypeError(
        f"{text!r}: expected one of {', '.join(kernels.backend_names())}")
  return text


def _head_counts(p: argparse.ArgumentParser) -> None:
  """``--heads`` and ``--kv-heads`` (checked together by ``main``)."""
  p.add_argument("--heads", type=_positive, default=16, help="query heads N")
  p.add_argument("--kv-heads", type=_positive, default=None,
                 help="key/value heads K, dividing N (None: K = N)")


def _parser() -> argparse.ArgumentParser:
  fmt = argparse.ArgumentDefaultsHelpFormatter
  argv0 = os.path.basename(sys.argv[0])
  prog = argv0 if argv0 == "pallas-ring" else "python -m pallas_ring"  # (console script or -m)
  parser = argparse.ArgumentParser(prog=prog, formatter_class=fmt,
                                   description="pallas_ring: block-sparse flash and ring attention")
  sub = parser.add_subparsers(dest="cmd", metavar="{demo,bench,compile,tune}")

  def command(name, **kw):  # (main's errors name the command's usage: ``command_parser``)
    p = sub.add_parser(name, formatter_class=fmt, **kw)
    p.set_defaults(command_parser=p)
    return p

  p = command("demo",
              help="ring attention on all devices (8 virtual CPU devices on CPU), each "
                   "mask x layout, checked against the dense reference")
  p.add_argument("--seq-len", type=_positive, default=256, help="total tokens")
  p.add_argument("--head-dim", type=_positive, default=64, help="head dim H")
  p.add_argument("--backend", type=_backend, default="auto", help="kernel backend")
  p.add_argument("--strategy", default="ring", choices=["ring", "all_gather", "ulysses"],
                 help="sequence-parallel strategy (the work columns are the ring's schedule)")
  p.add_argument("--verbose", action="store_true", help="print the device x step live matrix")
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                 help="input dtype (on Hopper GPUs, 16-bit inputs run the Mosaic GPU forward)")
  p = command("bench", help="GPU benchmarks against cuDNN and Pallas mha")
  p.add_argument("--ring", action="store_true", help="ring benchmark over all local GPUs")
  p.add_argument("--extras", action="store_true",
                 help="cost of attention dropout and ALiBi (causal fwd+bwd, T=16k)")
  p.add_argument("--models", action="store_true",
                 help="causal model shapes: Llama GQA 32/8, H=256, H=64 (vs cuDNN)")
  p.add_argument("--decode", action="store_true",
                 help="decode (1-8 new tokens against a KV cache) vs cuDNN and XLA: GB/s and %% "
                      "of HBM bandwidth")
  p.add_argument("--long-context", type=int, default=0, metavar="TOKENS",
                 help="causal zigzag ring fwd+bwd over TOKENS total tokens (e.g. 1048576)")
  p.add_argument("--device-time", action="store_true",
                 help="time each batch of calls by its GPU ops' span in a profiler trace "
                      "instead of the host's clock")
  p.add_argument("--out", default="bench_out", help="folder for JSON and the PNG plot")
  p = command("compile", help="compile the ring for a TPU slice on this machine (libtpu)")
  p.add_argument("--topology", default=None,
                 help=f"TPU topology, e.g. v5e:2x4, v6e:2x4; None: the config's `topology:`, "
                      f"else {DEFAULT_TOPOLOGY}")
  p.add_argument("--config", default=None,
                 help="a preset name (e.g. tpu_v5e_8) or the path of a YAML config")
  p.add_argument("--seq-len", type=_positive, default=32768, help="total tokens over the ring")
  _head_counts(p)
  p.add_argument("--head-dim", type=_positive, default=128, help="head dim H")
  p.add_argument("--strategy", default=None,
                 choices=["auto", "ring", "all_gather", "ulysses", "ulysses_ring"],
                 help="sequence-parallel strategy (None: the config's); auto prints its choice")
  p = command("tune",
              help="measure tile candidates on this device and write the tile cache")
  p.add_argument("--backend", type=_backend, default="auto",
                 help="kernel backend (auto: this device's native one, xla on CPU)")
  p.add_argument("--seq-len", type=_positive, default=4096, help="tokens T = S")
  _head_counts(p)
  p.add_argument("--head-dim", type=_positive, default=128, help="head dim H")
  p.add_argument("--batch", type=_positive, default=1, help="batch B")
  p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                 help="input dtype")
  p.add_argument("--mask", default="causal", help="causal | full | window:W | docs:L")
  p.add_argument("--passes", type=_passes, default="fwd,bwd", help="fwd, bwd or fwd,bwd")
  p.add_argument("--interpret", action="store_true",
                 help="run Pallas kernels in interpret mode (tiny sizes; the default where the "
                      "backend's kernels cannot run on this device)")
  p.add_argument("--iters", type=_positive, default=10, help="calls per timing")
  p.add_argument("--reps", type=_positive, default=5, help="timings per candidate (median)")
  return parser


def _parse_args(argv=None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
  """The parser and the parsed ``argv``, ``--kv-heads`` resolved and checked against ``--heads``."""
  parser = _parser()
  args = parser.parse_args(argv)
  if hasattr(args, "kv_heads"):
    args.kv_heads = args.kv_heads or args.heads
    if args.heads % args.kv_heads:
      args.command_parser.error(f"--heads {args.heads} must be a multiple of --kv-heads "
                                f"{args.kv_heads} (MHA: equal, GQA: a divisor, MQA: 1)")
  return parser, args


def main(argv=None) -> None:
  parser, args = _parse_args(argv)
  if args.cmd is None:  # (asked for nothing: the verbs, and success)
    parser.print_help()
    sys.exit(0)
  if args.cmd == "demo":
    _ensure_devices(8)
  if args.cmd == "compile":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if args.cmd == "bench":
    from pallas_ring import bench
    sys.exit(bench.main(args))
  try:
    sys.exit({"demo": demo, "compile": compile_cmd, "tune": tune_cmd}[args.cmd](args))
  except (ValueError, TypeError) as e:  # the library's checks of these sizes: one line each
    args.command_parser.error(str(e))
