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
# # Swapping pallas_ring into a Flax transformer
#
# The example LM (`pallas_ring/examples/transformer.py`) uses `nn.MultiHeadDotProductAttention`;
# one argument, `attention_fn=make_attention_fn(...)`, moves it onto pallas_ring. Both train from
# the same initialisation; their losses coincide.

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
import matplotlib.pyplot as plt
import numpy as np

from pallas_ring import masks
from pallas_ring.examples.transformer import LMConfig, TransformerLM, train
from pallas_ring.nn import make_attention_fn

ON_TPU = jax.default_backend() == "tpu"
cfg = LMConfig(max_len=1024, width=256, heads=4, layers=4, mlp=1024) if ON_TPU else LMConfig()
steps, length = (200, 1024) if ON_TPU else (30, 32)

stock = train(TransformerLM(cfg), steps=steps, length=length)
ours = train(TransformerLM(cfg, attention_fn=make_attention_fn(mask=masks.Causal())),
             steps=steps, length=length)
print("max relative difference:", float(np.max(np.abs(np.subtract(ours, stock)) / np.abs(stock))))

# %%
plt.plot(stock, label="flax dot_product_attention")
plt.plot(ours, "--", label="pallas_ring")
plt.xlabel("step")
plt.ylabel("loss")
plt.legend()
plt.show()

# %% [markdown]
# ## Generating with a KV cache
#
# `RingAttention(decode=True)` keeps Flax's cache (the same variables as the stock module) and
# attends each new token to it with `pallas_ring.decode_attention`, which reads the cache in
# parallel chunks and never reads the slots past the current index. With the stock module's
# parameters it generates the stock module's tokens.

# %%
import flax.linen as nn
import jax.numpy as jnp

from pallas_ring.nn import RingAttention


class TinyDecoder(nn.Module):
  ring: bool  # RingAttention, or the stock module

  @nn.compact
  def __call__(self, tokens):  # [B, L] (L = 1 per generated token)
    x = nn.Embed(64, 64)(tokens)
    kw = dict(num_heads=4, decode=True)
    attn = RingAttention(mask=masks.Causal(), **kw) if self.ring else \
        nn.MultiHeadDotProductAttention(**kw)
    return nn.Dense(64)(x + attn(x))


max_len = 256 if ON_TPU else 24
init = TinyDecoder(ring=False).init(jax.random.key(0), jnp.zeros((1, max_len), jnp.int32))


def generate(model, first_token, n):
  """Greedy decoding of `n` tokens, one cached step each."""
  step = jax.jit(lambda cache, tok: model.apply({"params": init["params"], "cache": cache}, tok,
                                                mutable=["cache"]))
  cache, tok, tokens = init["cache"], jnp.array([[first_token]]), []
  for _ in range(n):
    logits, variables = step(cache, tok)
    cache, tok = variables["cache"], jnp.argmax(logits[:, -1], axis=-1)[:, None]
    tokens.append(int(tok[0, 0]))
  return tokens


stock_tokens = generate(TinyDecoder(ring=False), 1, max_len - 1)
ring_tokens = generate(TinyDecoder(ring=True), 1, max_len - 1)
print("stock:", stock_tokens[:12], "...")
print("ours: ", ring_tokens[:12], "...")
assert stock_tokens == ring_tokens, "the cached decode differs from stock Flax"
print("identical: True")
