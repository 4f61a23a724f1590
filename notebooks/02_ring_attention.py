# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
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

# %%
import os
import subprocess
import sys

if "google.colab" in sys.modules:
  subprocess.check_call([sys.executable, "-m", "pip", "install", "-q",
                         os.environ.get("PALLAS_RING_SPEC", "pallas-ring[tpu]")])
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
T = 8192 * R if ON_TPU else 32 * R
B, N, K, H = 1, 8, 2, 128 if ON_TPU else 32
mesh = jax.make_mesh((R,), ("sp",), axis_types=(AxisType.Auto,))
print(f"{R} devices: {jax.devices()[0].device_kind}; T={T}")

# %% [markdown]
# ## Layouts: which global positions each rank holds

# %%
for layout in layouts.LAYOUTS:
  print(f"{layout:10s}", [list(np.asarray(layouts.positions(16 * R, layout, R, r))[:4])
                          for r in range(min(R, 4))], "...")

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
