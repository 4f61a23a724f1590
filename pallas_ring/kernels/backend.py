"""The interface every kernel lowering implements, and what a backend is asked about a call.

A backend is one object, registered once (``pallas_ring.kernels``' registry): its name, the
platform family its kernels run on natively, what it can serve (``supports``), its tile rules
(defaults, checks, clamps, head-dim padding, tuning candidates), its kernel-variant config, and
the kernels of the contract in ``kernels.common`` (``forward``, ``backward``, and optionally a
dedicated ``decode``). Nothing outside the registry compares backend names: callers ask the
object.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Optional

import jax

from pallas_ring.block_sizes import BlockSizes

TILE_FIELDS = ("block_q", "block_kv", "block_q_bwd", "block_kv_bwd")


def next_pow2(x: int) -> int:
  """The smallest power of two >= x (1 for x <= 1)."""
  return 1 << max(0, (x - 1).bit_length())


def round_up(x: int, m: int) -> int:
  """The smallest multiple of m >= x."""
  return -(-x // m) * m


@dataclasses.dataclass(frozen=True)
class Call:
  """What decides whether a backend can serve a call (hashable, static)."""

  dtype: Any  # the inputs' dtype
  head_dim: int  # H, unpadded
  decode: bool = False  # decode_attention: a few query rows against a long KV cache
  block_sizes: BlockSizes = BlockSizes()  # the user's tile overrides (and kernel variants)


class Backend:
  """One kernel lowering. Subclasses set the class attributes and override what differs."""

  name: ClassVar[str]  # the ``backend=`` string
  platform: ClassVar[Optional[str]] = None  # family its kernels run on natively; None: every one
  computes_float64: ClassVar[bool] = False  # whether float64 inputs are computed in float64
  # whether float32 matmuls follow jax.default_matmul_precision (else the kernels' own: TF32 on
  # NVIDIA GPUs)
  follows_matmul_precision: ClassVar[bool] = False
  variants_cls: ClassVar[Optional[type]] = None  # frozen dataclass of its kernel variants
  fallback: ClassVar[str] = "xla"  # what to ask for when this backend cannot serve a call

  # -- what it serves ----------------------------------------------------------------------------

  def supports(self, call: Call) -> Optional[str]:
    """Why this backend cannot serve ``call`` (None when it can): dtype, device, head dim.
    (Every backend serves every optional operand, ``operands.DECLARED``.)"""
    del call
    return None

  def auto_eligible(self) -> bool:
    """Whether ``backend="auto"`` may pick this backend in this process (e.g. a device check)."""
    return True

  def auto_prefers(self, call: Call) -> bool:
    """Whether ``backend="auto"`` picks this backend for a call it serves (False: a later one
    in the registry serves it faster; an explicit request still gets this one)."""
    del call
    return True

  # -- tiles -------------------------------------------------------------------------------------

  def default_block_sizes(self, head_dim: int, device_kind: str, dtype=None,
                          value_dim: Optional[int] = None) -> BlockSizes:
    """The heuristic tiles for a head dim on a device kind, for inputs of ``dtype`` (None:
    16-bit) and v of head dim ``value_dim`` (None: ``head_dim``)."""
    del head_dim, device_kind, dtype, value_dim
    return BlockSizes(128, 128, 128, 128, None, None)

  def block_size_error(self, field: str, value: int) -> Optional[str]:
    """Why ``block_sizes.<field>=value`` breaks this backend's rules, with the fix; or None."""
    del field, value
    return None

  def check_block_sizes(self, bs: BlockSizes) -> None:
    """Raises ValueError when user-given tiles or variants break this backend's rules."""
    for f in TILE_FIELDS:
      value = getattr(bs, f)
      why = None if value is None else self.block_size_error(f, value)
      if why is not None:
        raise ValueError(f"block_sizes.{f}={value} cannot be used by backend {self.name!r}: "
                         f"{why}")
    if bs.variants is not None and not isinstance(bs.variants, self.variants_cls or ()):
      want = (f"{self.variants_cls.__module__}.{self.variants_cls.__name__}"
              if self.variants_cls else "None (it has no kernel variants)")
      raise ValueError(f"block_sizes.variants={bs.variants!r} cannot be used by backend "
                       f"{self.name!r}: it takes {want}.")

  def variants(self, bs: BlockSizes) -> Any:
    """The kernel-variant config of a call (the user's, else this backend's defaults)."""
    if bs.variants is not None:
      return bs.variants
    return None if self.variants_cls is None else self.variants_cls()

  def tile_caps(self, q_len: int, kv_len: int) -> tuple[int, int, int]:
    """The largest useful query, key and backward key tiles for these sequence lengths."""
    return q_len, kv_len, kv_len

  def clamp(self, tiles: tuple[int, int, int, int], q_len: int, kv_len: int
            ) -> tuple[int, int, int, int]:
    """``(block_q, block_kv, block_q_bwd, block_kv_bwd)`` clamped to ``tile_caps``."""
    cap_q, cap_k, cap_kb = self.tile_caps(q_len, kv_len)
    bq, bk, bqb, bkb = tiles
    return min(bq, cap_q), min(bk, cap_k), min(bqb, cap_q), min(bkb, cap_kb)

  def padded_head_dim(self, head_dim: int) -> int:
    """The head dim this backend's kernels see (inputs are zero-padded to it)."""
    return head_dim

  def padded_value_dim(self, value_dim: int, head_dim: int) -> int:
    """The v head dim its ``flash_attention`` kernels see, given v's ``value_dim`` and the
    padded ``head_dim`` they run q/k at: that (v zero-padded to it) unless the kernels take a
    narrower v (``kernels.common``)."""
    del value_dim
    return head_dim

  def tuning_candidates(self, head_dim: int, interpret: bool) -> dict[str, list[dict]]:
    """Tile candidates per pass (``"fwd"``, ``"bwd"``) for ``python -m pallas_ring tune``."""
    del head_dim
    sizes = [64, 128] if interpret else [64, 128, 256]
    return {"fwd": [dict(block_q=q, block_kv=k) for q in sizes for k in sizes],
            "bwd": [dict(block_q_bwd=q, block_kv_bwd=k) for q in sizes for k in sizes]}

  def decode_programs(self, interpret: bool, fp8: bool = False) -> int:
    """How many concurrent programs fill the device: ``decode_attention`` splits a cache into
    chunks until its kernel grid has about this many (1: no split). ``fp8``: the kernel reads
    an FP8 cache."""
    del interpret, fp8
    return 1

  # -- kernels (``kernels.common``'s contract) ---------------------------------------------------

  def forward(self, q, k, v, ops, plan, cfg, acc=None):
    """``(o, lse)`` of one (q shard, kv shard) pair (see ``kernels.common``)."""
    raise NotImplementedError

  def backward(self, q, k, v, do, lse, delta, ops, plan, cfg, dq_acc=None, parts="both",
               dkv_acc=None):
    """``(dq, dk, dv)`` of one pair (see ``kernels.common``)."""
    raise NotImplementedError

  def fuses_backward(self, cfg, head_dim: int, segments: bool, fp8: bool) -> bool:
    """Whether ``backward`` of both parts is one fused kernel for a pair with ``cfg`` at (padded)
    ``head_dim``, with segment ids (``segments``) and FP8 operands (``fp8``): cheaper than its
    dQ and dK/dV halves apart (the ring then runs its local pair whole,
    ``RingVariants.whole_local_pair``)."""
    del cfg, head_dim, segments, fp8
    return False

  # A dedicated decode kernel ``decode(q, k, v, q_pos, lengths, offset, cfg: DecodeConfig) ->
  # (o, lse)`` (``pallas_triton_decode.decode`` documents the contract), or None: then
  # ``decode_attention`` runs ``forward`` over chunks of the cache with a block plan.
  decode: ClassVar[Optional[Callable]] = None
  # Whether ``decode`` reads an FP8 (float8_e4m3fn / e5m2) cache itself, widening each tile as it
  # loads it (``fp8.fold`` has taken the descales out); else the cache is widened in XLA first.
  decode_reads_fp8: ClassVar[bool] = False
  # Whether ``forward`` takes FP8 K/V (with 16/32-bit q), widening each tile as it loads it:
  # ``decode_attention``'s chunked path then hands it the FP8 cache unwidened.
  forward_reads_fp8_kv: ClassVar[bool] = False
  # Whether ``forward`` takes q, k and v of one FP8 dtype with their descales (``Operands.fp8``)
  # (and runs its matmuls in FP8, or widens them as it reads them); else FP8 operands are
  # widened in XLA first.
  forward_reads_fp8: ClassVar[bool] = False
  # Whether ``backward`` takes them too (its gradients are the dequantized values'); else the
  # custom VJP dequantizes them first.
  backward_reads_fp8: ClassVar[bool] = False

  def __repr__(self) -> str:
    return f"<backend {self.name}>"


def gpu_programs(interpret: bool, per_sm: int = 2) -> int:
  """``Backend.decode_programs`` of a GPU kernel: ``per_sm`` programs per streaming
  multiprocessor of the local GPU (1 in interpret mode or without a GPU)."""
  if interpret:
    return 1
  try:
    gpu = jax.devices("gpu")[0]
  except RuntimeError:
    return 1
  return per_sm * int(getattr(gpu, "core_count", 0) or 132)


__all__ = ["Backend", "Call", "TILE_FIELDS", "next_pow2", "round_up", "gpu_programs"]
