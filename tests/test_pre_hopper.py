"""The pre-Hopper GPU path (A100, L4): Pallas's Triton lowering today, ``xla`` once it is gone.

JAX 0.11 deprecates the Pallas Triton backend and says it will be removed. These tests say, on
this CPU machine (by cross-lowering for CUDA), whether this JAX still has it, and check what
``backend="auto"`` does on the day it is gone (simulated by hiding its module).
"""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest

from pallas_ring import flash_attention, masks

TRITON = "__gpu$xla.gpu.triton"  # the custom call of a Triton kernel in lowered StableHLO

GONE = (f"JAX {jax.__version__} no longer has Pallas's Triton lowering (deprecated in JAX 0.11), "
        "which pallas_ring's pre-Hopper GPU kernels (backend='pallas_triton': A100, L4, ...) are "
        "written in. backend='auto' now runs those GPUs on 'xla' (blockwise XLA, slower) with a "
        "warning. Decide their new path (README, 'Pre-Hopper GPUs'), update the README's support "
        "matrix and this test. Cause: ")


def test_the_pallas_triton_lowering_is_still_in_jax():
  """Fails, saying what to do, the day ``jax.experimental.pallas.triton`` or its lowering is
  gone: a causal forward with backend="pallas_triton" lowers for CUDA to one Triton kernel."""
  try:
    from jax.experimental.pallas import triton  # noqa: F401
  except ImportError as e:
    pytest.fail(GONE + f"{type(e).__name__}: {e}")
  q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
  f = lambda q: flash_attention(q, q, q, mask=masks.Causal(), backend="pallas_triton",
                                interpret=False)
  try:
    text = jax.jit(f).trace(q).lower(lowering_platforms=("cuda",)).as_text()
  except Exception as e:  # noqa: BLE001 - any failure of the lowering itself
    pytest.fail(GONE + f"{type(e).__name__}: {str(e)[:500]}")
  assert text.count(TRITON) == 1, GONE + "the lowered program holds no Triton kernel"


def _without_triton(body: str) -> subprocess.CompletedProcess:
  """Runs ``body`` in a fresh Python where ``jax.experimental.pallas.triton`` cannot be imported
  (as after its removal from JAX)."""
  code = "import sys\nsys.modules['jax.experimental.pallas.triton'] = None\n" + textwrap.dedent(
      body)
  return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_without_the_triton_lowering_auto_runs_xla_on_gpus_and_says_so():
  """With the Triton lowering gone: ``auto`` lowers GPU attention through ``xla`` (no Triton
  kernel, the same results) with one warning naming the backend; ``backend="pallas_triton"``
  raises naming ``backend='auto'``; nothing ends in an import error."""
  proc = _without_triton("""
      import warnings
      import jax, jax.numpy as jnp, numpy as np
      from pallas_ring import flash_attention, kernels, masks
      with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        picked = kernels.variants("auto", None, kernels.Call(jnp.bfloat16, 64))
      print("PICKED", picked["cuda"][0], picked["cpu"][0])
      print("WARNED", sum("backend='pallas_triton' cannot be used" in str(x.message) for x in w))
      q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
      f = lambda q: flash_attention(q, q, q, mask=masks.Causal())
      text = jax.jit(f).trace(q).lower(lowering_platforms=("cuda",)).as_text()
      print("TRITON_KERNELS", text.count("__gpu$xla.gpu.triton"))
      x = jnp.ones((1, 16, 2, 16), jnp.float32)
      try:
        flash_attention(x, x, x, backend="pallas_triton")
      except ImportError as e:
        print("EXPLICIT", type(e).__name__, e)
      """)
  out = proc.stdout
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "PICKED xla xla" in out and "WARNED 1" in out and "TRITON_KERNELS 0" in out, out
  assert ("EXPLICIT BackendUnavailable backend='pallas_triton' cannot be used" in out
          and "Use backend='auto'" in out), out


def test_without_the_triton_lowering_hopper_keeps_its_mosaic_gpu_kernels():
  proc = _without_triton("""
      import jax.numpy as jnp
      from pallas_ring import kernels
      from pallas_ring.kernels import pallas_mosaic_gpu
      pallas_mosaic_gpu.hopper = lambda: True
      print("PICKED", kernels.variants("auto", None, kernels.Call(jnp.bfloat16, 64))["cuda"][0])
      """)
  assert "PICKED pallas_mosaic_gpu" in proc.stdout, proc.stderr[-2000:]
