"""Training step time of a 4-layer Flax LM on one GPU: our attention (the reproducible pair of
backward kernels and the fused one) against cuDNN's (``jax.nn.dot_product_attention``), same
model and parameters, bf16, causal, MHA N=16 H=128 (D=2048), B=1, an AdamW step, device clock.

    PYTHONPATH=. python tools/lm_step_bench.py [T ...]   # default 8192 16384 32768

Prints, per length, each attention's step time in batches and as lone calls and its ratio to
cuDNN's; first the loss and the gradients' relative difference to cuDNN's (bf16 rounding).
"""

from __future__ import annotations

import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from pallas_ring import bench, masks
from pallas_ring.attention import flash_attention
from pallas_ring.config import BlockSizes
from pallas_ring.kernels.pallas_mosaic_gpu import Variants

LAYERS, HEADS, HEAD_DIM, VOCAB = 4, 16, 128, 32000
WIDTH = HEADS * HEAD_DIM


def ours(deterministic):
  """A Flax ``attention_fn`` on our kernels (Flax passes no mask here: the causal mask is ours)."""
  bs = BlockSizes(variants=Variants(deterministic=deterministic))
  return lambda q, k, v, **_: flash_attention(q, k, v, mask=masks.Causal(), block_sizes=bs)


def cudnn(q, k, v, **_):
  return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


class LM(nn.Module):
  attention_fn: object

  @nn.compact
  def __call__(self, tokens):  # [B, T] -> logits [B, T, V]
    bf16 = jnp.bfloat16
    x = nn.Embed(VOCAB, WIDTH, dtype=bf16)(tokens)
    for _ in range(LAYERS):
      x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS, dtype=bf16,
                                              attention_fn=self.attention_fn)(
                                                  nn.LayerNorm(dtype=bf16)(x))
      h = nn.Dense(4 * WIDTH, dtype=bf16)(nn.LayerNorm(dtype=bf16)(x))
      x = x + nn.Dense(WIDTH, dtype=bf16)(nn.gelu(h))
    return nn.Dense(VOCAB, dtype=bf16)(nn.LayerNorm(dtype=bf16)(x))


def train_step(attention_fn):
  model, opt = LM(attention_fn), optax.adamw(1e-4)

  @jax.jit
  def step(params, state, tokens, labels):
    def loss_fn(p):
      logits = model.apply(p, tokens).astype(jnp.float32)
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss, grads

  return model, opt, step


def main(*lengths):
  lengths = [int(t) for t in lengths] or [8192, 16384, 32768]
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}; {LAYERS} layers, "
        f"D={WIDTH}, N={HEADS}, H={HEAD_DIM}, causal, bf16, B=1", flush=True)
  impls = {"cudnn": cudnn, "ours reproducible": ours(True), "ours fused": ours(False)}
  for t in lengths:
    rng = np.random.default_rng(t)
    tokens, labels = (jnp.asarray(rng.integers(0, VOCAB, (1, t)), jnp.int32) for _ in range(2))
    model, opt, _ = train_step(cudnn)
    params = model.init(jax.random.key(0), tokens[:, :128])
    state = opt.init(params)
    calls, results = {}, {}
    for name, fn in impls.items():
      step = train_step(fn)[2]
      args = (params, state, tokens, labels)
      calls[name] = (step, args)
      results[name] = jax.block_until_ready(step(*args))
    flat = lambda grads: jnp.concatenate([g.astype(jnp.float32).ravel()
                                          for g in jax.tree.leaves(grads)])
    base_loss, base_grads = results["cudnn"][2], flat(results["cudnn"][3])
    for name, (_, _, loss, grads) in results.items():
      # (of all parameters at once: some have no gradient but rounding, e.g. the key bias)
      err = float(jnp.linalg.norm(flat(grads) - base_grads) / jnp.linalg.norm(base_grads))
      print(f"T={t} {name:18s} loss {float(loss):.5f} (cuDNN {float(base_loss):.5f}), "
            f"gradients' relative difference to cuDNN's {err:.1e}", flush=True)
    for how, batch_s, iters, reps in (("batches", bench.MIN_BATCH_S, 3, 8),
                                      ("one call", 0.0, 1, 24)):
      with bench.clock("device"):
        samples = bench.interleaved_samples(calls, iters=iters, reps=reps, min_batch_s=batch_s)
      med = {name: float(np.median(ts)) * 1e3 for name, ts in samples.items()}
      for name, ms in med.items():
        print(f"T={t:6d} {how:8s} {name:18s} {ms:8.3f} ms  vs cuDNN {med['cudnn'] / ms:.3f}x",
              flush=True)


if __name__ == "__main__":
  main(*sys.argv[1:])
