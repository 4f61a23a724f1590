"""Persistent tile cache: the winners of ``python -m pallas_ring tune``, and the shipped table.

``block_sizes=None`` resolves, per pass, from (1) the user's cache at ``tuning_cache_path()``,
(2) the table shipped with the package for devices we measured (``tiles_shipped.json``), (3) the
heuristic in ``tuning``. Entries are keyed by the shape class of a call::

    device kind | backend | dtype | head dim | GQA group | mask class | length bucket | pass

The cache file is JSON, written atomically (a temporary file renamed into place) under an
exclusive lock, merged with what other processes wrote meanwhile. A corrupt file or an entry a
backend cannot use is reported once (a warning) and ignored, never fatal.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from typing import Any, Mapping, Optional

from pallas_ring import masks as masks_lib
from pallas_ring import validation
from pallas_ring.kernels.backend import next_pow2  # (lengths within 2x share tiles)

CACHE_ENV = "PALLAS_RING_CACHE_DIR"
SHIPPED = os.path.join(os.path.dirname(__file__), "tiles_shipped.json")
# Fields each pass's entry sets.
PASS_FIELDS = {"fwd": ("block_q", "block_kv", "num_warps", "num_stages"),
               "bwd": ("block_q_bwd", "block_kv_bwd")}
_WARNED: set = set()


def tuning_cache_path() -> str:
  """The tile cache file: ``$PALLAS_RING_CACHE_DIR/tiles.json``, default
  ``~/.cache/pallas_ring/tiles.json``."""
  root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache",
                                                   "pallas_ring")
  return os.path.join(root, "tiles.json")


def mask_class(mask: masks_lib.MaskSpec, has_segments: bool) -> str:
  """The mask class of a call for cache keys: docs, full, causal, window or other."""
  if has_segments:
    return "docs"
  parts = [mask.a, mask.b] if isinstance(mask, masks_lib.And) else [mask]
  kinds = {type(p) for p in parts}
  if masks_lib.SlidingWindow in kinds and kinds <= {masks_lib.SlidingWindow, masks_lib.Causal}:
    return "window"
  if kinds == {masks_lib.Causal}:
    return "causal"
  return "full" if masks_lib.is_full(mask) else "other"


def key(device_kind: str, backend: str, dtype, head_dim: int, group: int, mask_cls: str,
        length: int, pass_: str, value_dim: Optional[int] = None) -> str:
  """A shape class's entry key; v's head dim is part of it only where it differs from q's
  (MLA: ``tune`` measures equal ones, so such calls take the heuristic, which knows it)."""
  import numpy as np  # local: keep this module light
  head = f"h{head_dim}" if value_dim in (None, head_dim) else f"h{head_dim}v{value_dim}"
  return "|".join([device_kind, backend, np.dtype(dtype).name, head, f"g{group}", mask_cls,
                   f"L{next_pow2(length)}", pass_])


def _warn_once(what: str, message: str) -> None:
  if what not in _WARNED:
    _WARNED.add(what)
    validation.warn(message)


_LOADED: dict = {}  # path -> (mtime, entries)


def load(path: str) -> Mapping[str, Mapping[str, Any]]:
  """The entries of a cache / table file ({} when absent; a corrupt file warns and reads {})."""
  try:
    mtime = os.path.getmtime(path)
  except OSError:
    return {}
  if path in _LOADED and _LOADED[path][0] == mtime:
    return _LOADED[path][1]
  try:
    with open(path) as f:
      data = json.load(f)
    entries = data["entries"]
    if not isinstance(entries, dict) or not all(isinstance(v, dict) for v in entries.values()):
      raise ValueError("`entries` must map keys to objects")
  except (OSError, ValueError, KeyError, TypeError) as e:
    _warn_once(path, f"pallas_ring: ignoring the tile cache {path}: it is not a valid cache file "
                     f"({type(e).__name__}: {e}). Delete it or run `python -m pallas_ring tune` "
                     "to write a new one; heuristic tiles are used meanwhile.")
    entries = {}
  _LOADED[path] = (mtime, entries)
  return entries


def lookup(cache_key: str) -> tuple[Optional[Mapping[str, Any]], str]:
  """``(entry, source)`` for a key: from the user's cache, else the shipped table."""
  for path, source in ((tuning_cache_path(), "cache"), (SHIPPED, "table")):
    entry = load(path).get(cache_key)
    if entry is not None:
      return entry, source
  return None, "heuristic"


def reject(cache_key: str, source: str, reason: str) -> None:
  """Reports once that an entry was ignored (e.g. a tile a backend cannot use)."""
  _warn_once(f"{source}:{cache_key}",
             f"pallas_ring: ignoring the {source} entry {cache_key!r}: {reason}. Re-run "
             "`python -m pallas_ring tune` for this shape; heuristic tiles are used meanwhile.")


@contextlib.contextmanager
def _locked(path: str):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path + ".lock", "a+") as lock:
    try:
      import fcntl
      fcntl.flock(lock, fcntl.LOCK_EX)
    except ImportError:  # pragma: no cover - no fcntl (Windows): last writer wins
      pass
    yield


def store(new_entries: Mapping[str, Mapping[str, Any]], path: Optional[str] = None) -> str:
  """Merges entries into the cache file atomically (safe with several processes)."""
  path = path or tuning_cache_path()
  with _locked(path):
    entries = dict(load(path))
    entries.update({k: dict(v) for k, v in new_entries.items()})
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tiles.", suffix=".json")
    with os.fdopen(fd, "w") as f:
      json.dump({"version": 1, "entries": entries}, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
  _LOADED.pop(path, None)
  return path
