"""Test setup: 8 virtual CPU devices (set before JAX initialises), deterministic hypothesis profiles
and the three test selections (``make quick`` < ``make test``, which CI runs, < ``make test-all``)."""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
if os.environ.get("PALLAS_RING_TEST_GPU") is None:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  # The tests compile thousands of small programs and run each a few times: LLVM's optimization
  # passes took about a third of the suite's CPU time and buy nothing at these sizes (CPU programs
  # only; an optimization level in XLA_FLAGS overrides it).
  if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
# TPU programs are compiled (not run) through libtpu by several pytest-xdist workers at once.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# HYPOTHESIS_PROFILE: "ci" (make test), "quick" (make quick) or "all" (make test-all).
settings.register_profile(
    "all", derandomize=True, deadline=None, max_examples=30, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", parent=settings.get_profile("all"), max_examples=15)
settings.register_profile("quick", parent=settings.get_profile("all"), max_examples=8)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
settings.load_profile(PROFILE)


def examples(ci, all):  # noqa: A002 (the profile's name)
  """``max_examples`` for a hypothesis test that sets its own: ``all`` under ``make test-all``,
  ``ci`` under ``make test`` (at most the profile's count under ``make quick``)."""
  return all if PROFILE == "all" else min(ci, settings.default.max_examples)


def pytest_collection_modifyitems(config, items):
  """The selections: ``make test`` (CI) runs ``-m "not slow"``, ``make quick`` runs ``-m "not
  slow and not ci"`` and ``make test-all`` runs everything.

  A parametrized test runs its first case in all three; with ``@pytest.mark.ci_cases(id, ...)``
  it runs the listed cases (their ids as in the node ids) in CI instead, the first of them in
  ``make quick`` (``ci_cases(every=True)``: every case, for cheap ones). Conftest marks the CI
  cases after that one ``ci`` and every other case ``slow``. Whole tests marked ``ci`` (costly,
  e.g. the demo) run in CI but not in ``make quick``; tests marked ``slow`` only in ``make
  test-all``.
  """
  families = {}
  for item in items:
    if getattr(item, "callspec", None) is not None:
      families.setdefault(item.nodeid.split("[")[0], []).append(item)
  for family, cases in families.items():
    chosen = cases[0].get_closest_marker("ci_cases")
    if chosen is None:
      keep = cases[:1]
    elif chosen.kwargs.get("every"):
      keep = cases
    else:
      ids = {c.callspec.id for c in cases}
      unknown = [i for i in chosen.args if i not in ids]
      if unknown and len(cases) > 1:  # (a run of one case by its node id lists no others)
        raise pytest.UsageError(f"{family}: ci_cases names no case {unknown}; its cases: "
                                f"{sorted(ids)}")
      keep = [c for c in cases if c.callspec.id in chosen.args] or cases[:1]
    for case in cases:
      if case not in keep:
        case.add_marker(pytest.mark.slow)
      elif case is not keep[0]:
        case.add_marker(pytest.mark.ci)


def jaxpr_eqns(jaxpr):
  """Every equation of a jaxpr and of its inner jaxprs (each once, whatever its scan length)."""
  for eqn in jaxpr.eqns:
    yield eqn
    for param in eqn.params.values():
      for sub in (param if isinstance(param, (tuple, list)) else (param,)):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          yield from jaxpr_eqns(sub)


def rel_err(got, ref):
  """Relative error ||got - ref|| / ||ref|| in float64."""
  got = np.asarray(got, np.float64)
  ref = np.asarray(ref, np.float64)
  denom = np.linalg.norm(ref)
  return float(np.linalg.norm(got - ref) / (denom if denom > 0 else 1.0))


@pytest.fixture
def rng():
  return np.random.default_rng(0)


# A GPU run (PALLAS_RING_TEST_GPU=1) runs the kernels natively (test_pallas_mosaic_gpu: Hopper).
ON_GPU = os.environ.get("PALLAS_RING_TEST_GPU") is not None
if ON_GPU:
  # On a GPU, JAX's default precision runs float32 matmuls as TF32 (in XLA and in Pallas
  # Triton kernels alike; README, below the support matrix). The float32 tolerances here are for
  # float32 arithmetic, which the xla and pallas_triton backends give under this setting.
  import jax  # noqa: E402
  jax.config.update("jax_default_matmul_precision", "highest")


def small_blocks(backend, head_dim=128, reproducible=False):
  """Small tiles that still obey each backend's rules (many blocks at test sizes);
  ``reproducible``: the Mosaic GPU backward's reproducible pair instead of its fused kernel."""
  from pallas_ring import BlockSizes
  if backend == "pallas_tpu":
    return BlockSizes(block_q=32, block_kv=128, block_q_bwd=32, block_kv_bwd=128)
  if backend == "pallas_mosaic_gpu":  # two warpgroups of 64 rows (the backward's on both sides
    from pallas_ring.kernels.pallas_mosaic_gpu import Variants
    bwd = 128 if head_dim <= 128 else 32  # up to H=128; above, the backward is Triton's)
    return BlockSizes(block_q=128, block_kv=64, block_q_bwd=bwd, block_kv_bwd=bwd,
                      variants=Variants(deterministic=True) if reproducible else None)
  return BlockSizes(block_q=16, block_kv=16, block_q_bwd=16, block_kv_bwd=32)


def kernel_dtype(backend, dtype):
  """The dtype a backend is tested in: float32 cases run in bfloat16 on ``pallas_mosaic_gpu``
  (wgmma takes 16-bit inputs; float32 calls are refused, see test_pallas_mosaic_gpu)."""
  import jax.numpy as jnp
  if backend == "pallas_mosaic_gpu" and dtype == jnp.float32:
    return jnp.bfloat16
  return dtype


def kernel_call_sites(text, marker):
  """Calls of kernels (custom calls containing ``marker``) in the program of lowered ``text``,
  each private function counted at every call of it (a scan body once)."""
  import re
  funcs = {}
  for body in re.split(r"\n\s*func\.func ", text)[1:]:
    name = re.match(r"(?:public|private) @([\w.]+)", body).group(1)
    funcs[name] = (body.count(marker), re.findall(r"call @([\w.]+)", body))

  def sites(name):
    own, callees = funcs[name]
    return own + sum(sites(c) for c in callees if c in funcs)

  return sites("main")


def ring_step(case, backend, interpret, variants=None):
  """One ring step's kernel calls on ``backend`` for ``case = (mask, T, S, N, K, H, dtype,
  segments, softcap)``: the forward given a running ``common.Partial`` and the backward given a
  running dq (float32 outputs, as the ring runs them), and the same calls without them.

  Returns:
    ``(step, plain, args)``: ``step(q, k, v, do, seg, o_acc, lse_acc, dq_acc) -> ((o, lse),
    (dq, dk, dv))``, ``plain(q, k, v, do, seg) -> (o, lse, (dq, dk, dv))`` and their argument
    shapes (``jax.ShapeDtypeStruct``). ``variants``: the backend's kernel variants (None: its
    defaults).
  """
  import jax
  import jax.numpy as jnp
  from pallas_ring import BlockSizes, block_sparse, kernels, pair, plans
  from pallas_ring.kernels import common, tuning
  mask, t, s, n, kh, h, dt, segs, cap = case
  tiles = tuning.resolve(backend, BlockSizes(variants=variants), t, s, h, dtype=dt,
                         group=n // kh, mask_class="causal")
  tp, sp = (tuning.padded_len(x, tiles.block_q, tiles.block_kv, tiles.block_q_bwd,
                              tiles.block_kv_bwd) for x in (t, s))
  hp = tuning.padded_head_dim(backend, h)
  cfg = pair.kernel_config(tiles, mask=mask, scale=h ** -0.5, softcap=cap, q_len=t,
                           kv_len=s, out_dtype=jnp.float32, interpret=interpret)
  lowering = kernels.get(backend)

  def ops_of(seg):
    info = lambda length, padded: block_sparse.pad_token_info(block_sparse.make_token_info(
        length, 2, None, seg[:, :length] if segs else None), padded)
    return common.Operands(info(t, tp), info(s, sp))

  def plain(q, k, v, do, seg):
    ops = ops_of(seg)
    o, lse = lowering.forward(q, k, v, ops, plans.on_device(ops, cfg), cfg)
    grads = lowering.backward(q, k, v, do, lse, common.RowTerm(o), ops,
                              plans.on_device(ops, cfg, backward=True), cfg)
    return o, lse, grads

  def step(q, k, v, do, seg, o_acc, lse_acc, dq_acc):
    ops = ops_of(seg)
    merged = lowering.forward(q, k, v, ops, plans.on_device(ops, cfg), cfg,
                              common.Partial(o_acc, lse_acc))
    o, lse = lowering.forward(q, k, v, ops, plans.on_device(ops, cfg), cfg)
    added = lowering.backward(q, k, v, do, lse, common.RowTerm(o), ops,
                              plans.on_device(ops, cfg, backward=True), cfg, dq_acc)
    return merged, added

  sd = jax.ShapeDtypeStruct
  args = (sd((2, tp, n, hp), dt), sd((2, sp, kh, hp), dt), sd((2, sp, kh, hp), dt),
          sd((2, tp, n, hp), dt), sd((2, max(tp, sp)), jnp.int32), sd((2, tp, n, hp), jnp.float32),
          sd((2, n, tp), jnp.float32), sd((2, tp, n, hp), jnp.float32))
  return step, plain, args


def fused_backward(case, backend, interpret, variants=None) -> bool:
  """Whether ``case``'s gradients run the Mosaic GPU fused backward (dQ added in no fixed order:
  ``tiles.fused_backward``) natively with ``variants`` (None: the defaults)."""
  from pallas_ring.kernels.pallas_mosaic_gpu import Variants, tiles
  return (backend == "pallas_mosaic_gpu" and not interpret and
          tiles.fused_backward(variants or Variants(), tiles.padded_head_dim(case[5]), case[2],
                               segments=case[7]))


def check_ring_step(case, backend, interpret, variants=None):
  """Checks ``ring_step``: given running results (random, with rows no earlier pass saw: lse
  -inf, o 0) a lowering's forward and backward equal ``common.merge`` and an add after its plain
  calls (dK/dV bitwise but from the fused backward; ``variants``: the backend's kernel
  variants)."""
  import jax
  import jax.numpy as jnp
  from pallas_ring.kernels import common
  step, plain, args = ring_step(case, backend, interpret, variants)
  rng = np.random.default_rng(11)
  q, k, v, do = (jnp.asarray(rng.standard_normal(a.shape), a.dtype) for a in args[:4])
  seg = jnp.asarray(np.sort(rng.integers(0, 4, args[4].shape), axis=1), jnp.int32)
  o_acc = jnp.asarray(rng.standard_normal(args[5].shape), jnp.float32)
  lse_acc = jnp.asarray(rng.standard_normal(args[6].shape) + 3.0, jnp.float32)
  lse_acc = lse_acc.at[:, :, ::7].set(-jnp.inf)
  o_acc = o_acc.at[:, ::7].set(0.0)
  dq_acc = jnp.asarray(rng.standard_normal(args[7].shape), jnp.float32)
  (o, lse), (dq, dk, dv) = jax.jit(step)(q, k, v, do, seg, o_acc, lse_acc, dq_acc)
  o1, lse1, (dq1, dk1, dv1) = jax.jit(plain)(q, k, v, do, seg)
  o_ref, lse_ref = common.merge(o_acc, lse_acc, o1, lse1)
  # A kernel merging its float32 rows differs from merging its output rounded to 16 bits (the
  # Mosaic GPU forward's, relative error up to 2^-9) by that rounding; a wrong weight is O(1).
  assert rel_err(o, o_ref) < 5e-3 and not np.isnan(np.asarray(o)).any()
  np.testing.assert_array_equal(np.isinf(np.asarray(lse)), np.isinf(np.asarray(lse_ref)))
  fin = np.isfinite(np.asarray(lse_ref))
  np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(lse_ref)[fin], rtol=1e-5)
  assert rel_err(dq, dq_acc + dq1) < 1e-6
  if not fused_backward(case, backend, interpret, variants):
    np.testing.assert_array_equal(np.asarray(dk), np.asarray(dk1))
    np.testing.assert_array_equal(np.asarray(dv), np.asarray(dv1))
  else:  # (XLA computes delta for the fused kernel: its sum's order may differ per program)
    assert rel_err(dk, dk1) < 1e-5 and rel_err(dv, dv1) < 1e-5
