"""Ahead-of-time compilation of the ring for a TPU slice on a machine without TPUs (libtpu)."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from pallas_ring import masks as masks_lib
from pallas_ring.config import SequenceParallelConfig
from pallas_ring.sharded import sharded_attention


@dataclasses.dataclass(frozen=True)
class CompileReport:
  """What the TPU compiler made of one ring program."""

  topology: str  # e.g. "v5e:2x4"
  device_kind: str  # e.g. "TPU v5 lite"
  num_devices: int  # chips in the slice
  program: str  # "forward" or "forward+backward"
  argument_bytes: int  # per device
  output_bytes: int  # per device
  temp_bytes: int  # per device scratch
  kernels: int  # Pallas (Mosaic) custom calls in the program
  permutes_overlap_kernels: bool  # a collective-permute-start ... kernel ... -done sequence
  compile_seconds: float  # tracing, lowering and compiling, on this host
  permutes: int = 0  # collective-permute ops in the program (the ring's sends)
  all_to_alls: int = 0  # all-to-all ops in the program (Ulysses strategies)
  all_to_alls_overlap_kernels: bool = False  # an all-to-all-start ... kernel ... -done sequence


GENERATIONS = ("v4", "v5e", "v5p", "v6e")  # TPU generations whose compiles are tested


def libtpu_installed() -> bool:
  """Whether JAX can find libtpu: the ``libtpu`` package (the ``[tpu]`` extra) or
  ``TPU_LIBRARY_PATH``."""
  path = os.environ.get("TPU_LIBRARY_PATH")
  if path and os.path.isfile(path):
    return True
  try:
    return importlib.util.find_spec("libtpu") is not None
  except (ImportError, ValueError):  # (a module entry of None, a broken package)
    return False


def topology_devices(topology: str) -> np.ndarray:
  """The chips of a TPU topology such as ``"v5e:2x4"`` (libtpu; no TPU needed).

  Raises:
    ImportError: libtpu is not installed (naming ``pip install ".[tpu]"``).
    ValueError: one line naming the topology, libtpu's reason and the valid form.
  """
  from jax.experimental import topologies
  try:
    topo = topologies.get_topology_desc(topology_name=topology, platform="tpu")
  except Exception as e:  # noqa: BLE001 - libtpu raises JaxRuntimeError / RuntimeError
    if not libtpu_installed():
      raise ImportError(
          f"compiling for the TPU topology {topology!r} needs libtpu (the TPU compiler), which is "
          "not installed in this Python environment. Install the [tpu] extra: pip install "
          "\".[tpu]\" in a clone of pallas_ring (or pip install \"jax[tpu]\"), then run the "
          "command again; no TPU is needed.", name="libtpu") from None
    reason = str(e).splitlines()[0].split(": ", 1)[-1] if str(e) else type(e).__name__
    raise ValueError(
        f"topology={topology!r}: libtpu rejects it ({reason}). Use GENERATION:CHIPS with a "
        f"generation of {', '.join(GENERATIONS)} and a chip grid libtpu knows, e.g. v4:2x2x1, "
        f"v5e:2x2, v5e:2x4, v5p:2x2x1, v6e:2x4.") from None
  return np.array(topo.devices)


def overlaps_kernels(hlo_text: str, collective: str = "collective-permute") -> bool:
  """True when some scheduled computation starts a ``collective`` (an async one: ``-start`` /
  ``-done``), runs a kernel, then completes it."""
  for comp in hlo_text.split("\n\n"):
    lines = comp.splitlines()
    starts = [i for i, l in enumerate(lines) if f"{collective}-start" in l]
    dones = [i for i, l in enumerate(lines) if f"{collective}-done" in l]
    work = [i for i, l in enumerate(lines) if "custom-call(" in l or " conditional(" in l]
    if any(s < w < d for s in starts for d in dones for w in work):
      return True
  return False


def bytes_moved(strategy: str, *, seq_len: int, ring: int, ulysses: int = 1, heads: int,
                kv_heads: int, head_dim: int, itemsize: int = 2) -> tuple[int, int]:
  """``(forward, forward+backward)`` bytes each device sends for one attention layer, on paper.

  Args:
    strategy: ``"ring"``, ``"all_gather"``, ``"ulysses"`` or ``"ulysses_ring"``.
    seq_len: T, the whole sequence.
    ring: R, devices of ``axis_name`` (for ``"ulysses"``: its all-to-all's devices).
    ulysses: U, devices of ``ulysses_axis`` (``"ulysses_ring"`` only).
    heads, kv_heads, head_dim: N, K, H.
    itemsize: bytes of the inputs' dtype (dK/dV travel in float32 in the ring).

  What moves: the ring sends its K/V shard R-1 times each pass and its float32 dK/dV R-1 times
  in the backward; all_gather gathers K/V once per pass and reduce-scatters float32 dK/dV (the
  same bytes); Ulysses' all-to-alls send (U-1)/U of q, k, v and o (forward) and of do, dq, dk
  and dv (backward), with kv heads repeated to a multiple of U (``ulysses.kv_repeats``);
  ulysses_ring runs Ulysses inside each ring chunk and a ring of R over N/U heads.
  """
  from pallas_ring import ulysses as ulysses_lib
  t, n, k, h, b = seq_len, heads, kv_heads, head_dim, itemsize

  def ring_bytes(r, kv):
    kv_shard = 2 * (t // r) * kv * h  # K and V elements of one shard
    return (r - 1) * kv_shard * b, (r - 1) * kv_shard * (2 * b + 4)

  def a2a_bytes(u, tokens):  # one all-to-all round trip of q, k, v / o (and the backward's)
    kv = k * ulysses_lib.kv_repeats(k, u)
    once = (u - 1) * (tokens // u) * h * b * (2 * n + 2 * kv) // u
    return once, 2 * once, kv

  if strategy in ("ring", "all_gather"):
    return ring_bytes(ring, k)
  if strategy == "ulysses":
    fwd, both, _ = a2a_bytes(ring, t)
    return fwd, both
  if strategy == "ulysses_ring":
    fwd, both, kv = a2a_bytes(ulysses, t // ring)
    r_fwd, r_both = ring_bytes(ring, kv // ulysses)
    return fwd + r_fwd, both + r_both
  raise ValueError(f"strategy={strategy!r}: use one of ring, all_gather, ulysses, ulysses_ring.")


def compile_ring(topology: str, config: SequenceParallelConfig, *, seq_len: int, batch: int = 1,
                 heads: int = 16, kv_heads: int = 16, head_dim: int = 128,
                 mask=None, backward: bool = True, dtype=jnp.bfloat16,
                 ulysses_size: int = 2) -> CompileReport:
  """Compiles ``sharded_attention`` (forward, or forward+backward) for ``topology``: a 1-D mesh
  over the slice's chips (``config.axis_name``), or for ``strategy="ulysses_ring"`` a 2-D one,
  ``(chips / ulysses_size, ulysses_size)`` over ``(axis_name, ulysses_axis)``, with the
  ``pallas_tpu`` backend whatever ``config.backend`` names (its Mosaic kernels are what is
  counted)."""
  devices = topology_devices(topology)
  if config.batch_axes or config.head_axis:
    raise ValueError("compile_ring builds a mesh of the sequence axes only: use a config without "
                     "batch_axes / head_axis.")
  axes = (config.axis_name,)
  if config.ulysses_axis is not None:
    if devices.size % ulysses_size:
      raise ValueError(f"ulysses_size={ulysses_size} does not divide the {devices.size} chips "
                       f"of {topology}.")
    axes = (config.axis_name, config.ulysses_axis)
    devices = devices.reshape(devices.size // ulysses_size, ulysses_size)
  mesh = jax.sharding.Mesh(devices, axes)
  sharding = NamedSharding(mesh, P(None, axes))
  q = jax.ShapeDtypeStruct((batch, seq_len, heads, head_dim), dtype, sharding=sharding)
  kv = jax.ShapeDtypeStruct((batch, seq_len, kv_heads, head_dim), dtype, sharding=sharding)
  mask = masks_lib.Causal() if mask is None else mask
  cfg = config.replace(backend="pallas_tpu")

  def fwd(q_, k_, v_):
    return sharded_attention(q_, k_, v_, mesh=mesh, config=cfg, mask=mask, interpret=False)

  fn = fwd
  if backward:
    fn = jax.grad(lambda *a: jnp.sum(fwd(*a).astype(jnp.float32)), argnums=(0, 1, 2))
  start = time.perf_counter()
  compiled = jax.jit(fn).trace(q, kv, kv).lower(lowering_platforms=("tpu",)).compile()
  seconds = time.perf_counter() - start
  text = compiled.as_text()
  mem = compiled.memory_analysis()
  return CompileReport(
      topology=topology, device_kind=devices.flat[0].device_kind, num_devices=devices.size,
      program="forward+backward" if backward else "forward",
      argument_bytes=mem.argument_size_in_bytes, output_bytes=mem.output_size_in_bytes,
      temp_bytes=mem.temp_size_in_bytes, kernels=text.count("tpu_custom_call"),
      permutes_overlap_kernels=overlaps_kernels(text), compile_seconds=seconds,
      permutes=len(re.findall(r" collective-permute(?:-start)?\(", text)),
      all_to_alls=len(re.findall(r" all-to-all(?:-start)?\(", text)),
      all_to_alls_overlap_kernels=overlaps_kernels(text, "all-to-all"))
