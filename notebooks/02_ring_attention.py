# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Ring attention over a mesh
#
# A mesh over all devices: the TPU cores on a Colab TPU runtime, 8 virtual CPU devices elsewhere.
# K/V rotate around the ring with `lax.ppermute` inside `lax.scan`; masks compare global
# positions, so contiguous, zigzag and striped layouts are one code path.

# %% [markdown]
# **Install.** On a fresh runtime (Colab) this cell installs pallas_ring, with the extra that
# fits the runtime (`[tpu]` on a TPU, `[cuda12]` on a GPU). It does nothing when `pallas_ring`
# already imports. pallas_ring is not on PyPI yet: where you have its repository, run `make wheel`
# (it writes `dist/pallas_ring-0.1.0-py3-none-any.whl`) and upload that file to this runtime
# (Colab's Files pane puts it in `/content`). This cell finds it there and installs it. Instead,
# `PALLAS_RING_SOURCE` may name a wheel's path or any pip spec this runtime can reach. It also installs
# matplotlib, which the plots below need, when it is missing.
#
# **On a TPU.** The TPU (Mosaic) kernels are compiled for v4, v5e, v5p and v6e and checked
# against the reference in interpret mode, but they have not yet been timed on a TPU: any timing
# this notebook prints on a TPU runtime is a first measurement, not a published number.

# %%
import glob
import importlib.util
import os
import shutil
import subprocess
import sys

PALLAS_RING_SOURCE = os.environ.get("PALLAS_RING_SOURCE", "")  # <- edit: pip spec or .whl path


def detect_runtime():
  """'tpu', 'gpu' or 'cpu' for this machine, without importing JAX."""
  if glob.glob("/dev/accel*") or os.environ.get("COLAB_TPU_ADDR") or \
      os.environ.get("TPU_ACCELERATOR_TYPE", "").startswith("v"):
    return "tpu"
  return "gpu" if shutil.which("nvidia-smi") else "cpu"


def install_command(source, runtime, wheels):
  """The pip command that installs pallas_ring from `source` (or the newest of `wheels`)."""
  extra = {"tpu": "[tpu]", "gpu": "[cuda12]"}.get(runtime, "")
  source = source or (sorted(wheels)[-1] if wheels else "")
  if not source:
    raise RuntimeError(
        "pallas_ring is not installed and PALLAS_RING_SOURCE is empty. Upload the wheel that "
        "`make wheel` builds (dist/pallas_ring-*.whl) to the working directory or /content "
        "(Colab's Files pane), or set PALLAS_RING_SOURCE in this cell to a wheel's path or a pip "
        "spec, then run the cell again.")
  if source.startswith(("git+", "http://", "https://")) and not source.endswith(".whl"):
    requirement = f"pallas-ring{extra} @ {source}"
  else:
    requirement = source + extra
  return [sys.executable, "-m", "pip", "install", "-q", requirement]


if importlib.util.find_spec("pallas_ring") is None:
  cmd = install_command(PALLAS_RING_SOURCE, detect_runtime(),
                        glob.glob("pallas_ring-*.whl") + glob.glob("/content/pallas_ring-*.whl"))
  print("installing:", " ".join(cmd[4:]))
  if subprocess.run(cmd).returncode != 0:
    raise RuntimeError("pip could not install pallas_ring from that source: check "
                       "PALLAS_RING_SOURCE (a reachable pip spec or an uploaded wheel's path).")
else:
  print("pallas_ring is installed:", importlib.util.find_spec("pallas_ring").origin)
# This notebook also plots: matplotlib (preinstalled on Colab; `pallas-ring[notebooks]` has it).
if importlib.util.find_spec("matplotlib") is None:
  subprocess.run([sys.executable, "-m", "pip", "install", "-q", "matplotlib"], check=True)

# %%
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + \
      " --xla_force_host_platform_device_count=8"  # used only when there is no accelerator

# %%
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

import pallas_ring as pr
from pallas_ring import block_sparse, layouts, masks, reference

R = jax.device_count()
ON_TPU = jax.default_backend() == "tpu"
# Sizes: real ones on a TPU; smoke sizes elsewhere (CI runs every notebook on a CPU this way).
T = 8192 * R if ON_TPU else 32 * R
B, N, K, H = 1, 8, 2, 128 if ON_TPU else 32
mesh = jax.make_mesh((R,), ("sp",), axis_types=(AxisType.Auto,))
print(f"{R} devices: {jax.devices()[0].device_kind}; T={T}")

# %% [markdown]
# ## Layouts: which global positions each rank holds

# %%
# Positions of a 16 * R token sequence; each rank's shard printed in full (zigzag: two chunks).
for layout in layouts.LAYOUTS:
  print(layout)
  for r in range(min(R, 4)):
    print(f"  rank {r}:", np.asarray(layouts.positions(16 * R, layout, R, r)).tolist())

# %% [markdown]
# ## The ring against the dense reference

# %%
rng = np.random.default_rng(0)
q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
k = jnp.asarray(rng.standard_normal((B, T, K, H)), jnp.float32)
v = jnp.asarray(rng.standard_normal((B, T, K, H)), jnp.float32)
for layout in layouts.LAYOUTS:
  cfg = pr.SequenceParallelConfig(axis_name="sp", layout=layout)
  perm = lambda x: layouts.permute(x, layout, R)
  out = jax.jit(lambda a, b, c: pr.sharded_attention(a, b, c, mesh=mesh, config=cfg,
                                                     mask=masks.Causal()))(perm(q), perm(k), perm(v))
  if not ON_TPU:
    ref = reference.attention(q, k, v, mask=masks.Causal())[0]
    err = float(jnp.max(jnp.abs(layouts.unpermute(out, layout, R) - ref)))
    print(f"{layout:10s} max |err| {err:.2e}")
    assert err < 1e-4

# %% [markdown]
# ## Live work per device per ring step (causal)
#
# Contiguous leaves early ranks idle; zigzag and striped balance the causal triangle.

# %%
import matplotlib.pyplot as plt

tl, blk = T // R, max(T // R // 8, 1)
fig, axes = plt.subplots(1, 3, figsize=(13, 3.5))
for ax, layout in zip(axes, layouts.LAYOUTS):
  live = np.zeros((R, R))
  for d in range(R):
    qi = block_sparse.make_token_info(tl, B, layouts.positions(T, layout, R, d))
    for s in range(R):
      src = (d - s) % R
      ki = block_sparse.make_token_info(tl, B, layouts.positions(T, layout, R, src))
      plan = block_sparse.make_plan(masks.Causal(), qi, ki, block_q=blk, block_kv=blk,
                                    q_len=tl, kv_len=tl)
      live[d, s] = float(block_sparse.live_fraction(plan).mean())
  ax.imshow(live, vmin=0, vmax=1)
  ax.set_title(f"{layout}: work per device {live.sum(1).min():.1f}..{live.sum(1).max():.1f}")
  ax.set_xlabel("ring step")
  ax.set_ylabel("device")
plt.tight_layout()
plt.show()
