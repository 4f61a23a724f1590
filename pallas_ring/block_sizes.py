"""``BlockSizes``: the kernels' tile sizes and kernel variants, a frozen dataclass.

Its own module (re-exported by ``config``) so that the kernels can import it while ``config``
imports the kernels' registry to check backend names: no import cycle.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Mapping, Optional


def check_keys(cls, data: Mapping[str, Any]) -> None:
  if not isinstance(data, Mapping):
    raise ValueError(f"{cls.__name__} expects a mapping of field names, got {type(data).__name__}.")
  names = [f.name for f in dataclasses.fields(cls)]
  for key in data:
    if key not in names:
      close = difflib.get_close_matches(str(key), names, n=1)
      hint = f" Did you mean {close[0]!r}?" if close else ""
      raise ValueError(
          f"{cls.__name__}: unknown key {key!r}.{hint} Valid keys are: {', '.join(names)}.")


def positive_or_none(cls: str, field: str, value, rule: str = "") -> None:
  if value is None:
    return
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"{cls}.{field}={value!r} is invalid: it must be a positive int or None "
                     f"(None picks a default){rule}.")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes of the attention kernels; None lets the backend's heuristic choose.

  The Triton backend needs powers of two; the Mosaic GPU backend powers of two with block_q >= 128
  (a CTA's two warpgroups) and block_kv >= 64; the TPU backend needs multiples of 128 on the key
  axis and of 8 on the query axis (or the whole padded sequence).
  """

  block_q: Optional[int] = None  # query rows per forward tile
  block_kv: Optional[int] = None  # key rows per forward tile
  block_q_bwd: Optional[int] = None  # query rows per backward tile (dQ and dK/dV passes)
  block_kv_bwd: Optional[int] = None  # key rows per backward tile
  num_warps: Optional[int] = None  # Triton: warps per program (pallas_mosaic_gpu: its backward's)
  num_stages: Optional[int] = None  # Triton: pipelining depth; pallas_mosaic_gpu: K/V SMEM slots
  # decode_attention: contiguous chunks the KV cache is split into, each streamed by its own
  # programs (None: enough to fill the device, ``Backend.decode_programs``).
  kv_splits: Optional[int] = None
  # A backend's kernel-variant config (a frozen dataclass, e.g. ``pallas_mosaic_gpu.Variants``):
  # part of the jit key, so a changed variant retraces. None: the backend's defaults.
  variants: Any = None

  def __post_init__(self):
    for f in dataclasses.fields(self):
      if f.name != "variants":
        positive_or_none("BlockSizes", f.name, getattr(self, f.name))
    v = self.variants
    if v is not None and not (dataclasses.is_dataclass(v) and not isinstance(v, type)
                              and v.__dataclass_params__.frozen):
      raise ValueError(f"BlockSizes.variants={v!r} is invalid: it must be a backend's frozen "
                       "variant config (e.g. pallas_ring.kernels.pallas_mosaic_gpu.Variants()) "
                       "or None.")

  @classmethod
  def from_dict(cls, data: Optional[Mapping[str, Any]]) -> "BlockSizes":
    if data is None:
      return cls()
    check_keys(cls, data)
    return cls(**data)

  def replace(self, **kw) -> "BlockSizes":
    return dataclasses.replace(self, **kw)


__all__ = ["BlockSizes", "check_keys", "positive_or_none"]
