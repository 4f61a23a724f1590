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
# # Swapping pallas_ring into a Flax transformer
#
# The example LM (`pallas_ring/examples/transformer.py`) uses `nn.MultiHeadDotProductAttention`;
# one argument, `attention_fn=make_attention_fn(...)`, moves it onto pallas_ring. Both train from
# the same initialisation; their losses coincide.

# %%
import os
import subprocess
import sys

if "google.colab" in sys.modules:
  subprocess.check_call([sys.executable, "-m", "pip", "install", "-q",
                         os.environ.get("PALLAS_RING_SPEC", "pallas-ring[tpu]")])

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
