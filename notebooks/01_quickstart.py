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
# # pallas_ring quickstart
#
# Block-sparse flash attention in Pallas. On a Colab TPU runtime the Mosaic kernels run natively;
# on a CPU the same code runs the `xla` backend (and the Pallas kernels in interpret mode).

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
import jax
import jax.numpy as jnp
import numpy as np

import pallas_ring as pr
from pallas_ring import block_sparse, masks, reference

print("devices:", jax.devices())
ON_TPU = jax.default_backend() == "tpu"
# Sizes: real ones on a TPU; smoke sizes elsewhere (CI runs every notebook on a CPU this way).
T = 4096 if ON_TPU else 256
B, N, K, H = 1, 8, 2, 128 if ON_TPU else 64

# %% [markdown]
# ## Several masks, checked against the dense reference

# %%
rng = np.random.default_rng(0)
q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
k = jnp.asarray(rng.standard_normal((B, T, K, H)), jnp.float32)
v = jnp.asarray(rng.standard_normal((B, T, K, H)), jnp.float32)
docs = jnp.asarray(np.sort(rng.integers(0, 4, (B, T)), axis=1), jnp.int32)
cases = {
    "causal": dict(mask=masks.Causal()),
    "sliding window 64": dict(mask=masks.SlidingWindow(64)),
    "chunked 128 | prefix 32": dict(mask=masks.ChunkedCausal(128) | masks.PrefixLM(32)),
    "documents (causal)": dict(mask=masks.Causal(), segment_ids=docs),
}
for name, kw in cases.items():
  out = pr.flash_attention(q, k, v, **kw)
  ref = reference.attention(q, k, v, **kw)[0]
  err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
  print(f"{name:26s} relative error {err:.2e}")
  assert err < 2e-3

# %% [markdown]
# ## Block classes: empty (skipped), partial (masked), full (no mask arithmetic)

# %%
import matplotlib.pyplot as plt

blk = T // 16
info = block_sparse.make_token_info(T, B)
seg_info = block_sparse.make_token_info(T, B, segment_ids=docs)
r = 4
zz = lambda rank: block_sparse.make_token_info(T // r, B, pr.layouts.positions(T, "zigzag", r, rank))
plans = {
    "causal": block_sparse.make_plan(masks.Causal(), info, info, block_q=blk, block_kv=blk,
                                     q_len=T, kv_len=T),
    "window 64": block_sparse.make_plan(masks.SlidingWindow(64), info, info, block_q=blk,
                                        block_kv=blk, q_len=T, kv_len=T),
    "documents": block_sparse.make_plan(masks.Causal(), seg_info, seg_info, block_q=blk,
                                        block_kv=blk, q_len=T, kv_len=T),
    "zigzag ring step (rank 1 <- rank 3)": block_sparse.make_plan(
        masks.Causal(), zz(1), zz(3), block_q=blk // 4, block_kv=blk // 4, q_len=T // r,
        kv_len=T // r),
}
fig, axes = plt.subplots(1, len(plans), figsize=(4 * len(plans), 4))
for ax, (name, plan) in zip(axes, plans.items()):
  ax.imshow(np.asarray(plan.block_class)[0, 0], cmap="viridis", vmin=0, vmax=2)
  ax.set_title(f"{name}\nlive {float(block_sparse.live_fraction(plan).mean()):.0%}")
  ax.set_xlabel("kv block")
  ax.set_ylabel("q block")
plt.tight_layout()
plt.show()
