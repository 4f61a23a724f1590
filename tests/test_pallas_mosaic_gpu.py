"""The Mosaic GPU (Hopper) backend on a CPU machine: every shipped kernel configuration lowers for
CUDA, ``"auto"`` picks it exactly where it serves the call, and refusals name the reason.

Natively (PALLAS_RING_TEST_GPU=1 on an H100) the native tests below and the conformance suite
(``TestPallasMosaicGpu``) run it; ``tools/gpu_regression.sh tests`` runs both.
"""

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_ring import BlockSizes, flash_attention, kernels, masks, reference
from pallas_ring.kernels import pallas_mosaic_gpu
from pallas_ring.kernels.pallas_mosaic_gpu import (
    Variants, fwd_kernel, fwd_scheduler, pipeline, tiles)
from conftest import (ON_GPU, check_ring_step, fused_backward, jaxpr_eqns, kernel_call_sites,
                      rel_err, ring_step)
from conformance import Conformance

MOSAIC = "@mosaic_gpu"  # the custom call of a Mosaic GPU kernel in lowered StableHLO
TRITON = "__gpu$xla.gpu.triton"
REDUCE_ADD = "cp.reduce.async.bulk.tensor"  # a TMA reduce-add (the fused backward's dQ)

CASES = {  # name: (mask, T, S, N, K, H, dtype, segments, softcap)
    "causal_gqa": (masks.Causal(), 512, 512, 4, 2, 128, jnp.bfloat16, False, None),
    "full_odd_lengths": (masks.Full(), 300, 200, 4, 4, 128, jnp.bfloat16, False, None),
    "window_mqa": (masks.Causal() & masks.SlidingWindow(100), 384, 384, 4, 1, 128, jnp.bfloat16,
                   False, None),
    "chunked": (masks.ChunkedCausal(128), 256, 256, 2, 2, 128, jnp.bfloat16, False, None),
    "prefix_lm": (masks.PrefixLM(50), 256, 256, 2, 2, 128, jnp.float16, False, None),
    "documents": (masks.Causal(), 256, 256, 2, 2, 128, jnp.bfloat16, True, None),
    "softcap_h64": (masks.Causal(), 256, 256, 2, 2, 64, jnp.bfloat16, False, 30.0),
    "h256": (masks.Causal(), 256, 256, 2, 1, 256, jnp.bfloat16, False, None),
    # the wide backward kernels (head dims above 128): masked tiles, GQA, soft-cap, padding
    "h256_documents_gqa_softcap": (masks.Causal(), 384, 384, 4, 2, 256, jnp.bfloat16, True, 30.0),
    "h192_fp16": (masks.Full(), 200, 150, 2, 2, 192, jnp.float16, False, None),
    "h96_padded_fp16": (masks.Full(), 130, 130, 2, 2, 96, jnp.float16, True, None),
    "one_token": (masks.Causal(), 1, 1, 2, 2, 128, jnp.bfloat16, False, None),
    # DeepSeek-style MLA: q/k head dim 192, v head dim 128 (HV)
    "mla_192_128_documents": (masks.Causal(), 384, 384, 4, 4, 192, jnp.bfloat16, True, None),
    # a narrower v at head dims <= 128 (one owned K/V pair per dK/dV consumer, the fused variant)
    "hv64_documents_fp16": (masks.Causal(), 256, 256, 4, 2, 128, jnp.float16, True, None),
}
HV = {"mla_192_128_documents": 128, "hv64_documents_fp16": 64}  # v's head dim where not H


def _structs(name):
  mask, t, s, n, kh, h, dt, segs, cap = CASES[name]
  sd = jax.ShapeDtypeStruct
  args = (sd((2, t, n, h), dt), sd((2, s, kh, h), dt), sd((2, s, kh, HV.get(name, h)), dt))
  seg = (sd((2, t), jnp.int32), sd((2, s), jnp.int32)) if segs else (None, None)
  return args, seg, dict(mask=mask, softcap=cap)


def _attention(kw, **variants):
  """``f(q, k, v, *segment_ids)``: flash_attention on the Mosaic GPU kernels with options ``kw``
  and kernel ``variants`` (``pallas_mosaic_gpu.Variants`` fields)."""
  bs = BlockSizes(variants=Variants(**variants))

  def f(q, k, v, *seg):
    extra = dict(segment_ids=seg[0], kv_segment_ids=seg[1]) if seg else {}
    return flash_attention(q, k, v, backend="pallas_mosaic_gpu", interpret=False, block_sizes=bs,
                           **extra, **kw)

  return f


def _grad(f):
  """Gradients of ``sum(f(q, k, v, ...))`` (float32) with respect to q, k and v."""
  return jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1, 2))


def _lower(fn, *args):
  return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _kernels_of_gradients(text, fused):
  """The forward and the backward's kernels, all Mosaic GPU: the fused one that reduce-adds dQ
  (``fused``), else dK/dV and dQ."""
  return (text.count(MOSAIC) == (2 if fused else 3) and (REDUCE_ADD in text) == fused and
          TRITON not in text)


def _fused(name, **variants) -> bool:
  """Whether case ``name``'s gradients run the fused backward with ``variants``."""
  return fused_backward(CASES[name], "pallas_mosaic_gpu", False, Variants(**variants))


def _backward_modes(name) -> dict:
  """``{Variants.deterministic: fused}`` of the backward's modes that case ``name`` has: the
  reproducible pair, and at head dims <= 128 the fused kernel."""
  return {True: False, **({False: True} if _fused(name, deterministic=False) else {})}


def _step_kernels(name, **variants) -> int:
  """Mosaic GPU kernels of ``ring_step``: two forwards, then the fused backward or dQ and
  dK/dV."""
  return 3 if _fused(name, **variants) else 4


@pytest.mark.ci_cases("causal_gqa", "full_odd_lengths", "window_mqa", "chunked", "prefix_lm",
                      "documents")
@pytest.mark.parametrize("name", list(CASES))
def test_every_configuration_lowers_for_cuda(name):
  """Forward: one Mosaic GPU kernel; gradients: it plus the backward's (by default the fused
  kernel at head dims <= 128 without segment ids, else dQ and dK/dV)."""
  args, (qs, ks), kw = _structs(name)
  f = _attention(kw)
  seg_args = (qs, ks) if qs is not None else ()
  text = _lower(f, *args, *seg_args)
  assert text.count(MOSAIC) == 1 and TRITON not in text
  # the consumers' schedule: hardware barriers of both consumer warpgroups' 256 threads
  assert "bar.arrive $0, 256;" in text and "bar.sync $0, 256;" in text
  grad = _grad(f)
  text = _lower(grad, *args, *seg_args)
  assert _kernels_of_gradients(text, _fused(name))


def test_head_dims_pad_to_a_multiple_of_64_only():
  """H=192 runs 192-wide kernels, not 256-wide ones; MLA's v (and o, dO, dV) stays 128 wide in
  every kernel, not zero-padded to 192."""
  assert [tiles.padded_head_dim(h) for h in (32, 64, 96, 128, 160, 192, 200, 256)] == [
      64, 64, 128, 128, 192, 192, 256, 256]
  call = lambda h: kernels.backend.Call(dtype=jnp.bfloat16, head_dim=h)
  assert tiles.unsupported(call(192)) is None and "320" in tiles.unsupported(call(320))
  assert [pallas_mosaic_gpu.BACKEND.padded_value_dim(hv, 192) for hv in (32, 100, 128, 256)] == [
      64, 128, 128, 192]
  for hv in (96, 256):  # (a direct kernel call with v that is not padded)
    with pytest.raises(ValueError, match=f"v of head dim {hv}.*multiple of 64 and at most 192"):
      tiles.check_value_dim(hv, 192)
  args, (qs, ks), kw = _structs("mla_192_128_documents")
  f = _attention(kw)
  grad = _grad(f)
  for fn, outs in ((f, "(tensor<2x384x4x128xbf16>, tensor<2x4x384xf32>)"),
                   (grad, "(tensor<2x384x4x192xbf16>, tensor<2x384x4x128xbf16>)")):
    text = _lower(fn, *args, qs, ks)
    assert "x192xbf16" in text and "x256xbf16" not in text and "stablehlo.pad" not in text
    kernel = [line for line in text.splitlines() if MOSAIC in line][-1]  # (dK/dV last)
    assert "tensor<2x384x4x128xbf16>" in kernel and kernel.endswith(outs)


def test_forward_key_tiles_are_the_widest_that_fit():
  """The default key tile is the widest of 256, 128, 64 whose two K/V slots fit beside the q
  tiles: MLA's narrower v makes room for 128 keys at q/k head dim 192, which its output stages
  through the q tiles (no tile of its own)."""
  rule = lambda h, hv, dt: pallas_mosaic_gpu.BACKEND.default_block_sizes(
      h, "H100", dt, value_dim=hv).block_kv
  bf16, f8 = jnp.bfloat16, jnp.float8_e4m3fn
  assert [rule(h, hv, bf16) for h, hv in ((64, 64), (128, 128), (128, 64), (192, 192),
                                          (192, 128), (256, 128))] == [256, 128, 128, 64, 128, 64]
  assert [rule(h, hv, f8) for h, hv in ((128, 128), (192, 192), (192, 128), (256, 256))] == [
      256, 128, 256, 64]
  assert rule(192, None, bf16) == 64  # (v as wide as q)


@pytest.mark.ci_cases(every=True)
@pytest.mark.parametrize("h, hv", [(128, 128), (128, 64), (192, 192), (192, 128), (192, 64),
                                   (256, 256), (256, 128)])
def test_backward_geometry_fits_shared_memory_and_registers(h, hv):
  """Every served (H, Hv) pair gets backward tiles that fit: at least two slots beside the owned
  tiles; dQ owns 128 rows (two consumers) up to H=192, with 64-key tiles above H=128 (its
  float32 dQ beside s and dp); dK/dV is wide above 128."""
  from pallas_ring.kernels.pallas_mosaic_gpu import bwd_kernels, terms
  c = bwd_kernels._Call(heads=4, kv_heads=2, head_dim=h, value_dim=hv,
                        dtype=jnp.dtype("bfloat16"), out_dtype=jnp.dtype("float32"), info_rows=2,
                        terms=terms.Terms(), term_dtype=jnp.bfloat16, variants=Variants())
  dq, dkv = (bwd_kernels._geometry(c, dkv, 1024, heads) for dkv, heads in ((False, 1), (True, 2)))
  assert dq.slots >= 2 and dkv.slots >= 2 and (dq.value_dim, dkv.value_dim) == (hv, hv)
  assert dq.owners == (1 if h > 192 else 2) and (dq.walk == 64) == (h > 128)
  assert dkv.wide == (h > 128)


def _terms(name, rate=0.1, bias=False, dense=False, seed=3):
  """The score terms of ``terms`` for a case: ALiBi slopes for its heads, dropout at ``rate``,
  and (random, seeded) a per-head bias (float32, or ``bias``'s dtype where it is one) and a
  dense mask broadcast over the batch."""
  _, t, s, n = CASES[name][:4]
  rng = np.random.default_rng(seed)
  kw = dict(alibi_slopes=np.linspace(0.05, 0.5, n, dtype=np.float32), dropout_rate=rate,
            dropout_rng=jax.random.key(seed))
  if bias:
    kw["bias"] = jnp.asarray(rng.standard_normal((1, n, t, s)),
                             np.float32 if bias is True else bias)
  if dense:
    kw["dense_mask"] = rng.random((1, 1, t, s)) < 0.7
  return kw


STAGED = "copy_tile_term.<locals>.copy"  # (a source name in a forward kernel staging its term)


@pytest.mark.ci_cases("False-False-causal_gqa", "True-True-softcap_h64")
@pytest.mark.parametrize("name", ["causal_gqa", "h256_documents_gqa_softcap", "softcap_h64",
                                  "full_odd_lengths", "h192_fp16"])
@pytest.mark.parametrize("bias, dense", [(False, False), (True, True), (False, True),
                                         (jnp.bfloat16, False)])
def test_score_terms_lower_for_cuda(name, bias, dense):
  """ALiBi, dropout, a bias and a dense mask stay on the Mosaic GPU kernels (the wide backward
  too): one forward kernel, with gradients the backward's in each mode, no Triton. A 16-bit
  term (a dense mask alone, a bfloat16 bias) is staged through shared memory, a float32 one is
  not."""
  args, (qs, ks), kw = _structs(name)
  seg = (qs, ks) if qs is not None else ()
  kw = {**kw, **_terms(name, bias=bias, dense=dense)}
  text = _lower(_attention(kw), *args, *seg)
  assert text.count(MOSAIC) == 1 and TRITON not in text
  assert (STAGED in text) == (bias is jnp.bfloat16 or (dense and not bias))
  for deterministic, fused in _backward_modes(name).items():
    grad = _grad(_attention(kw, deterministic=deterministic))
    assert _kernels_of_gradients(_lower(grad, *args, *seg), fused)


@pytest.mark.parametrize("name, splits", [("window_mqa", 4), ("causal_gqa", 2),
                                         ("h256_documents_gqa_softcap", 2)])
def test_dkv_kernel_split_over_query_heads_lowers(name, splits):
  """Few kv heads: each kv block's query heads split over CTAs writing float32 partials (the
  wide and the fused kernel too), the same Mosaic GPU kernels and no Triton."""
  args, (qs, ks), kw = _structs(name)
  seg = (qs, ks) if qs is not None else ()
  for deterministic, fused in _backward_modes(name).items():
    f = _attention(kw, dkv_head_splits=splits, deterministic=deterministic)
    text = _lower(_grad(f), *args, *seg)
    assert _kernels_of_gradients(text, fused)
    assert f"tensor<{splits}x2x" in text  # (the partials' leading axis)


def test_dkv_head_splits_rule_fills_the_gpu_with_few_kv_heads():
  v = Variants()
  waves = v.dkv_min_waves * tiles.sm_count()
  assert tiles.dkv_head_splits(16, waves, v) == 1  # enough CTAs: no split
  assert tiles.dkv_head_splits(1, 8, v) == 1  # MHA: nothing to split
  assert tiles.dkv_head_splits(16, 128, v) == v.dkv_max_splits  # MQA 16/1 at T=16k: 128 CTAs
  assert tiles.dkv_head_splits(2, 128, v) == 2  # (a divisor of the group)
  assert tiles.dkv_head_splits(6, 128, Variants(dkv_max_splits=4)) == 3
  assert tiles.dkv_head_splits(4, 1, Variants(dkv_head_splits=2)) == 2
  with pytest.raises(ValueError, match="dkv_head_splits=3 does not divide the 4 query heads"):
    tiles.dkv_head_splits(4, 1, Variants(dkv_head_splits=3))
  with pytest.raises(ValueError, match="dkv_head_splits=0 is invalid"):
    Variants(dkv_head_splits=0)


def test_register_split_is_a_checked_variant():
  """The setmaxnreg split is ``Variants(consumer_regs, producer_regs)``: it reaches every kernel's
  lowering (the PTX asks for it), and one that cannot fit the register file is refused. The dQ
  kernel's lone consumer above head dim 192 takes ``lone_consumer_regs`` instead (no other
  kernel has a lone consumer)."""
  grad = lambda v: _grad(functools.partial(
      flash_attention, mask=masks.Causal(), backend="pallas_mosaic_gpu", interpret=False,
      block_sizes=BlockSizes(variants=v)))

  def text(v, h=128):
    sd = jax.ShapeDtypeStruct((1, 256, 2, h), jnp.bfloat16)
    return jax.jit(grad(v)).trace(sd, sd, sd).lower(lowering_platforms=("cuda",)).as_text()

  assert text(Variants()) != text(Variants(consumer_regs=224, producer_regs=56))
  assert text(Variants()) == text(Variants(lone_consumer_regs=232))
  assert text(Variants(), 256) != text(Variants(lone_consumer_regs=232), 256)
  with pytest.raises(ValueError, match=r"consumer_regs=240, producer_regs=40\) is invalid"):
    Variants(consumer_regs=240)
  with pytest.raises(ValueError, match="multiple of 8"):
    Variants(producer_regs=20)
  with pytest.raises(ValueError, match=r"lone_consumer_regs=260\) is invalid"):
    Variants(lone_consumer_regs=260)


@pytest.mark.parametrize("name", ["documents", "h256_documents_gqa_softcap"])
def test_lowers_under_x64(name):
  """x64 mode (64-bit Python ints) changes no integer dtype inside the kernels (H=256: the wide
  backward kernels; H=128: also the fused one), also where they merge into the ring's running
  results."""
  args, (qs, _), kw = _structs(name)
  f = lambda q, k, v, s: flash_attention(q, k, v, segment_ids=s, backend="pallas_mosaic_gpu",
                                         interpret=False, **kw)
  grad = _grad(f)
  with jax.enable_x64(True):
    assert _lower(f, *args, qs).count(MOSAIC) == 1
    assert _kernels_of_gradients(_lower(grad, *args, qs), _fused(name))
    for deterministic, fused in _backward_modes(name).items():  # (H=128: fused, dQ split)
      if fused != _fused(name):  # (the mode the default did not run)
        other = _grad(_attention(kw, deterministic=deterministic))
        assert _kernels_of_gradients(_lower(other, *args, qs, qs), fused)
    step, _, step_args = ring_step(CASES[name], "pallas_mosaic_gpu", interpret=False)
    # merging into the ring's results
    assert _lower(step, *step_args).count(MOSAIC) == _step_kernels(name)


@pytest.mark.parametrize("name", list(CASES))
def test_lowers_with_warpgroup_semantics(name, monkeypatch):
  """JAX 0.11 lowers Mosaic GPU kernels with warpgroup semantics by default (0.10: lane), and
  there a kernel value that is a Python constant can fail ("Shaped arrays must be represented
  by ir.Values, got: TypedInt(0)"). Lowering every configuration with those semantics on 0.10
  catches some of these without a GPU: a constant plan index closed over by ``pl.run_state``
  fails here as on 0.11.2; a static shared-memory slot index inside a loop, which 0.11.2 also
  rejects, lowers here either way. The kernels that merge into the ring's running results
  lower too."""
  import jax.experimental.pallas.mosaic_gpu as plgpu
  from jax.experimental.mosaic import gpu as mgpu
  monkeypatch.setattr(plgpu, "CompilerParams", functools.partial(
      plgpu.CompilerParams, lowering_semantics=mgpu.LoweringSemantics.Warpgroup))
  args, (qs, ks), kw = _structs(name)
  seg = (qs, ks) if qs is not None else ()
  modes = {fused: _grad(_attention(kw, deterministic=deterministic))
           for deterministic, fused in _backward_modes(name).items()}
  step, _, step_args = ring_step(CASES[name], "pallas_mosaic_gpu", interpret=False)
  jax.clear_caches()  # (kernels traced with lane semantics by earlier tests)
  try:
    for fused, grad in modes.items():
      assert _kernels_of_gradients(_lower(grad, *args, *seg), fused)
    # merging into the ring's results
    assert _lower(step, *step_args).count(MOSAIC) == _step_kernels(name)
  finally:
    jax.clear_caches()


def test_forward_overlaps_where_its_registers_fit():
  """FlashAttention-3's intra-warpgroup overlap holds a second p tile and the logits beside the
  output accumulator; documents keep the serial walk (short rows)."""
  fits = lambda *a: tiles.overlaps(*a, Variants())
  assert fits(128, 128, False) and fits(64, 256, False) and fits(128, 64, False)
  assert not fits(256, 64, False)  # head dim 64 walks 256-key tiles
  assert not fits(128, 128, True)
  assert not tiles.overlaps(128, 128, False, Variants(overlap_pv=False))


@pytest.mark.parametrize("name, overlap", [("causal_gqa", False), ("documents", True),
                                           ("full_odd_lengths", True), ("one_token", True)])
def test_both_forward_walks_lower(name, overlap):
  """The walk ``overlaps`` does not pick lowers too, and only the overlapped one keeps its p.v
  operand live past the wgmma wait (without that, ptxas serializes every wgmma: C7513)."""
  args, (qs, ks), kw = _structs(name)
  seg = (qs, ks) if qs is not None else ()
  text = _lower(_attention(kw, overlap_pv=overlap), *args, *seg)
  assert text.count(MOSAIC) == 1
  assert (pipeline.KEEP_ALIVE in text) == overlap


def test_forward_is_persistent_for_narrow_sliding_windows(monkeypatch):
  """Rows of a sliding window are short and alike: one CTA per SM walks several of them; other
  masks, and the serial walk, launch one CTA per item."""
  sms = tiles.sm_count()
  assert sms == 132 or ON_GPU  # (an H100's, when there is no GPU to ask)
  ctas = lambda *a, **v: tiles.persistent_ctas(*a, Variants(**v))
  width = Variants().persistent_window
  window = masks.Causal() & masks.SlidingWindow(width)
  assert ctas(2048, window, True) == sms and ctas(100, window, True) == 100
  assert ctas(2048, window, False) == 2048  # the serial walk (segment ids)
  assert ctas(2048, masks.SlidingWindow(width, 1), True) == 2048
  for mask in (masks.Causal(), masks.Full(), masks.ChunkedCausal(1024)):
    assert ctas(2048, mask, True) == 2048
  assert ctas(2048, masks.Causal(), True, persistent=7) == 7
  assert ctas(5, masks.Causal(), True, persistent=7) == 5
  assert ctas(2048, window, True, persistent=False) == 2048

  grids = []  # the forward's launch, as the kernel call sees it
  kernel = fwd_kernel.plgpu.kernel
  monkeypatch.setattr(fwd_kernel.plgpu, "kernel",
                      lambda *a, grid, **kw: grids.append(grid) or kernel(*a, grid=grid, **kw))
  x = jax.ShapeDtypeStruct((1, 2048, 16, 128), jnp.bfloat16)  # 16 q blocks x 16 heads
  for mask in (masks.Causal() & masks.SlidingWindow(1024), masks.Causal()):
    jax.clear_caches()  # (the kernel call above is patched while tracing)
    _lower(_attention(dict(mask=mask)), x, x, x)
  jax.clear_caches()
  assert grids == [(min(sms, 256),), (256,)]


def test_work_items_cover_every_q_block_once_in_either_order():
  """``work_item`` maps the items onto every (batch, head, q block) once: heads fastest, or (long
  K/V, ``item_order``) q blocks fastest; either way each head's q blocks from the last."""
  g = fwd_scheduler.FwdGeometry(bq=64, bk=128, slots=2, group=1, head_dim=128, value_dim=128,
                                dtype=jnp.bfloat16, out_dtype=jnp.bfloat16, info_rows=1,
                                q_blocks=5, heads=3, batch=2,
                                ctas=30)
  every = {(b, h, q) for b in range(2) for h in range(3) for q in range(5)}
  for order in ("heads", "blocks"):
    items = [tuple(int(x) for x in fwd_scheduler.work_item(
        dataclasses.replace(g, order=order), jnp.int32(i))) for i in range(30)]
    assert set(items) == every and len(items) == 30, order
    first = items[:5] if order == "blocks" else items[:3]
    assert first == ([(0, 0, q) for q in (4, 3, 2, 1, 0)] if order == "blocks" else
                     [(0, h, 4) for h in range(3)]), order
  keys = Variants().blocks_first_keys
  order = lambda keys, **v: tiles.item_order(keys, Variants(**v))
  assert (order(keys // 2), order(keys)) == ("heads", "blocks")
  assert order(keys, item_order="heads") == "heads"
  assert order(1024, blocks_first_keys=1024) == "blocks"


@pytest.mark.parametrize("order", ["heads", "blocks"])
@pytest.mark.parametrize("name", ["documents", "window_mqa", "h96_padded_fp16", "one_token"])
def test_forward_lowers_with_several_items_per_cta(name, order):
  """Persistent CTAs (here 3, each walking several items) in both walks (documents: serial)
  and both item orders, alone and merging into the ring's running results."""
  variants = dict(persistent=3, item_order=order)
  args, (qs, ks), kw = _structs(name)
  seg = (qs, ks) if qs is not None else ()
  step, _, step_args = ring_step(CASES[name], "pallas_mosaic_gpu", interpret=False,
                                 variants=Variants(**variants))
  assert _lower(_attention(kw, **variants), *args, *seg).count(MOSAIC) == 1
  assert _lower(step, *step_args).count(MOSAIC) == _step_kernels(name, **variants)


@pytest.mark.parametrize("head_dim, dlse, in_dq",
                         [(128, False, True), (128, True, True), (256, True, True),
                          (128, False, False)])
def test_dq_kernel_computes_a_row_term(head_dim, dlse, in_dq):
  """Given delta as a ``common.RowTerm`` the dQ kernel computes it from o (minus dlse when
  given) and hands it to the dK/dV kernel: two Mosaic GPU kernels, no XLA reduction of o * dO
  (H=256: the wide kernels). The variant ``delta_in_dq=False`` brings XLA's back."""
  from pallas_ring import block_sparse, pair, plans
  from pallas_ring.kernels import common, tuning
  b, t, n, kh = 2, 256, 4, 2
  sd = jax.ShapeDtypeStruct
  q, k = sd((b, t, n, head_dim), jnp.bfloat16), sd((b, t, kh, head_dim), jnp.bfloat16)
  tiles = tuning.resolve("pallas_mosaic_gpu", BlockSizes(variants=Variants(
      delta_in_dq=in_dq, deterministic=True)), t, t, head_dim)
  cfg = pair.kernel_config(tiles, mask=masks.Causal(), scale=0.1, softcap=None, q_len=t,
                           kv_len=t, out_dtype=jnp.bfloat16, interpret=False)

  def grads(q, k, v, do, lse, o, *dlse):
    info = block_sparse.make_token_info(t, b)
    ops = common.Operands(info, info)
    plan = plans.on_device(ops, cfg, backward=True)
    return pallas_mosaic_gpu.backward(q, k, v, do, lse, common.RowTerm(o, *dlse), ops, plan, cfg)

  text = _lower(grads, q, k, k, q, sd((b, n, t), jnp.float32), q,
                *([sd((b, n, t), jnp.float32)] if dlse else []))
  assert text.count(MOSAIC) == 2 and TRITON not in text
  assert any(f"tensor<{b}x{t}x{n}x{head_dim}x" in line for line in text.splitlines()
             if "stablehlo.reduce" in line) != in_dq


@pytest.mark.parametrize("name", ["causal_gqa", "h192_fp16"])
def test_backward_tiles_other_than_128_run_the_triton_backward(name):
  """The Mosaic GPU backward owns 128 rows per CTA on both sides; other user-given backward
  tiles are served by the Triton backward on the same plan (and say so in the tile rule), at
  Triton's head dim (192: 256)."""
  args, _, kw = _structs(name)
  f = lambda q, k, v: flash_attention(q, k, v, backend="pallas_mosaic_gpu", interpret=False,
                                      block_sizes=BlockSizes(block_q_bwd=64), **kw)
  grad = _grad(f)
  text = _lower(grad, *args)
  assert text.count(MOSAIC) == 1 and text.count(TRITON) == 2
  from pallas_ring.kernels import tuning
  tiles = tuning.resolve("pallas_mosaic_gpu", None, 1, 1, 128)  # one token: padded to 128 keys
  assert (tiles.block_q_bwd, tiles.block_kv_bwd) == (128, 128)
  assert tuning.resolve("pallas_mosaic_gpu", None, 1, 1, 256).block_kv_bwd == 128


@pytest.mark.parametrize("head_dim, deterministic", [(128, None), (128, True), (256, None)])
def test_ring_gradients_lower_to_mosaic_kernels_with_float32_outputs(head_dim, deterministic):
  """The ring's backward scan writes float32 dq/dk/dv: the backward kernels (H=128: the fused
  one by default) lower for CUDA with float32 output staging (at H=256 aliasing the walked
  slots), and its later steps merge into the running results inside the kernels."""
  from jax.sharding import Mesh, PartitionSpec as P
  from pallas_ring import ring_attention
  mesh = Mesh(jax.devices()[:2], ("sp",))

  def loss(q, k, v):
    ring = lambda q, k, v: ring_attention(
        q, k, v, axis_name="sp", mask=masks.Causal(), layout="zigzag", backend="pallas_mosaic_gpu",
        interpret=False, block_sizes=BlockSizes(variants=Variants(deterministic=deterministic)))
    o = jax.shard_map(ring, mesh=mesh, in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp"),
                      check_vma=False)(q, k, v)
    return jnp.sum(o.astype(jnp.float32))

  x = jax.ShapeDtypeStruct((1, 512, 2, head_dim), jnp.bfloat16)
  text = _lower(jax.grad(loss, argnums=(0, 1, 2)), x, x, x)
  # Two ring steps: the forward kernel alone, then merging into the first step's result; the
  # backward's local dQ and dK/dV kernels (fused: one kernel, the local pair whole), the other
  # step's dQ (adding) and dK/dV (fused: one kernel).
  fused = tiles.fused_backward(Variants(deterministic=deterministic), head_dim, 512)
  assert kernel_call_sites(text, MOSAIC) == (4 if fused else 6) and TRITON not in text


@pytest.mark.parametrize("name", list(CASES))
def test_ring_accumulators_merge_inside_the_kernels(name):
  """Given the ring's running (o, lse) the forward kernel merges into it in its epilogue, and the
  dQ kernel (or the fused backward) adds the running dq: no merge or add is left to XLA (no
  exponential outside the kernels)."""
  step, _, args = ring_step(CASES[name], "pallas_mosaic_gpu", interpret=False)
  text = _lower(step, *args)
  assert text.count(MOSAIC) == _step_kernels(name) and TRITON not in text
  rows = "tensor<" + "x".join(map(str, args[7].shape)) + "xf32>"  # dq's shape
  assert "stablehlo.exponential" not in text
  # (an add of dq's shape; not the reduce-add of the fused kernel's delta, XLA's)
  assert not any("= stablehlo.add " in line and rows in line for line in text.splitlines())


@pytest.mark.skipif(not ON_GPU or not pallas_mosaic_gpu.hopper(),
                    reason="runs the Mosaic GPU kernels natively: PALLAS_RING_TEST_GPU=1 on sm_90+")
@pytest.mark.parametrize("name", ["causal_gqa", "documents", "h256_documents_gqa_softcap",
                                  "full_odd_lengths", "mla_192_128_documents"])
def test_native_ring_accumulators_match_merging_after_the_kernels(name):
  """The kernels' merge and dq sum equal ``common.merge`` and an add after them
  (``conftest.check_ring_step``)."""
  check_ring_step(CASES[name], "pallas_mosaic_gpu", interpret=False)


def test_auto_picks_mosaic_on_hopper_only_where_it_serves(monkeypatch):
  monkeypatch.setattr(pallas_mosaic_gpu, "hopper", lambda: True)
  pick = lambda dt, **kw: kernels.variants("auto", None, kernels.Call(dt, 128, **kw))["cuda"][0]
  assert pick(jnp.bfloat16) == pick(jnp.float16) == "pallas_mosaic_gpu"
  assert pick(jnp.float32) == "pallas_triton"
  assert pick(jnp.bfloat16, block_sizes=BlockSizes(block_q=64)) == "pallas_triton"
  assert pick(jnp.bfloat16, decode=True) == "pallas_triton"  # (it serves, but slower)
  kernels.check_explicit("pallas_mosaic_gpu", kernels.Call(jnp.bfloat16, 128, decode=True))
  assert kernels.variants("auto", None, kernels.Call(jnp.bfloat16, 128))["tpu"][0] == "pallas_tpu"
  monkeypatch.setattr(pallas_mosaic_gpu, "hopper", lambda: False)
  assert pick(jnp.bfloat16) == "pallas_triton"


def test_auto_lowers_mosaic_for_both_passes_on_hopper(monkeypatch):
  monkeypatch.setattr(pallas_mosaic_gpu, "hopper", lambda: True)
  args, _, _ = _structs("causal_gqa")
  f = lambda q, k, v: flash_attention(q, k, v, mask=masks.Causal())
  grad = _grad(f)
  text = _lower(grad, *args)
  assert _kernels_of_gradients(text, _fused("causal_gqa"))
  # float32 inputs are not served by the Mosaic GPU kernels: auto takes Triton for both passes.
  args32 = [jax.ShapeDtypeStruct(a.shape, jnp.float32) for a in args]
  text = _lower(grad, *args32)
  assert MOSAIC not in text and text.count(TRITON) == 3


@pytest.mark.parametrize("what, kw, reason", [
    ("float32", dict(dtype=jnp.float32), "inputs of dtype float32"),
])
def test_explicit_request_it_cannot_serve_names_reason_and_fallback(what, kw, reason):
  kw = dict(kw)
  x = jnp.ones((1, 64, 2, 64), kw.pop("dtype", jnp.bfloat16))
  with pytest.raises(ValueError, match=f"cannot serve this call: {reason}.*pallas_triton"):
    flash_attention(x, x, x, backend="pallas_mosaic_gpu", **kw)


def test_tile_rules_are_checked_with_the_fix():
  x = jnp.ones((1, 256, 2, 256), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"block_q=64 cannot be used by backend "
                                       r"'pallas_mosaic_gpu'.*Use 128"):
    flash_attention(x, x, x, backend="pallas_mosaic_gpu", block_sizes=BlockSizes(block_q=64))
  # 128 + 2 slots x 2 x 256 keys of H=256 in bf16 do not fit in shared memory.
  with pytest.raises(ValueError, match="shared memory"):
    f = lambda x: flash_attention(x, x, x, backend="pallas_mosaic_gpu", interpret=False,
                                  block_sizes=BlockSizes(block_kv=256))
    _lower(f, jax.ShapeDtypeStruct(x.shape, x.dtype))


def test_slots_fill_shared_memory_with_at_least_two():
  from pallas_ring.kernels import common
  cfg = lambda bk, stages=None: common.KernelConfig(
      mask=masks.Causal(), scale=1.0, softcap=None, q_len=1, kv_len=1, block_q=128, block_kv=bk,
      block_q_bwd=16, block_kv_bwd=16, num_stages=stages)
  assert pallas_mosaic_gpu.slots(cfg(128), 128, 2) == 2  # 32 KiB q + 2 x 64 KiB K/V
  assert pallas_mosaic_gpu.slots(cfg(64), 128, 2) == 4  # 32 KiB q + 4 x 32 KiB (capped at 4)
  assert pallas_mosaic_gpu.slots(cfg(64, stages=3), 128, 2) == 3
  # beside staged bias windows: 32 KiB leave room for 4 slots of 32 KiB, 96 KiB for 2
  assert pallas_mosaic_gpu.slots(cfg(64), 128, 2, staged=32 * 1024) == 4
  assert pallas_mosaic_gpu.slots(cfg(64), 128, 2, staged=96 * 1024) == 2
  assert tiles.fwd_smem(cfg(128), 128, 2, staged=32 * 1024) == 192 * 1024  # (room: 223 KiB)
  # MLA 192/128: 48 KiB q (o staged in it) + 2 x 80 KiB K/V; FP8: 24 KiB q + 32 KiB o staging
  assert tiles.fwd_smem(cfg(128), 192, 2, value_dim=128) == 208 * 1024
  assert tiles.fwd_smem(cfg(256), 192, 1, value_dim=128, out_itemsize=2) == 216 * 1024
  # a q tile of 64 x 256 seen as 88 rows of 192 columns (its bytes, rounded to 8 rows)
  assert tiles.o_view_rows(64, 256, 192) == 88 and tiles.o_view_rows(64, 192, 128) == 96
  assert tiles.fwd_smem(cfg(64), 256, 2, value_dim=192) == 2 * 88 * 192 * 2 + 2 * 64 * 448 * 2
  assert tiles.staged_bias_bytes(jnp.bfloat16, Variants(), 2, 64, 128) == 32 * 1024
  assert tiles.staged_bias_bytes(jnp.float32, Variants(), 2, 64, 128) == 0
  assert tiles.staged_bias_bytes(jnp.bfloat16, Variants(stage_bias=False), 2, 64, 128) == 0


@pytest.mark.parametrize("mask", [masks.Causal() & masks.SlidingWindow(40), masks.PrefixLM(30),
                                  masks.ChunkedCausal(64)])
def test_dense_term_carries_the_visibility_where_it_fits(mask):
  """With a dense mask the tile term is ``-inf`` exactly where the reference hides a key (the
  spec, the segment ids, the padding beyond ``kv_len``), so partial tiles need no visibility
  of their own; token info batched where the dense mask is shared keeps the kernels' own."""
  from pallas_ring import block_sparse
  from pallas_ring.kernels import common
  from pallas_ring.kernels.pallas_mosaic_gpu import terms
  t, s, tp, sp = 150, 130, 256, 256
  rng = np.random.default_rng(0)
  dense = rng.random((1, 2, t, s)) < 0.8
  seg = np.sort(rng.integers(0, 3, (1, t)), axis=1).astype(np.int32)
  pos = lambda n: jnp.arange(n, dtype=jnp.int32)[None] + 7
  pad = lambda x, n: jnp.pad(jnp.asarray(x), [(0, 0)] * (x.ndim - 1) + [(0, n - x.shape[-1])])
  info = lambda n, np_, segs: block_sparse.TokenInfo(pad(pos(n), np_),
                                                     None if segs is None else pad(segs, np_))
  ops = common.Operands(info(t, tp, seg), info(s, sp, seg[:, :s]),
                        jnp.pad(dense, ((0, 0), (0, 0), (0, tp - t), (0, sp - s))))
  cfg = common.KernelConfig(mask=mask, scale=1.0, softcap=None, q_len=t, kv_len=s, block_q=128,
                            block_kv=128, block_q_bwd=64, block_kv_bwd=64)
  found = terms.terms_of(ops, cfg)
  assert found.dense_vis and not found.vis_on(True) and found.tile_info(True) is False
  term = terms.tile_bias(ops, transposed=True, cfg=cfg)  # [1, 2, Sp, Tp] bfloat16
  want = reference.visibility(mask, pos(t), pos(s), seg, seg[:, :s], dense)
  np.testing.assert_array_equal(np.asarray(term[..., :s, :t] == 0).swapaxes(2, 3),
                                np.broadcast_to(want, (1, 2, t, s)))
  assert bool(jnp.all(term[..., s:, :] == -jnp.inf))
  batched = ops._replace(q_info=info(t, tp, np.concatenate([seg, seg])),
                         kv_info=info(s, sp, np.concatenate([seg, seg])[:, :s]))
  found = terms.terms_of(batched, cfg)
  assert not found.dense_vis and found.vis_on(True) and found.tile_info(True) is True
  off = dataclasses.replace(cfg, variants=Variants(dense_visibility=False))
  assert not terms.terms_of(ops, off).dense_vis


@pytest.mark.ci_cases(every=True)
@pytest.mark.parametrize("h, hv, bias", [(64, 64, False), (128, 64, True)])
def test_interpret_on_cpu_emulates_the_plan_walk(h, hv, bias):
  """On CPU the Mosaic GPU kernel cannot run (its interpreter lacks FA3 primitives): the call
  interprets the Triton kernels over the same tiles and plan, and is correct, output and
  gradients; a narrower v (which the Mosaic GPU kernels take as it is) widened for them, with a
  bias, whose gradient reads dO at v's head dim."""
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((1, 200, 4, h)), jnp.bfloat16)
  k = jnp.asarray(rng.standard_normal((1, 200, 2, h)), jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal((1, 200, 2, hv)), jnp.bfloat16)
  do = jnp.asarray(rng.standard_normal((1, 200, 4, hv)), jnp.float32)
  b0 = jnp.asarray(rng.standard_normal((1, 4, 200, 200)), jnp.float32) if bias else None

  def run(backend, *args):
    f = lambda q, k, v, b: flash_attention(q, k, v, bias=b, mask=masks.Causal(),
                                           backend=backend).astype(jnp.float32)
    out, vjp = jax.vjp(f, *args, b0)
    return (out, *(g for g in vjp(do) if g is not None))

  got = run("pallas_mosaic_gpu", q, k, v)
  ref = run("xla", *(x.astype(jnp.float32) for x in (q, k, v)))
  assert len(got) == len(ref) == 4 + bias
  for a, r in zip(got, ref):
    assert a.shape == r.shape and rel_err(a, r) < 2e-2


NARROW_V = [(192, 128), (256, 192), (128, 64)]  # (H, Hv): the output staged in the q tiles


def _narrow_v_forward(h, hv, ctas):
  """``f(q, k, v) -> (o, lse)``: the Mosaic GPU forward at (H, Hv) under a sliding window, with
  ``ctas`` persistent CTAs (False: one per item), and its argument structs."""
  sd, bs = jax.ShapeDtypeStruct, BlockSizes(variants=Variants(persistent=ctas))
  structs = [sd((2, 384, 4, h), jnp.bfloat16), sd((2, 384, 2, h), jnp.bfloat16),
             sd((2, 384, 2, hv), jnp.bfloat16)]
  f = lambda q, k, v: flash_attention(q, k, v, mask=masks.Causal() & masks.SlidingWindow(100),
                                      backend="pallas_mosaic_gpu", interpret=False,
                                      block_sizes=bs, return_lse=True)
  return f, structs


@pytest.mark.parametrize("h, hv", NARROW_V)
def test_narrow_v_forward_lowers_with_its_output_in_the_q_tiles(h, hv):
  """One kernel that takes v and gives o at Hv columns, not padded to H (where they are, the q
  tiles' view at Hv stages o: ``FwdGeometry.o_staging``; run natively below)."""
  for ctas in (False, 3):
    f, structs = _narrow_v_forward(h, hv, ctas)
    text = _lower(f, *structs)
    (call,) = [line for line in text.splitlines() if MOSAIC in line]
    assert f"tensor<2x384x2x{hv}xbf16>) -> (tensor<2x384x4x{hv}xbf16>" in call, call[-300:]
    assert "stablehlo.pad" not in text


@pytest.mark.skipif(not ON_GPU or not pallas_mosaic_gpu.hopper(),
                    reason="runs the Mosaic GPU kernels natively: PALLAS_RING_TEST_GPU=1 on sm_90+")
@pytest.mark.parametrize("h, hv", NARROW_V)
def test_native_narrow_v_forward_matches(h, hv):
  """A narrower v's output staged in the q tiles: one CTA per item and 3 persistent CTAs (the
  next item's q loading into the tile that staged the last output) give the same bits and
  match the reference."""
  rng = np.random.default_rng(5)
  f, structs = _narrow_v_forward(h, hv, False)
  args = [jnp.asarray(rng.standard_normal(a.shape), a.dtype) for a in structs]
  one = jax.jit(f)(*args)
  three = jax.jit(_narrow_v_forward(h, hv, 3)[0])(*args)
  for a, b in zip(one, three):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  ref = reference.attention(*(x.astype(jnp.float32) for x in args),
                            mask=masks.Causal() & masks.SlidingWindow(100))
  assert rel_err(one[0], ref[0]) < 1e-2 and rel_err(one[1], ref[1]) < 1e-3


@pytest.mark.skipif(not ON_GPU or not pallas_mosaic_gpu.hopper(),
                    reason="runs the Mosaic GPU kernels natively: PALLAS_RING_TEST_GPU=1 on sm_90+")
@pytest.mark.parametrize("name", ["causal_gqa", "documents", "window_mqa", "h256"])
def test_native_persistent_forward_matches_one_cta_per_item(name):
  """3 persistent CTAs, each walking several items (both walks; documents: serial), give the
  same bits as one CTA per item, in either item order, alone and merging into the ring's
  running results (a ring step: both forwards and the backward after them; the default fused
  backward's dQ to rounding, added in no fixed order)."""
  step, _, structs = ring_step(CASES[name], "pallas_mosaic_gpu", interpret=False)
  rng = np.random.default_rng(3)
  args = [jnp.asarray(np.sort(rng.integers(0, 4, a.shape), axis=1), a.dtype)
          if a.dtype == jnp.int32 else jnp.asarray(rng.standard_normal(a.shape), a.dtype)
          for a in structs]
  runs = []
  for ctas, order in ((False, "heads"), (3, "heads"), (3, "blocks"), (False, "blocks")):
    step, _, _ = ring_step(CASES[name], "pallas_mosaic_gpu", interpret=False,
                           variants=Variants(persistent=ctas, item_order=order))
    runs.append(jax.tree.leaves(jax.jit(step)(*args)))
  for run in runs[1:]:
    for i, (a, b) in enumerate(zip(runs[0], run)):  # (o, lse, dq, dk, dv)
      if i == 2 and _fused(name):
        assert rel_err(a, b) < 1e-5
      else:
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.skipif(not ON_GPU or not pallas_mosaic_gpu.hopper(),
                    reason="runs the Mosaic GPU kernels natively: PALLAS_RING_TEST_GPU=1 on sm_90+")
@pytest.mark.parametrize("name,ctas", [("documents", False), ("window_mqa", 3),
                                       ("h256_documents_gqa_softcap", False)])
def test_native_x64_gives_the_same_bits(name, ctas):
  """x64 mode changes no result of a ring step (both forwards and the backward; window_mqa: 3
  persistent CTAs walking several items, whose item arithmetic must stay int32); the default
  fused backward's gradients to rounding (dQ added in no fixed order, delta summed by XLA)."""
  rng = np.random.default_rng(4)
  runs = []
  for x64 in (False, True):
    with jax.enable_x64(x64):
      step, _, structs = ring_step(CASES[name], "pallas_mosaic_gpu", interpret=False,
                                   variants=Variants(persistent=ctas))
      if not runs:
        args = [np.sort(rng.integers(0, 4, a.shape), axis=1).astype(np.int32)
                if a.dtype == jnp.int32 else rng.standard_normal(a.shape).astype(a.dtype)
                for a in structs]
      runs.append([np.asarray(x, np.float32)
                   for x in jax.tree.leaves(jax.jit(step)(*map(jnp.asarray, args)))])
  for i, (a, b) in enumerate(zip(*runs)):  # (o, lse, dq, dk, dv)
    if i >= 2 and _fused(name):
      assert rel_err(a, b) < 1e-5
    else:
      np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name, terms", [("causal_gqa", False), ("softcap_h64", False),
                                         ("window_mqa", False), ("documents", True),
                                         ("full_odd_lengths", True), ("h256", False),
                                         ("hv64_documents_fp16", False)])
def test_fused_backward_lowers_as_one_kernel(name, terms):
  """``Variants(deterministic=False)``: gradients run the forward and one fused backward kernel
  that reduce-adds dQ (no dQ kernel, no Triton; with every score term, and with the dK/dV split
  of few kv heads); above head dim 128 the two deterministic kernels stay."""
  args, (qs, ks), kw = _structs(name)
  seg = (qs, ks) if qs is not None else ()
  f = _attention({**kw, **(_terms(name, bias=True, dense=True) if terms else {})},
                 deterministic=False)
  grad = _grad(f)
  text = _lower(grad, *args, *seg)
  wide = CASES[name][5] > 128
  assert text.count(MOSAIC) == (3 if wide else 2) and TRITON not in text
  assert (REDUCE_ADD in text) != wide
  if not wide:  # only dQ is updated in place: dK and dV are fresh outputs (``fused_call``)
    call = next(line for line in text.splitlines() if MOSAIC in line and REDUCE_ADD in line)
    assert call.count("output_operand_alias<") == 1


@pytest.mark.ci_cases(every=True)
@pytest.mark.parametrize("flags, fused", [
    ("", True), ("--xla_gpu_deterministic_ops=true", False),
    ("--xla_gpu_autotune_level=0 --xla_gpu_deterministic_ops", False),
    ("--xla_gpu_exclude_nondeterministic_ops=TRUE", False),
    ("--xla_gpu_deterministic_ops=false", True), ("--xla_gpu_deterministic_ops_x=true", True),
    ("--xla_gpu_deterministic_ops=true --xla_gpu_deterministic_ops=0", True)])  # (the last)
def test_backward_is_fused_unless_reproducibility_is_asked(flags, fused, monkeypatch):
  """``Variants.deterministic=None`` (the default): the fused backward at head dims <= 128
  without segment ids, unless ``XLA_FLAGS`` asks XLA:GPU for deterministic ops (as JAX users
  do for XLA's own ops); the field, when set, decides. The gradients' lowering follows."""
  monkeypatch.setenv("XLA_FLAGS", flags)
  assert tiles.xla_deterministic_ops() != fused
  assert tiles.fused_backward(Variants(), 128, 512) == fused
  assert tiles.fused_backward(Variants(), 64, 4096) == fused
  assert not tiles.fused_backward(Variants(), 192, 4096)
  # short rows take the pair: documents, and at head dims up to 64 few keys
  assert not tiles.fused_backward(Variants(), 128, 4096, segments=True)
  assert not tiles.fused_backward(Variants(), 64, 2048)
  assert tiles.fused_backward(Variants(pair_up_to_keys=0), 64, 2048) == fused
  assert tiles.fused_backward(Variants(deterministic=False), 64, 512, segments=True)
  assert not tiles.fused_backward(Variants(deterministic=True), 64, 4096)
  with pytest.raises(ValueError, match="pair_up_to_keys=-1 is invalid"):
    Variants(pair_up_to_keys=-1)
  if flags in ("", "--xla_gpu_deterministic_ops=true"):
    jax.clear_caches()  # (the flag is read while tracing: no trace of another test's flags...)
    try:
      args, _, kw = _structs("causal_gqa")
      assert _kernels_of_gradients(_lower(_grad(_attention(kw)), *args), fused)
    finally:
      jax.clear_caches()  # (... nor of these for later tests)


def test_ring_runs_its_local_pair_whole_where_the_backward_fuses():
  """``Backend.fuses_backward`` (the rule of ``RingVariants.whole_local_pair``): Mosaic GPU's
  backward of both parts is one kernel where ``tiles.fused_backward`` takes the call, not with
  segment ids, FP8 operands in the FP8 mode, above head dim 128 or interpreted; other backends'
  never."""
  from pallas_ring import pair
  from pallas_ring.kernels import tuning

  def fuses(h=128, segments=False, fp8=False, interpret=False, backend="pallas_mosaic_gpu",
            **variants):
    tiles = tuning.resolve(backend, BlockSizes(variants=Variants(**variants) if variants else
                                               None), 256, 256, h)
    cfg = pair.kernel_config(tiles, mask=masks.Causal(), scale=1.0, softcap=None, q_len=256,
                             kv_len=256, out_dtype=jnp.float32, interpret=interpret)
    return kernels.get(backend).fuses_backward(cfg, h, segments, fp8)

  assert fuses() == tiles.fused_backward(Variants(), 128, 256) and fuses(h=64, deterministic=False)
  assert not fuses(h=64)  # (256 keys: short rows)
  assert not fuses(segments=True) and fuses(segments=True, deterministic=False)
  assert not fuses(fp8=True) and fuses(fp8=True, deterministic=False)
  assert not fuses(h=256) and not fuses(deterministic=True) and not fuses(interpret=True)
  assert not fuses(backend="pallas_triton") and not fuses(backend="xla")


KERNEL_PRIMITIVES = ("mpmd_map", "core_map", "pallas_call")  # a kernel's equation in a jaxpr


def _kernel_eqns(jaxpr, name: str) -> list:
  """The equations of primitive ``name`` in each kernel's body (``jaxpr_eqns``), in the order
  of the kernels in ``jaxpr``."""
  kernels = [e for e in jaxpr_eqns(jaxpr) if e.primitive.name in KERNEL_PRIMITIVES]
  return [[e for e in jaxpr_eqns(types.SimpleNamespace(eqns=[k])) if e.primitive.name == name]
          for k in kernels]


def _per_kernel(jaxpr, name: str) -> list:
  """How many equations of primitive ``name`` each kernel's body has (``_kernel_eqns``)."""
  return [len(eqns) for eqns in _kernel_eqns(jaxpr, name)]


@pytest.mark.ci_cases(every=True)
@pytest.mark.parametrize("name, deterministic, takes_it, by_rule", [
    ("causal_gqa", False, [True, True], [False, True]),  # forward, fused backward
    # forward, dQ, the wide dK/dV kernel (whose consumers share their owned tiles)
    ("h256", True, [True, True, False], [True, True, False])])
def test_step_refs_index_own_tiles_in_each_step(name, deterministic, takes_it, by_rule):
  """``Variants.step_refs``: a kernel's consumers index their own tiles in each step of their
  main loops by ``pipeline.step_index`` (one ``min`` more per loop body); the rule
  (``tiles.step_refs``) turns it on in the fused backward and above head dim 192 only."""
  args, (qs, ks), kw = _structs(name)
  seg = (qs, ks) if qs is not None else ()

  def mins(**variants):
    f = _attention(kw, deterministic=deterministic, **variants)
    grad = _grad(f)
    return _per_kernel(jax.make_jaxpr(grad)(*args, *seg).jaxpr, "min")

  off, on, default = mins(step_refs=False), mins(step_refs=True), mins()
  assert len(off) == len(takes_it), off  # (every kernel found)
  assert [b > a for a, b in zip(off, on)] == takes_it
  assert [d > a for a, d in zip(off, default)] == by_rule
  rule = tiles.step_refs
  assert not rule(Variants(), 192) and rule(Variants(), 128, fused=True)
  assert rule(Variants(), 256) and not rule(Variants(step_refs=False), 256)


@pytest.mark.ci_cases(every=True)
@pytest.mark.parametrize("name, by_default", [("causal_gqa", True), ("softcap_h64", False)])
def test_fused_backward_splits_dq_columns_at_head_dim_128(name, by_default):
  """``Variants.dq_split``: the fused kernel's consumers each add half of dQ's columns (their
  column offset and the deferred step's start proven multiples: ``pl.multiple_of``) at head dim
  128 by default; at 64, where a half is not whole swizzle tiles, never. The rule
  ``tiles.dq_with_dkv`` issues that matmul with dV's and dK's at 128 only when split."""
  args, _, kw = _structs(name)

  def hints(**variants):
    f = _attention(kw, deterministic=False, **variants)
    grad = _grad(f)
    return _per_kernel(jax.make_jaxpr(grad)(*args).jaxpr, "multiple_of")[-1]  # the fused one

  off, on, default = hints(dq_split=False), hints(dq_split=True), hints()
  assert (on > off) == by_default and default == (on if by_default else off)
  # ds K issued with dV and dK: at 128 only split (unsplit its float32 tile would not fit)
  with_dkv = tiles.dq_with_dkv
  assert with_dkv(Variants(), 128) and not with_dkv(Variants(dq_split=False), 128)
  assert with_dkv(Variants(dq_split=False), 64)
  assert not with_dkv(Variants(dq_with_dkv_up_to=64), 128)


@pytest.mark.ci_cases(every=True)
@pytest.mark.parametrize("name, deterministic, by_rule", [
    ("causal_gqa", False, {2}), ("causal_gqa", True, set()), ("softcap_h64", False, set())])
def test_backward_overlaps_with_its_matmuls_in_flight(name, deterministic, by_rule):
  """``Variants.overlap_softmax``: the dK/dV consumers read q.k^T with dO.v^T's wgmma in flight
  (an accumulator read waiting for all but 1); ``overlap_dq``: the fused kernel reads ds^T K
  with dV's and dK's in flight (all but 2) and adds it to dQ. The rule (``tiles.overlap_dq``):
  at head dim 128 (dQ's columns split) only; the dQ kernel never."""
  args, (qs, ks), kw = _structs(name)
  seg = (qs, ks) if qs is not None else ()

  def waits(**variants):  # the backward kernels' partial waits (after the forward)
    f = _attention(kw, deterministic=deterministic, **variants)
    eqns = _kernel_eqns(jax.make_jaxpr(_grad(f))(*args, *seg).jaxpr,
                        "wgmma_accumulator_deref_p")[1:]
    return [{e.params["wait_n"] for e in k if e.params["wait_n"]} for k in eqns]

  fused = not deterministic
  dkv = lambda w: [*([] if fused else [set()]), w]  # (the dQ kernel first, when it runs)
  assert waits() == dkv(by_rule)
  assert waits(overlap_softmax=True, overlap_dq=False) == dkv({1})
  assert waits(overlap_softmax=True, overlap_dq=True) == dkv({1, 2} if fused else {1})
  assert waits(overlap_dq=True) == dkv({2} if fused else set())
  assert tiles.overlap_dq(Variants(), 128) and not tiles.overlap_dq(Variants(), 64)
  assert not tiles.overlap_dq(Variants(dq_split=False, overlap_dq=True), 128)  # (dQ after)


def test_split_fused_backward_reads_ds_from_shared_memory():
  """``Variants.ds_from_smem`` (default): the split fused kernel's dK matmul reads ds^T from the
  shared-memory tile written for dQ's columns, leaving p^T its one register A operand (in the
  mask-free and the masked walk: 2 of 4). Unsplit nothing changes."""
  args, _, kw = _structs("causal_gqa")

  def register_operands(**variants):
    f = _attention(kw, deterministic=False, **variants)
    (_, fused) = _kernel_eqns(jax.make_jaxpr(_grad(f))(*args).jaxpr, "wgmma_ref")
    return sum(type(e.invars[1].aval) is jax.core.ShapedArray for e in fused)  # (not refs)

  assert register_operands(ds_from_smem=False) == 4
  assert register_operands() == register_operands(ds_from_smem=True) == 2
  assert (register_operands(dq_split=False) == register_operands(dq_split=False,
                                                                 ds_from_smem=False) == 4)


def test_fused_backward_gives_q_an_extra_slot():
  """``Variants.extra_q_slot``: by the rule the fused kernel's q-side tiles get a third slot
  beside dO's two at H=128, not at 64 (unless asked), not with dropout or FP8, nor in the pair,
  nor when switched off; it lowers with every score term."""
  from pallas_ring.kernels.pallas_mosaic_gpu import bwd_kernels, terms
  args, _, kw = _structs("full_odd_lengths")
  f = _attention({**kw, **_terms("full_odd_lengths", bias=True, dense=True)}, deterministic=False)
  assert _lower(_grad(f), *args).count(MOSAIC) == 2
  args, _, kw = _structs("softcap_h64")  # (asked for at H=64)
  f = _attention(kw, deterministic=False, extra_q_slot=True)
  assert _lower(_grad(f), *args).count(MOSAIC) == 2
  c = bwd_kernels._Call(heads=16, kv_heads=16, head_dim=128, value_dim=128,
                        dtype=jnp.dtype("bfloat16"), out_dtype=jnp.dtype("bfloat16"), info_rows=1,
                        terms=terms.Terms(), term_dtype=jnp.bfloat16,
                        variants=Variants())
  geometry = lambda c, fused=True: bwd_kernels._geometry(c, True, 16384, 1, fused=fused)
  h64 = c._replace(head_dim=64, value_dim=64)
  assert (geometry(c).slots, geometry(c).q_slots) == (2, 3)
  assert geometry(h64).q_slots == geometry(h64).slots
  assert geometry(h64._replace(variants=Variants(extra_q_slot=True))).q_slots == 3
  assert geometry(c._replace(variants=Variants(extra_q_slot=False))).q_slots == 2
  assert geometry(c, fused=False).q_slots == geometry(c, fused=False).slots
  assert not geometry(c._replace(terms=terms.Terms(dropout=True))).extra_q_slot


def test_fused_backward_lowers_under_vmap():
  """vmap of the fused backward's gradients: one fused kernel call per element (a loop)."""
  args, _, kw = _structs("causal_gqa")
  f = _attention(kw, deterministic=False)
  grad = _grad(f)
  batched = [jax.ShapeDtypeStruct((3, *a.shape), a.dtype) for a in args]
  text = _lower(jax.vmap(grad), *batched)
  assert text.count(MOSAIC) == 2 and REDUCE_ADD in text and "stablehlo.while" in text


def test_fused_backward_adds_the_rings_running_dq():
  """A ring step's fused backward starts dQ from the running dq (no add after the kernel)."""
  step, _, args = ring_step(CASES["causal_gqa"], "pallas_mosaic_gpu", interpret=False,
                            variants=Variants(deterministic=False))
  text = _lower(step, *args)
  assert text.count(MOSAIC) == 3 and REDUCE_ADD in text  # two forwards, the fused backward
  rows = "tensor<" + "x".join(map(str, args[7].shape)) + "xf32>"  # dq's shape
  assert not any("= stablehlo.add " in line and rows in line for line in text.splitlines())


@pytest.mark.skipif(not ON_GPU or not pallas_mosaic_gpu.hopper(),
                    reason="runs the Mosaic GPU kernels natively: PALLAS_RING_TEST_GPU=1 on sm_90+")
@pytest.mark.parametrize("name", ["causal_gqa", "documents", "softcap_h64", "full_odd_lengths",
                                  "h256_documents_gqa_softcap", "h192_fp16",
                                  "mla_192_128_documents", "hv64_documents_fp16"])
def test_native_gradients_match_and_are_bitwise_reproducible(name):
  """Both Mosaic GPU passes at default tiles: gradients against the float32 xla backend, and,
  where reproducibility is asked (``deterministic=True``: no cross-CTA accumulation), the same
  bits on a second run; by default (the fused backward where the rule takes it) close to them."""
  mask, t, s, n, kh, h, dt, segs, cap = CASES[name]
  hv = HV.get(name, h)
  rng = np.random.default_rng(5)
  q, k, v = (jnp.asarray(rng.standard_normal(shape), dt)
             for shape in ((2, t, n, h), (2, s, kh, h), (2, s, kh, hv)))
  do = jnp.asarray(rng.standard_normal((2, t, n, hv)), jnp.float32)
  kw = dict(mask=mask, softcap=cap)
  if segs:
    kw["segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 4, (2, t)), axis=1), jnp.int32)

  def grads(backend, *args, bs=None):
    loss = lambda *a: jnp.sum(flash_attention(*a, backend=backend, block_sizes=bs, **kw).astype(
        jnp.float32) * do)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)

  pair = BlockSizes(variants=Variants(deterministic=True))
  got, again = (grads("pallas_mosaic_gpu", q, k, v, bs=pair) for _ in range(2))
  ref = grads("xla", *(x.astype(jnp.float32) for x in (q, k, v)))
  default = grads("pallas_mosaic_gpu", q, k, v) if _fused(name) else got
  for a, b, d, r in zip(got, again, default, ref):
    assert rel_err(a, r) < 2e-2 and rel_err(d, a) < 5e-3
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.skipif(not ON_GPU or not pallas_mosaic_gpu.hopper(),
                    reason="runs the Mosaic GPU kernels natively: PALLAS_RING_TEST_GPU=1 on sm_90+")
@pytest.mark.parametrize("name", ["causal_gqa", "documents", "softcap_h64", "full_odd_lengths",
                                  "h256_documents_gqa_softcap", "h192_fp16", "window_mqa"])
@pytest.mark.parametrize("bias, dense", [(False, False), (True, True), (False, True),
                                         (jnp.bfloat16, False)])
def test_native_score_terms_match_and_are_bitwise_reproducible(name, bias, dense):
  """ALiBi, dropout, a bias and a dense mask in both Mosaic GPU passes: output and gradients
  (the bias's too) against the float32 xla backend (the same dropout hash); the same bits on a
  second run where reproducibility is asked, and the default (fused) close to them."""
  mask, t, s, n, kh, h, dt, segs, cap = CASES[name]
  rng = np.random.default_rng(7)
  q, k, v = (jnp.asarray(rng.standard_normal(shape), dt)
             for shape in ((2, t, n, h), (2, s, kh, h), (2, s, kh, h)))
  do = jnp.asarray(rng.standard_normal((2, t, n, h)), jnp.float32)
  kw = dict(mask=mask, softcap=cap, **_terms(name, rate=0.3, bias=bias, dense=dense))
  b0 = jnp.asarray(kw.pop("bias")) if bias else None
  if segs:
    kw["segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 4, (2, t)), axis=1), jnp.int32)

  def run(backend, q, k, v, b0, bs=None):
    f = lambda *a: flash_attention(*a[:3], bias=a[3], backend=backend, block_sizes=bs,
                                   **kw).astype(jnp.float32)
    out, vjp = jax.vjp(f, q, k, v, b0)
    return (out, *(g for g in vjp(do) if g is not None))

  mosaic = lambda **variants: jax.jit(functools.partial(
      run, "pallas_mosaic_gpu", bs=BlockSizes(variants=Variants(**variants))))
  run_pair = mosaic(deterministic=True)
  got, again = run_pair(q, k, v, b0), run_pair(q, k, v, b0)
  ref = jax.jit(functools.partial(run, "xla"))(*(x.astype(jnp.float32) for x in (q, k, v)), b0)
  default = mosaic()(q, k, v, b0) if _fused(name) else got
  for a, b, d, r in zip(got, again, default, ref):
    assert rel_err(a, r) < 2e-2 and rel_err(d, a) < 5e-3
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.skipif(not ON_GPU or not pallas_mosaic_gpu.hopper(),
                    reason="runs the Mosaic GPU kernels natively: PALLAS_RING_TEST_GPU=1 on sm_90+")
@pytest.mark.parametrize("name", ["causal_gqa", "softcap_h64", "h256_documents_gqa_softcap",
                                  "full_odd_lengths"])
@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("switch", ["stage_bias", "dense_visibility"])
def test_native_term_variants_give_the_same_bits(name, deterministic, switch):
  """A bfloat16 bias with a dense mask staged through shared memory (the default) gives the
  same bits as read from global memory (``Variants.stage_bias=False``), and a dense term that
  carries the visibility the same as one beside the kernels' own (``dense_visibility``):
  output and gradients (the fused backward's dQ, added in no fixed order, to rounding)."""
  mask, t, s, n, kh, h, dt, segs, cap = CASES[name]
  rng = np.random.default_rng(9)
  q, k, v = (jnp.asarray(rng.standard_normal(shape), dt)
             for shape in ((2, t, n, h), (2, s, kh, h), (2, s, kh, h)))
  do = jnp.asarray(rng.standard_normal((2, t, n, h)), jnp.float32)
  kw = _terms(name, rate=0.0, bias=jnp.bfloat16, dense=True)
  b0 = kw.pop("bias")
  seg = (jnp.asarray(np.sort(rng.integers(0, 4, (2, t)), axis=1), jnp.int32),) * 2 if segs else ()

  def run(on, q, k, v, b0):
    f = lambda q, k, v, b: _attention(dict(mask=mask, softcap=cap, bias=b, **kw),
                                      deterministic=deterministic, **{switch: on})(
                                          q, k, v, *seg).astype(jnp.float32)
    out, vjp = jax.vjp(f, q, k, v, b0)
    return (out, *vjp(do))

  default, other = (jax.jit(functools.partial(run, on))(q, k, v, b0) for on in (True, False))
  for i, (a, b) in enumerate(zip(default, other)):
    if i == 1 and not deterministic:
      assert rel_err(a, b) < 5e-3
    else:
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.skipif(not ON_GPU or not pallas_mosaic_gpu.hopper(),
                    reason="runs the Mosaic GPU kernels natively: PALLAS_RING_TEST_GPU=1 on sm_90+")
@pytest.mark.parametrize("name, terms, split", [
    ("causal_gqa", False, True), ("documents", False, True), ("softcap_h64", False, True),
    ("full_odd_lengths", False, True), ("window_mqa", False, True),
    ("h96_padded_fp16", False, True), ("hv64_documents_fp16", False, True),
    ("causal_gqa", True, True), ("softcap_h64", True, True),
    # dQ's columns not split (``Variants.dq_split``; at head dim 64 they never are)
    ("causal_gqa", False, False), ("hv64_documents_fp16", False, False),
    ("causal_gqa", True, False)])
@pytest.mark.parametrize("overlap", [False, True])
def test_native_fused_backward_matches(name, terms, split, overlap):
  """The fused backward (``deterministic=False``; ``split``: dQ's columns split over the
  consumers, where the head dim allows): gradients against the float32 xla backend and the
  deterministic kernels (dQ summed in another order; dK/dV from the same kernel), with ALiBi,
  dropout, a bias and a dense mask where ``terms``; ``overlap``: both with their softmax beside
  dO.v^T's matmul, the fused one also with dQ's add beside dK's and dV's and (split) ds^T from
  shared memory; else every A operand from registers."""
  mask, t, s, n, kh, h, dt, segs, cap = CASES[name]
  hv = HV.get(name, h)
  rng = np.random.default_rng(8)
  q, k, v = (jnp.asarray(rng.standard_normal(shape), dt)
             for shape in ((2, t, n, h), (2, s, kh, h), (2, s, kh, hv)))
  do = jnp.asarray(rng.standard_normal((2, t, n, hv)), jnp.float32)
  kw = dict(mask=mask, softcap=cap, **(_terms(name, rate=0.3, bias=True, dense=True)
                                        if terms else {}))
  if segs:
    kw["segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 4, (2, t)), axis=1), jnp.int32)

  def grads(backend, *args, **variants):
    bs = BlockSizes(variants=Variants(**variants)) if variants else None
    loss = lambda *a: jnp.sum(flash_attention(*a, backend=backend, block_sizes=bs, **kw).astype(
        jnp.float32) * do)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)

  fused = grads("pallas_mosaic_gpu", q, k, v, deterministic=False, dq_split=split,
                overlap_softmax=overlap, overlap_dq=overlap, ds_from_smem=overlap)
  det = grads("pallas_mosaic_gpu", q, k, v, deterministic=True, overlap_softmax=overlap)
  ref = grads("xla", *(x.astype(jnp.float32) for x in (q, k, v)))
  for a, d, r in zip(fused, det, ref):
    assert rel_err(a, r) < 2e-2 and rel_err(a, d) < 5e-3
    assert not np.isnan(np.asarray(a, np.float32)).any()


@pytest.mark.skipif(not ON_GPU or not pallas_mosaic_gpu.hopper(),
                    reason="runs the Mosaic GPU kernels natively: PALLAS_RING_TEST_GPU=1 on sm_90+")
@pytest.mark.parametrize("whole", [True, False])
def test_native_ring_backward_of_two_devices_in_one_program(whole):
  """Both devices' backward of a 2-device dense ring as one program on one GPU (no sends): the
  local pair whole (``RingVariants.whole_local_pair``, the rule here) or its dQ first, the
  other shard's pair fused (its dK/dV sent home), then the local dK/dV (or the whole pair's)
  added to them. Against the float32 xla backend. (XLA:GPU once passed one buffer for the
  fused kernel's dK and dV, aliased zero-filled refs, where its k and v were slices, as here:
  dK came back as dV.)"""
  from pallas_ring import block_sparse, pair, plans
  from pallas_ring.kernels import common, tuning
  t, n, kh, h = 4096, 8, 2, 128
  rng = np.random.default_rng(12)
  q, k, v, do = (jnp.asarray(rng.standard_normal((1, 2 * t, heads, h)), jnp.bfloat16)
                 for heads in (n, kh, kh, n))
  tiles = tuning.resolve("pallas_mosaic_gpu", BlockSizes(), t, t, h, dtype=jnp.bfloat16,
                         group=n // kh, mask_class="full")
  cfg = pair.kernel_config(tiles, mask=masks.Full(), scale=h ** -0.5, softcap=None, q_len=t,
                           kv_len=t, out_dtype=jnp.float32, interpret=False)
  lowering = kernels.get("pallas_mosaic_gpu")
  info = block_sparse.make_token_info(t, 1, None, None)
  ops = common.Operands(info, info)
  fwd_plan, bwd_plan = plans.on_device(ops, cfg), plans.on_device(ops, cfg, backward=True)

  @jax.jit
  def ring_of_two(q, k, v, do):
    shard = lambda x, i: x[:, i * t:(i + 1) * t]
    kv = [(shard(k, i), shard(v, i)) for i in range(2)]
    rows = []
    for i in range(2):  # device i: its rows' forward, local dQ, the other pair (fused)
      o, lse = lowering.forward(shard(q, i), *kv[i], ops, fwd_plan, cfg)
      o, lse = lowering.forward(shard(q, i), *kv[1 - i], ops, fwd_plan, cfg,
                                common.Partial(o, lse))
      args = (shard(q, i), shard(do, i), lse, common.RowTerm(o.astype(jnp.bfloat16)))
      dq, *own = lowering.backward(args[0], *kv[i], *args[1:], ops, bwd_plan, cfg, None,
                                   common.BOTH if whole else common.DQ)
      dq, *sent = lowering.backward(args[0], *kv[1 - i], *args[1:], ops, bwd_plan, cfg, dq)
      rows.append((args, dq, own, sent))
    grads = []
    for i in range(2):  # device i's own dK/dV added to those the other sent home
      args, dq, own, _ = rows[i]
      home = rows[1 - i][3]
      if whole:
        dk, dv = (a + b for a, b in zip(own, home))
      else:
        _, dk, dv = lowering.backward(args[0], *kv[i], *args[1:], ops, bwd_plan, cfg, None,
                                      common.DKV, tuple(home))
      grads.append((dq, dk, dv))
    return [jnp.concatenate([g[j] for g in grads], axis=1) for j in range(3)]

  loss = lambda *a: jnp.sum(flash_attention(*a, backend="xla") * do.astype(jnp.float32))
  ref = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*(x.astype(jnp.float32) for x in (q, k, v)))
  for got, want in zip(ring_of_two(q, k, v, do), ref):
    assert rel_err(got, want) < 2e-2


@pytest.mark.skipif(not ON_GPU or not pallas_mosaic_gpu.hopper(),
                    reason="runs the Mosaic GPU kernels natively: PALLAS_RING_TEST_GPU=1 on sm_90+")
def test_native_gradients_of_stacked_layers_in_one_program():
  """Three attention layers in one program, each's q, k and v slices of one projection (a
  fused QKV) of the previous output, gradients against the float32 xla backend: every fused
  backward kernel returns its own dK and dV (XLA:GPU once gave them one buffer where k and v
  were slices)."""
  rng = np.random.default_rng(13)
  t, n, kh, h = 2048, 8, 2, 128
  x, do = (jnp.asarray(rng.standard_normal((1, t, n, h)), jnp.bfloat16) for _ in range(2))
  w = jnp.asarray(rng.standard_normal((3, n * h, (n + 2 * kh) * h)) * (n * h) ** -0.5,
                  jnp.bfloat16)

  def grads(backend, x, w):
    def loss(x, w):
      for i in range(3):
        qkv = (x.reshape(1, t, n * h) @ w[i]).reshape(1, t, n + 2 * kh, h)
        q, k, v = qkv[:, :, :n], qkv[:, :, n:n + kh], qkv[:, :, n + kh:]
        x = flash_attention(q, k, v, mask=masks.Causal(), backend=backend)
      return jnp.sum(x.astype(jnp.float32) * do.astype(jnp.float32))
    return jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)

  ref = grads("xla", x.astype(jnp.float32), w.astype(jnp.float32))
  for got, want in zip(grads("pallas_mosaic_gpu", x, w), ref):
    assert rel_err(got, want) < 2e-2


@pytest.mark.skipif(not ON_GPU or not pallas_mosaic_gpu.hopper(),
                    reason="runs the Mosaic GPU kernels natively: PALLAS_RING_TEST_GPU=1 on sm_90+")
def test_native_fused_backward_adds_the_rings_running_dq():
  check_ring_step(CASES["documents"], "pallas_mosaic_gpu", interpret=False,
                  variants=Variants(deterministic=False))


@pytest.mark.skipif(not ON_GPU or not pallas_mosaic_gpu.hopper(),
                    reason="runs the Mosaic GPU kernels natively: PALLAS_RING_TEST_GPU=1 on sm_90+")
@pytest.mark.parametrize("name", ["window_mqa", "h256_documents_gqa_softcap"])
def test_native_split_dkv_matches_unsplit_and_is_reproducible(name):
  """dK/dV split over query heads (float32 partials summed in order): the same gradients as
  the unsplit kernel (to rounding: the partial sums' order differs), and the same bits twice."""
  mask, t, s, n, kh, h, dt, segs, cap = CASES[name]
  rng = np.random.default_rng(6)
  q, k, v = (jnp.asarray(rng.standard_normal(shape), dt)
             for shape in ((2, t, n, h), (2, s, kh, h), (2, s, kh, h)))
  do = jnp.asarray(rng.standard_normal((2, t, n, h)), jnp.float32)
  seg = (jnp.asarray(np.sort(rng.integers(0, 4, (2, t)), axis=1), jnp.int32),) if segs else ()

  def grads(splits):
    f = _attention(dict(mask=mask, softcap=cap), dkv_head_splits=splits)
    loss = lambda q, k, v: jnp.sum(f(q, k, v, *seg, *seg).astype(jnp.float32) * do)
    return jax.jit(jax.grad(loss, argnums=(1, 2)))(q, k, v)

  one, split, again = grads(1), grads(n // kh), grads(n // kh)
  for a, b, c in zip(one, split, again):
    assert rel_err(b, a) < 1e-2
    np.testing.assert_array_equal(np.asarray(b, np.float32), np.asarray(c, np.float32))


@pytest.mark.skipif(not ON_GPU or not pallas_mosaic_gpu.hopper(),
                    reason="runs the Mosaic GPU kernels natively: PALLAS_RING_TEST_GPU=1 on sm_90+")
class TestPallasMosaicGpu(Conformance):
  """The conformance suite on the Hopper kernels; float32 cases run in bfloat16."""

  backend = "pallas_mosaic_gpu"
  float32 = False
