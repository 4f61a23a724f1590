"""Typed configs: kernel block sizes (``BlockSizes``, from ``block_sizes``), the ring's schedule
variants (``RingVariants``) and the sequence-parallel config (``SequenceParallelConfig``).

All are frozen dataclasses (hashable, usable as jit static arguments); the configs have
``from_dict`` and ``from_yaml``. Unknown keys and invalid values raise ``ValueError`` naming the
field, the value, the rule and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from typing import Any, Mapping, Optional

from pallas_ring import kernels
from pallas_ring.block_sizes import BlockSizes, check_keys
from pallas_ring.layouts import LAYOUTS

STRATEGIES = ("ring", "all_gather", "ulysses", "ulysses_ring", "auto")


def _load_yaml(path) -> Mapping[str, Any]:
  import yaml  # local import: only configs read from files need it

  class Loader(yaml.SafeLoader):  # (PyYAML keeps a repeated key's last value, silently)
    pass

  def mapping(loader, node):
    seen = set()
    for key_node, _ in node.value:
      key = loader.construct_object(key_node)
      if key in seen:
        raise ValueError(f"{path}: key {key!r} appears more than once in one mapping (again on "
                         f"line {key_node.start_mark.line + 1}); keep one.")
      seen.add(key)
    return loader.construct_mapping(node)

  Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
  with open(path) as f:
    data = yaml.load(f, Loader=Loader)
  return {} if data is None else data


PRESETS_DIR = os.path.join(os.path.dirname(__file__), "configs")
# Top-level sections of a preset file; a file without them is a bare SequenceParallelConfig.
_SECTIONS = ("sequence_parallel", "mesh", "topology")


def preset_names() -> list[str]:
  """Names of the presets shipped with the package (``pallas_ring/configs/*.yaml``)."""
  return sorted(f[:-5] for f in os.listdir(PRESETS_DIR) if f.endswith(".yaml"))


def _preset_path(name_or_path) -> str:
  path = os.fspath(name_or_path)
  if os.path.exists(path):
    return path
  if path.endswith((".yaml", ".yml")) or os.sep in path:
    stem, _ = os.path.splitext(os.path.basename(path))
    # ``configs/NAME.yaml`` as DESIGN writes it, from any working directory: the shipped file
    if stem in preset_names() and os.path.normpath(path).replace(os.sep, "/") in (
        f"configs/{stem}.yaml", f"{stem}.yaml"):
      return os.path.join(PRESETS_DIR, stem + ".yaml")
    raise FileNotFoundError(f"no YAML file at {path!r} (from {os.getcwd()!r}). Shipped presets "
                            f"load by name: {', '.join(preset_names())}.")
  if name_or_path not in preset_names():
    close = difflib.get_close_matches(path, preset_names(), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"unknown preset {path!r}.{hint} Shipped presets: "
                     f"{', '.join(preset_names())}; or pass the path of a YAML file.")
  return os.path.join(PRESETS_DIR, path + ".yaml")


@dataclasses.dataclass(frozen=True)
class RingVariants:
  """Static variants of the ring's schedule (a jit static argument, like ``BlockSizes``).

  Attributes:
    halo: send only the slice of a remote K/V shard that the mask can see (``halo_runs``), and
      receive only its dK/dV; False sends whole shards (the ring before halos).
    halo_max_share: send the whole shard where the slice, padded to the kernels' tiles, is at
      least this share of the padded shard.
    gather_halos: with ``halo``, where the slices the mask reaches (unpadded, over every hop)
      are less than ``halo_max_share`` of a shard in all and no operand spans the keys, receive
      them once and attend to the local K/V plus the slices in one kernel call
      (``halo_gather``) instead of ring steps.
    forward_received: where a ring packs its sends into one buffer (GPU), each forward step
      sends on the buffer it received; False unpacks it and packs the K/V again.
    whole_local_pair: the local pair's backward runs as one call at the first step and its
      float32 dK/dV wait, added by XLA, for the other devices' to come home, a hop that then
      ends the backward; it pays where that call is the fused kernel (Hopper, where
      ``tiles.fused_backward`` takes it: q.k^T and dO.v^T once; 4-6% faster on 2 H200,
      BENCHMARKS.md), elsewhere the same kernels run back to back. False runs it in two halves,
      dQ first and dK/dV last, so that hop overlaps the last half. None: whole where the
      backend's backward fuses (``Backend.fuses_backward``).
  """

  halo: bool = True
  halo_max_share: float = 0.75
  gather_halos: bool = True
  forward_received: bool = True
  whole_local_pair: Optional[bool] = None

  def __post_init__(self):
    for name, rule in (("halo", False), ("gather_halos", False), ("forward_received", False),
                       ("whole_local_pair", True)):
      value = getattr(self, name)
      if not isinstance(value, bool) and not (rule and value is None):
        raise ValueError(f"RingVariants.{name}={value!r} is invalid: it must be a bool"
                         f"{' or None (the rule)' if rule else ''}. Pass True or False"
                         f"{' (or None)' if rule else ''}.")
    share = self.halo_max_share
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
      raise ValueError(f"RingVariants.halo_max_share={share!r} is invalid: it must be a number "
                       "in (0, 1] (the padded slice's share of the shard from which the whole "
                       "shard is sent). Pass e.g. 0.75.")


@dataclasses.dataclass(frozen=True)
class SequenceParallelConfig:
  """How attention is spread over a sequence-parallel mesh axis."""

  axis_name: str = "sp"  # mesh axis the sequence is sharded over (the ring)
  layout: str = "contiguous"  # token order: contiguous | zigzag | striped (see layouts)
  # ring: rotate K/V with ppermute; all_gather: gather K/V once; ulysses: all-to-all to heads
  # over axis_name; ulysses_ring: all-to-all over ulysses_axis, ring over axis_name; auto: ring,
  # all_gather or ulysses per call by pallas_ring.auto's cost model (mask reach, T, N, K, R)
  strategy: str = "ring"
  batch_axes: Optional[tuple[str, ...]] = ()  # mesh axes the batch is sharded over (None: none)
  head_axis: Optional[str] = None  # mesh axis the head dimension is sharded over (tensor par.)
  # ulysses_ring: the mesh axis of the all-to-all (inside a node); the sequence is sharded over
  # (axis_name, ulysses_axis): the layout over axis_name, each ring chunk split contiguously
  ulysses_axis: Optional[str] = None
  block_sizes: Optional[BlockSizes] = None  # kernel tiles; None = backend heuristic
  backend: str = "auto"  # auto | pallas_tpu | pallas_triton | xla
  scan_unroll: int = 1  # unroll factor of the ring scan
  ring_variants: Optional[RingVariants] = None  # the ring's schedule variants; None: defaults

  def __post_init__(self):
    name = "SequenceParallelConfig"
    if not isinstance(self.axis_name, str) or not self.axis_name:
      raise ValueError(f"{name}.axis_name={self.axis_name!r} is invalid: it must be a non-empty "
                       "string naming a mesh axis, e.g. 'sp'.")
    if self.layout not in LAYOUTS:
      raise ValueError(f"{name}.layout={self.layout!r} is invalid: use one of {LAYOUTS}.")
    if self.strategy not in STRATEGIES:
      raise ValueError(f"{name}.strategy={self.strategy!r} is invalid: use one of {STRATEGIES}.")
    if self.backend not in kernels.backend_names():
      raise ValueError(f"{name}.backend={self.backend!r} is invalid: use one of "
                       f"{kernels.backend_names()}.")
    batch_axes = () if self.batch_axes is None else self.batch_axes
    if isinstance(batch_axes, str):
      batch_axes = (batch_axes,)
    if not isinstance(batch_axes, (tuple, list)) or not all(isinstance(a, str) and a
                                                            for a in batch_axes):
      raise ValueError(f"{name}.batch_axes={self.batch_axes!r} is invalid: it must be a tuple of "
                       "mesh axis names, e.g. ('dp',), or None / () for no batch axes.")
    object.__setattr__(self, "batch_axes", tuple(batch_axes))
    for field in ("head_axis", "ulysses_axis"):
      axis = getattr(self, field)
      if axis is not None and (not isinstance(axis, str) or not axis):
        raise ValueError(f"{name}.{field}={axis!r} must be a mesh axis name (a non-empty "
                         "string) or None.")
    dup = sorted({a for a in self.batch_axes if self.batch_axes.count(a) > 1})
    if dup:
      raise ValueError(f"{name}.batch_axes={self.batch_axes!r} names {dup[0]!r} more than once; "
                       "each mesh axis may appear once. Remove the duplicate.")
    for field, axis in (("head_axis", self.head_axis), ("axis_name", self.axis_name)):
      if axis is not None and axis in self.batch_axes:
        raise ValueError(
            f"{name}.{field}={axis!r} is also in batch_axes={self.batch_axes!r}; each mesh axis "
            f"may shard only one dimension. Use different mesh axes for the batch and the "
            f"{'heads' if field == 'head_axis' else 'sequence'}.")
    if (self.strategy == "ulysses_ring") != (self.ulysses_axis is not None):
      raise ValueError(
          f"{name}.ulysses_axis={self.ulysses_axis!r} with strategy={self.strategy!r}: "
          "strategy='ulysses_ring' needs ulysses_axis (the mesh axis of its all-to-all, e.g. "
          "'ulysses'), and only it takes one. Set both, or neither (strategy='ulysses' runs its "
          "all-to-all over axis_name).")
    if self.ulysses_axis is not None and self.ulysses_axis in (
        self.axis_name, self.head_axis, *self.batch_axes):
      raise ValueError(f"{name}.ulysses_axis={self.ulysses_axis!r} is also the axis_name, "
                       "head_axis or a batch axis; each mesh axis may shard only one dimension.")
    if self.axis_name == self.head_axis:
      raise ValueError(f"{name}.axis_name={self.axis_name!r} is also the head_axis; each mesh axis "
                       "may shard only one dimension. Use a different mesh axis for the heads.")
    if isinstance(self.block_sizes, Mapping):
      object.__setattr__(self, "block_sizes", BlockSizes.from_dict(self.block_sizes))
    if self.block_sizes is not None and not isinstance(self.block_sizes, BlockSizes):
      raise ValueError(f"{name}.block_sizes={self.block_sizes!r} must be a BlockSizes, a mapping "
                       "of its fields, or None.")
    if isinstance(self.ring_variants, Mapping):
      check_keys(RingVariants, self.ring_variants)
      object.__setattr__(self, "ring_variants", RingVariants(**self.ring_variants))
    if self.ring_variants is not None and not isinstance(self.ring_variants, RingVariants):
      raise ValueError(f"{name}.ring_variants={self.ring_variants!r} must be a RingVariants, a "
                       "mapping of its fields, or None (the defaults).")
    if isinstance(self.scan_unroll, bool) or not isinstance(self.scan_unroll, int) or \
        self.scan_unroll < 1:
      raise ValueError(f"{name}.scan_unroll={self.scan_unroll!r} is invalid: it must be an int "
                       ">= 1 (1 = no unrolling).")

  @classmethod
  def from_dict(cls, data: Mapping[str, Any]) -> "SequenceParallelConfig":
    check_keys(cls, data)
    data = dict(data)
    if "batch_axes" in data and isinstance(data["batch_axes"], list):
      data["batch_axes"] = tuple(data["batch_axes"])
    return cls(**data)

  @classmethod
  def from_yaml(cls, path) -> "SequenceParallelConfig":
    """Reads a config from a YAML file (see ``configs/``); validates every field."""
    return load_preset(path).config

  @classmethod
  def preset(cls, name: str) -> "SequenceParallelConfig":
    """A shipped preset by name, e.g. ``"tpu_v5e_8"`` (see ``preset_names()``)."""
    return load_preset(name).config

  def replace(self, **kw) -> "SequenceParallelConfig":
    check_keys(type(self), kw)
    return dataclasses.replace(self, **kw)


@dataclasses.dataclass(frozen=True)
class Preset:
  """A YAML preset: the config, and the mesh and TPU topology it was written for."""

  config: SequenceParallelConfig  # the `sequence_parallel:` section
  mesh_shape: Optional[tuple[int, ...]] = None  # `mesh: {shape: [...]}`: devices per axis
  mesh_axes: Optional[tuple[str, ...]] = None  # `mesh: {axes: [...]}`: axis names
  topology: Optional[str] = None  # `topology:` TPU slice for `python -m pallas_ring compile`

  def make_mesh(self, devices=None):
    """The mesh this preset describes, over ``devices`` (default: all devices)."""
    import jax  # local import: reading a preset needs no JAX
    if self.mesh_shape is None:
      raise ValueError("this preset has no `mesh:` section; build the mesh with jax.make_mesh.")
    n = math.prod(self.mesh_shape)
    devices = jax.devices() if devices is None else list(devices)
    if len(devices) != n:
      raise ValueError(f"the preset's mesh {dict(zip(self.mesh_axes, self.mesh_shape))} needs {n} "
                       f"devices, {len(devices)} are given. Pass `devices=` of that many or use a "
                       "preset for this machine.")
    return jax.make_mesh(self.mesh_shape, self.mesh_axes, devices=devices)


def load_preset(name_or_path) -> Preset:
  """Reads a preset: a shipped name (``"tpu_v5e_8"``) or the path of a YAML file.

  The file holds ``sequence_parallel:`` (the config's fields) and optionally ``mesh: {shape:,
  axes:}`` and ``topology:``; a file of bare config fields is read as the config alone.
  """
  path = _preset_path(name_or_path)
  data = _load_yaml(path)
  if not isinstance(data, Mapping):
    raise ValueError(f"{path}: expected a mapping of sections {_SECTIONS}, got "
                     f"{type(data).__name__}.")
  fields = [f.name for f in dataclasses.fields(SequenceParallelConfig)]
  if not any(k in _SECTIONS for k in data):  # a bare config
    return Preset(SequenceParallelConfig.from_dict(data))
  for key in data:
    if key in fields:
      raise ValueError(f"{path}: {key!r} is a config field beside the sections "
                       f"{', '.join(_SECTIONS)}: move it under sequence_parallel:.")
    if key not in _SECTIONS:
      close = difflib.get_close_matches(str(key), _SECTIONS, n=1)
      hint = f" Did you mean {close[0]!r}?" if close else ""
      raise ValueError(f"{path}: unknown top-level section {key!r}.{hint} Sections are "
                       f"{', '.join(_SECTIONS)} (config fields go under sequence_parallel:).")
  mesh = data.get("mesh")
  if mesh is not None and not (
      isinstance(mesh, Mapping) and set(mesh) == {"shape", "axes"} and
      isinstance(mesh["shape"], list) and isinstance(mesh["axes"], list) and
      len(mesh["shape"]) == len(mesh["axes"]) > 0 and
      all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in mesh["shape"]) and
      all(isinstance(a, str) and a for a in mesh["axes"]) and
      len(set(mesh["axes"])) == len(mesh["axes"])):
    raise ValueError(f"{path}: `mesh` must be {{shape: [...], axes: [...]}}, lists of equal "
                     f"lengths of device counts >= 1 and distinct axis names, got {mesh!r}.")
  topology = data.get("topology")
  if topology is not None and not (isinstance(topology, str) and
                                   re.fullmatch(r"v\d+[a-z]*:\d+(x\d+)*", topology)):
    raise ValueError(f"{path}: `topology` must be a TPU topology such as 'v5e:2x4', got "
                     f"{topology!r}.")
  section = data.get("sequence_parallel")
  config = SequenceParallelConfig.from_dict({} if section is None else section)
  if mesh:
    named = (config.axis_name, config.head_axis, config.ulysses_axis, *config.batch_axes)
    missing = [a for a in named if a is not None and a not in mesh["axes"]]
    if missing:
      raise ValueError(f"{path}: sequence_parallel names mesh axes {missing} that the preset's "
                       f"mesh (axes {mesh['axes']}) lacks; add them to `mesh:` or rename them.")
  return Preset(config, tuple(mesh["shape"]) if mesh else None,
                tuple(mesh["axes"]) if mesh else None, topology)


__all__ = ["BlockSizes", "RingVariants", "SequenceParallelConfig", "Preset", "load_preset",
           "preset_names", "STRATEGIES"]
