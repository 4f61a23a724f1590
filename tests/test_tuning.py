"""The tile cache and ``python -m pallas_ring tune``: written, re-read, used, and robust."""

import dataclasses
import json
import multiprocessing
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_ring import BlockSizes, flash_attention, kernels, masks, reference, tuning_cache_path
from pallas_ring.kernels import tile_cache, tuning
from conftest import rel_err


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
  monkeypatch.setenv(tile_cache.CACHE_ENV, str(tmp_path))
  tile_cache._WARNED.clear()
  return tmp_path


def _key(pass_, length=64, mask_cls="causal"):
  return tile_cache.key("cpu", "xla", jnp.float32, 32, 1, mask_cls, length, pass_)


def test_cache_path_follows_the_environment(cache_dir):
  assert tuning_cache_path() == str(cache_dir / "tiles.json")


@pytest.mark.ci
def test_tune_writes_the_cache_and_flash_attention_uses_it(cache_dir, capsys):
  from pallas_ring import cli
  with pytest.raises(SystemExit) as e:
    cli.main(["tune", "--backend", "xla", "--seq-len", "64", "--heads", "2", "--head-dim", "32",
              "--dtype", "float32", "--iters", "1", "--reps", "1"])
  assert e.value.code == 0
  out = capsys.readouterr().out
  assert "candidates valid" in out and "tile cache:" in out
  entries = json.loads((cache_dir / "tiles.json").read_text())["entries"]
  fwd, bwd = entries[_key("fwd")], entries[_key("bwd")]
  tiles = tuning.resolve("xla", None, 64, 64, 32, dtype=jnp.float32, mask_class="causal")
  assert (tiles.source_fwd, tiles.source_bwd) == ("cache", "cache")
  assert min(fwd["block_q"], 64) == tiles.block_q and min(bwd["block_kv_bwd"], 64) == \
      tiles.block_kv_bwd
  # A user's explicit tiles still win; another shape class falls back to the heuristic.
  tiles = tuning.resolve("xla", BlockSizes(16, 16, 16, 16), 64, 64, 32, dtype=jnp.float32,
                         mask_class="causal")
  assert (tiles.block_q, tiles.source_fwd) == (16, "user")
  assert tuning.resolve("xla", None, 64, 64, 32, dtype=jnp.float32,
                        mask_class="full").source_fwd == "heuristic"
  # ... and so does a narrower v (MLA): the entry was measured with v as wide as q.
  assert tuning.resolve("xla", None, 64, 64, 32, dtype=jnp.float32, mask_class="causal",
                        value_dim=16).source_fwd == "heuristic"
  assert tuning.resolve("xla", None, 64, 64, 32, dtype=jnp.float32, mask_class="causal",
                        value_dim=32).source_fwd == "cache"
  q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 64, 2, 32)), jnp.float32)
  out = flash_attention(q, q, q, mask=masks.Causal(), backend="xla")
  assert rel_err(out, reference.attention(q, q, q, mask=masks.Causal())[0]) < 1e-5


def test_corrupt_cache_is_reported_once_and_ignored(cache_dir):
  (cache_dir / "tiles.json").write_text("{not json")
  with pytest.warns(UserWarning, match="ignoring the tile cache.*not a valid cache file"):
    tiles = tuning.resolve("xla", None, 64, 64, 32, dtype=jnp.float32, mask_class="causal")
  assert tiles.source_fwd == "heuristic"
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    tuning.resolve("xla", None, 64, 64, 32, dtype=jnp.float32, mask_class="causal")


def test_stale_entry_is_reported_and_ignored(cache_dir):
  k = tile_cache.key("cpu", "pallas_tpu", jnp.float32, 32, 1, "causal", 256, "fwd")
  tile_cache.store({k: {"block_q": 8, "block_kv": 100}})  # 100: not a TPU key tile
  with pytest.warns(UserWarning, match="ignoring the cache entry.*multiples of 128"):
    out = tuning._tuned(kernels.get("pallas_tpu"), BlockSizes(), "cpu",
                        dict(dtype=jnp.float32, head_dim=32, group=1, mask_cls="causal",
                             length=256))
  assert out[1] == "heuristic"


def _store_one(args):
  path, i = args
  tile_cache.store({f"k{i}": {"block_q": 16 * (i + 1)}}, path)


def test_concurrent_writers_keep_every_entry(tmp_path):
  path = str(tmp_path / "tiles.json")
  with multiprocessing.get_context("spawn").Pool(4) as pool:
    pool.map(_store_one, [(path, i) for i in range(8)])
  entries = tile_cache.load(path)
  assert sorted(entries) == sorted(f"k{i}" for i in range(8))


def test_mask_classes():
  assert tile_cache.mask_class(masks.Causal(), False) == "causal"
  assert tile_cache.mask_class(masks.Causal() & masks.SlidingWindow(8), False) == "window"
  assert tile_cache.mask_class(masks.Full(), False) == "full"
  assert tile_cache.mask_class(masks.Causal(), True) == "docs"
  assert tile_cache.mask_class(masks.PrefixLM(3), False) == "other"


def test_a_backends_variants_apply_where_it_runs_and_nowhere_else(monkeypatch):
  """A backend's variants (the README's switch, ``BlockSizes(variants=pallas_mosaic_gpu.Variants(
  deterministic=...))``) with ``backend="auto"``: other platforms' backends run without it (it
  raised ``AssertionError: no registered backend serves the call`` on every host); the Mosaic
  GPU kernels get it where ``auto`` picks them."""
  from pallas_ring.kernels import pallas_mosaic_gpu
  variants = pallas_mosaic_gpu.Variants(deterministic=False)
  bs = BlockSizes(variants=variants)
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((1, 32, 2, 16)), jnp.bfloat16)
  out = flash_attention(q, q, q, mask=masks.Causal(), block_sizes=bs)  # CPU: xla, no variants
  np.testing.assert_array_equal(out, flash_attention(q, q, q, mask=masks.Causal()))
  # On a Hopper GPU (faked here), auto lowers the GPU variant through Mosaic GPU, with them.
  monkeypatch.setattr(pallas_mosaic_gpu, "hopper", lambda: True)
  per_platform = kernels.variants("auto", None, kernels.Call(jnp.bfloat16, 64, block_sizes=bs))
  assert per_platform["cuda"][0] == "pallas_mosaic_gpu"
  assert per_platform["cpu"][0] == "xla" and per_platform["tpu"][0] == "pallas_tpu"
  for platform, (backend, _) in per_platform.items():
    got = tuning.resolve(backend, bs, 256, 256, 64).variants
    assert (got is variants) == (backend == "pallas_mosaic_gpu"), (platform, got)


@dataclasses.dataclass(frozen=True)
class _NotAVariant:
  deterministic: bool = False


def test_variants_of_no_backend_or_of_another_named_backend_raise_with_the_fix():
  from pallas_ring.kernels import pallas_mosaic_gpu
  q = jnp.ones((1, 16, 2, 16), jnp.float32)
  with pytest.raises(ValueError, match=r"block_sizes.variants=.* is not the kernel-variant "
                     r"config of any backend .*pallas_mosaic_gpu\.Variants\(deterministic"):
    flash_attention(q, q, q, block_sizes=BlockSizes(variants=_NotAVariant()))
  with pytest.raises(ValueError, match=r"variants=.* cannot be used by backend 'xla'"):
    flash_attention(q, q, q, backend="xla",
                    block_sizes=BlockSizes(variants=pallas_mosaic_gpu.Variants()))


def test_tune_interprets_a_backend_this_device_cannot_run(cache_dir, capsys):
  """``tune --backend pallas_tpu`` on CPU times the kernels in interpret mode, as
  ``flash_attention(interpret=None)`` runs them, and says so (every candidate failed before)."""
  from pallas_ring import cli
  with pytest.raises(SystemExit) as e:
    cli.main(["tune", "--backend", "pallas_tpu", "--seq-len", "128", "--heads", "1",
              "--head-dim", "128", "--dtype", "float32", "--passes", "fwd", "--iters", "1",
              "--reps", "1"])
  out = capsys.readouterr().out
  assert e.value.code == 0, out
  assert "timing them in interpret mode" in out and "candidates valid" in out
