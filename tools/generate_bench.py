"""Greedy generation step time of a 4-layer Flax LM on one GPU: ``RingAttention(decode=True)``
against stock ``MultiHeadDotProductAttention(decode=True)`` with XLA's attention and with cuDNN
(``jax.nn.dot_product_attention(implementation="cudnn")``, the cache's lengths from Flax's mask),
all with the same parameters, after a prompt of ``PROMPT`` tokens (the cache filled with random
bf16 K/V: step time does not depend on their values), device clock.

    PYTHONPATH=. python tools/generate_bench.py [PROMPT] [STEPS]

Prints milliseconds per generated token and the ratios; first checks that the three generate
the same first tokens.
"""

from __future__ import annotations

import functools
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp

from pallas_ring import bench, masks
from pallas_ring.nn import RingAttention

LAYERS, WIDTH, HEADS, VOCAB = 4, 2048, 16, 32000


def cudnn_attention(query, key, value, bias=None, mask=None, **kw):
  """Flax attention_fn on cuDNN: the decode mask ``[B, 1, 1, S]`` (slots <= index) as lengths."""
  del bias, kw
  lengths = jnp.sum(mask[:, 0, 0], axis=-1).astype(jnp.int32)
  return jax.nn.dot_product_attention(query, key, value, key_value_seq_lengths=lengths,
                                      implementation="cudnn")


class DecodeLM(nn.Module):
  attention: str  # "ours" | "xla" | "cudnn"

  @nn.compact
  def __call__(self, tokens):  # [B, 1]
    x = nn.Embed(VOCAB, WIDTH, dtype=jnp.bfloat16)(tokens)
    for i in range(LAYERS):
      kw = dict(num_heads=HEADS, decode=True, dtype=jnp.bfloat16, name=f"attention_{i}")
      if self.attention == "ours":
        attn = RingAttention(mask=masks.Causal(), **kw)
      else:
        fn = cudnn_attention if self.attention == "cudnn" else nn.dot_product_attention
        attn = nn.MultiHeadDotProductAttention(attention_fn=fn, **kw)
      x = x + attn(nn.LayerNorm(dtype=jnp.bfloat16)(x))
      h = nn.Dense(4 * WIDTH, dtype=jnp.bfloat16)(nn.LayerNorm(dtype=jnp.bfloat16)(x))
      x = x + nn.Dense(WIDTH, dtype=jnp.bfloat16)(nn.gelu(h))
    return nn.Dense(VOCAB, dtype=jnp.bfloat16)(x)  # [B, 1, V]


def main(prompt=32768, steps=256):
  prompt, steps = int(prompt), int(steps)
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}; {LAYERS} layers, "
        f"D={WIDTH}, N={HEADS}, prompt {prompt}, {steps} steps", flush=True)
  max_len = prompt + steps
  tok = jnp.zeros((1, 1), jnp.int32)
  models = {name: DecodeLM(name) for name in ("ours", "xla", "cudnn")}
  shapes = jax.eval_shape(lambda: models["ours"].init(jax.random.key(0), tok))
  params = jax.jit(lambda: models["ours"].init(jax.random.key(0), tok)["params"])()
  params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)

  def cache_of(tree):  # random K/V in every slot; the next token goes to slot `prompt`
    keys = iter(jax.random.split(jax.random.key(1), 4 * LAYERS))
    out = {}
    for layer, c in tree.items():
      shape = c["cached_key"].shape[:1] + (max_len,) + c["cached_key"].shape[2:]
      out[layer] = {"cached_key": jax.random.normal(next(keys), shape, jnp.bfloat16),
                    "cached_value": jax.random.normal(next(keys), shape, jnp.bfloat16),
                    "cache_index": jnp.asarray(prompt, jnp.int32)}
    return out

  caches = {name: cache_of(shapes["cache"]) for name in models}

  def generate(model, params, cache, tok, n):
    def step(carry, _):
      cache, tok = carry
      logits, upd = model.apply({"params": params, "cache": cache}, tok, mutable=["cache"])
      tok = jnp.argmax(logits[:, -1], axis=-1)[:, None].astype(jnp.int32)
      return (upd["cache"], tok), tok[0, 0]
    (cache, _), toks = jax.lax.scan(step, (cache, tok), None, length=n)
    return toks

  run = lambda name, n: jax.jit(functools.partial(generate, models[name], n=n))
  first = {name: run(name, 8)(params, caches[name], tok) for name in models}
  print("first tokens:", {k: [int(t) for t in v] for k, v in first.items()}, flush=True)
  calls = {name: (run(name, steps), (params, caches[name], tok)) for name in models}
  with bench.clock("device"):
    res = bench.timeit_interleaved(calls, iters=1, reps=6, min_batch_s=0.0)
  for name, secs in res.items():
    per = secs / steps * 1e3
    print(f"  {name:6s} {per:7.3f} ms/token  ({res['cudnn'] / secs:.2f}x cuDNN's speed, "
          f"{res['xla'] / secs:.2f}x XLA's)", flush=True)


if __name__ == "__main__":
  main(*sys.argv[1:])
