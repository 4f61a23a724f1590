"""A small decoder-only transformer LM whose attention is swapped in one line.

``TransformerLM(attention_fn=nn.dot_product_attention)`` is the stock Flax model;
``TransformerLM(attention_fn=pallas_ring.nn.make_attention_fn(config, mask=masks.Causal()))``
runs the same parameters on pallas_ring (a ring when a mesh with ``config.axis_name`` is active).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
try:
  import optax
except ImportError as e:  # optax is an extra: only this example needs it
  raise ImportError("pallas_ring.examples.transformer trains with optax: "
                    "pip install 'pallas-ring[examples]' (or `pip install optax`).") from e

from pallas_ring import layouts


@dataclasses.dataclass(frozen=True)
class LMConfig:
  """Model size (kept tiny: the example trains on a CPU in seconds)."""

  vocab: int = 32  # tokens
  max_len: int = 64  # longest sequence (learned position embeddings)
  width: int = 32  # model width D
  heads: int = 4  # attention heads N (head dim D / N)
  layers: int = 2  # transformer blocks
  mlp: int = 64  # MLP hidden width
  dropout_rate: float = 0.0  # attention-probability dropout while training


class Block(nn.Module):
  cfg: LMConfig
  attention_fn: Callable

  @nn.compact
  def __call__(self, x, mask, deterministic=True):  # x [B, T, D]; mask [B, 1, T, T]
    h = nn.LayerNorm()(x)
    h = nn.MultiHeadDotProductAttention(
        num_heads=self.cfg.heads, dropout_rate=self.cfg.dropout_rate,
        attention_fn=self.attention_fn)(h, mask=mask, deterministic=deterministic)
    x = x + h
    h = nn.Dense(self.cfg.mlp)(nn.LayerNorm()(x))
    return x + nn.Dense(self.cfg.width)(nn.gelu(h))


class TransformerLM(nn.Module):
  cfg: LMConfig = LMConfig()
  attention_fn: Callable = nn.dot_product_attention  # <- the one line to swap

  @nn.compact
  def __call__(self, tokens, positions, deterministic=True):  # tokens, positions [B, T]
    x = nn.Embed(self.cfg.vocab, self.cfg.width)(tokens) + nn.Embed(
        self.cfg.max_len, self.cfg.width)(positions)
    # Causal in global positions, so it stays right when tokens are permuted for a ring.
    mask = nn.make_attention_mask(positions, positions, jnp.greater_equal)
    for _ in range(self.cfg.layers):
      x = Block(self.cfg, self.attention_fn)(x, mask, deterministic)
    return nn.Dense(self.cfg.vocab)(nn.LayerNorm()(x))  # [B, T, V]


def synthetic_batch(rng: np.random.Generator, batch: int, length: int, vocab: int):
  """Sequences that repeat a random motif: predictable from context, so the loss falls."""
  period = rng.integers(2, 6, size=(batch, 1))
  motif = rng.integers(0, vocab, size=(batch, 8))
  idx = np.arange(length + 1)[None] % period
  seq = np.take_along_axis(motif, idx, axis=1)
  return jnp.asarray(seq[:, :-1], jnp.int32), jnp.asarray(seq[:, 1:], jnp.int32)


def train(model: TransformerLM, steps: int = 50, batch: int = 4, length: int = 32, seed: int = 0,
          layout: str = "contiguous", ring_size: int = 1, shard: Callable | None = None,
          lr: float = 3e-3):
  """Trains ``model`` with Adam; returns the per-step losses.

  With ``ring_size > 1`` the tokens, labels and positions are permuted once into ``layout``
  order (as at data loading) and ``shard`` (if given) places each array on the mesh.
  """
  rng = np.random.default_rng(seed)
  data = [synthetic_batch(rng, batch, length, model.cfg.vocab) for _ in range(steps)]
  positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))

  def prep(x):
    if ring_size > 1:
      x = layouts.permute(x, layout, ring_size)
    return shard(x) if shard is not None else x

  pos = prep(positions)
  # (init sees what training sees: layout-ordered tokens and positions under a ring)
  params = model.init(jax.random.key(seed), prep(data[0][0]), pos)
  opt = optax.adam(lr)
  state = opt.init(params)

  dropout = model.cfg.dropout_rate > 0

  @jax.jit
  def step(params, state, tokens, labels, key):
    def loss_fn(p):
      logits = model.apply(p, tokens, pos, deterministic=not dropout, rngs={"dropout": key})
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  losses = []
  for i, (tokens, labels) in enumerate(data):
    key = jax.random.fold_in(jax.random.key(seed + 1), i)
    params, state, loss = step(params, state, prep(tokens), prep(labels), key)
    losses.append(float(loss))
  return losses


def main(steps: int = 50) -> float:
  """Trains the stock model and the same model on pallas_ring from one seed and prints both
  losses at every step, with their difference.

  Returns:
    The largest relative difference of the two losses over the steps.
  """
  from pallas_ring import masks
  from pallas_ring.config import SequenceParallelConfig
  from pallas_ring.nn import make_attention_fn
  fn = make_attention_fn(SequenceParallelConfig(), mask=masks.Causal())
  print(f"training {LMConfig()} for {steps} Adam steps on a repeating-motif task, "
        f"{jax.devices()[0].device_kind}:")
  stock = train(TransformerLM(), steps=steps)
  ours = train(TransformerLM(attention_fn=fn), steps=steps)
  print(f"{'step':>4s}  {'stock nn.dot_product_attention':>30s}  "
        f"{'pallas_ring (make_attention_fn)':>31s}  {'relative difference':>19s}")
  worst = 0.0
  for i, (a, b) in enumerate(zip(stock, ours), 1):
    rel = abs(a - b) / abs(a)
    worst = max(worst, rel)
    print(f"{i:4d}  {a:30.6f}  {b:31.6f}  {rel:19.1e}")
  print(f"largest relative difference over {steps} steps: {worst:.1e} (float32 rounding: the "
        f"same training run); loss {stock[0]:.3f} -> {stock[-1]:.3f}")
  return worst


if __name__ == "__main__":
  main()
