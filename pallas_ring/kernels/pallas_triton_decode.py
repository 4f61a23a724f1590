"""``decode_attention``'s dedicated kernel on Triton: a few query rows against a long KV cache in
one launch, with no block plan.

The generic decode runs the forward kernel over chunks of the cache with a block plan, the
chunks' positions and padding built in XLA around it: about 20 small ops per call, whose launches
a generation step pays for every layer. Here each program, one per (chunk p, batch row b, kv head
h), reads its row's length and derives everything else itself:

* its query rows are the ``T*G`` query heads of kv head h times the T new tokens (``q`` packed as
  ``[B, K, R, H]``, rows ordered ``(t, g)``, R a power of two >= 16), and their positions are the
  last T slots below the length (``length - T + t``) unless given;
* the tiles it reads are those of its chunk that hold a slot below the length and inside the
  mask's static key bounds (``masks.key_bounds``: a window's far past is never read);
* each tile applies the mask spec elementwise (slots at or past the length, and the padding past
  the shard's real slots, are invisible).

K/V are read in place from ``[B, S, K, H]``, in q's dtype or FP8 (widened as each tile is loaded:
half the bytes of a 16-bit cache). The result is each chunk's normalised ``(o, lse)``,
``[B, K, P, R, H]`` and ``[B, K, P, R]`` float32, which ``decode_attention`` merges by the
log-sum-exp rule (nothing to merge when P is 1).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_ring import masks as masks_lib
from pallas_ring.kernels import common
from pallas_ring.kernels.triton_logits import logits2

_BIG = 2**30  # beyond any position: the neutral element of the rows' min / max


def _kernel(len_ref, off_ref, *refs, cfg: common.DecodeConfig, given_positions: bool):
  qpos_ref = refs[0] if given_positions else None
  q_ref, k_ref, v_ref, o_ref, lse_ref = refs[1:] if given_positions else refs
  rows, hp = q_ref.shape
  bk = cfg.block_kv
  chunk = k_ref.shape[0] // cfg.chunks  # slots per chunk (a multiple of bk)
  length, offset = len_ref[0], off_ref[0]  # visible slots (global); global position of slot 0
  end = jnp.minimum(length, offset + cfg.slots)  # past the last visible slot of this shard
  row = jnp.arange(rows, dtype=jnp.int32)
  real = row < cfg.tokens * cfg.group
  if given_positions:
    q_pos = qpos_ref[...]
    q_lo = jnp.min(jnp.where(real, q_pos, _BIG))
    q_hi = jnp.max(jnp.where(real, q_pos, -_BIG))
  else:  # the last T slots below the length
    q_pos = length - cfg.tokens + row // cfg.group
    q_lo, q_hi = length - cfg.tokens, length - 1
  # The slots this program reads, local to the shard: its chunk, below the length, inside the
  # mask's key bounds around the rows' positions.
  lo = pl.program_id(0) * chunk
  hi = jnp.minimum(lo + chunk, end - offset)
  left, right = masks_lib.key_bounds(cfg.mask)
  if right is not None:
    hi = jnp.minimum(hi, q_hi + right + 1 - offset)
  if left is not None:
    lo = jnp.maximum(lo, q_lo - left - offset)
  first = lo // bk
  last = jnp.where(hi > lo, (hi + bk - 1) // bk, first)
  # An FP8 cache is widened tile by tile to float16, which Hopper converts to in one instruction
  # per pair (q carries k's descale, so its values are small; see ``fp8.fold``).
  wide = jnp.float16 if jnp.dtype(k_ref.dtype).itemsize == 1 else q_ref.dtype
  q = q_ref[...].astype(wide)

  def step(j, carry):
    m, l, acc = carry
    k0 = pl.multiple_of(j * bk, bk)
    k = k_ref[pl.ds(k0, bk), :].astype(wide)
    v = v_ref[pl.ds(k0, bk), :].astype(wide)
    s = logits2(q, k, cfg)
    k_pos = offset + k0 + jnp.arange(bk, dtype=jnp.int32)
    vis = cfg.mask.visible(q_pos[:, None], k_pos[None, :]) & (k_pos < end)[None, :]
    s = jnp.where(vis, s, common.NEG_INF)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    p = jnp.where(vis, jnp.exp2(s - m_new[:, None]), 0.0)
    alpha = jnp.exp2(m - m_new)
    acc = alpha[:, None] * acc + jnp.dot(p.astype(v.dtype), v,
                                         preferred_element_type=jnp.float32)
    return m_new, alpha * l + jnp.sum(p, axis=1), acc

  carry = (jnp.full((rows,), common.NEG_INF, jnp.float32), jnp.zeros((rows,), jnp.float32),
           jnp.zeros((rows, hp), jnp.float32))
  m, l, acc = jax.lax.fori_loop(first, last, step, carry)
  empty = l == 0.0
  o_ref[...] = acc / jnp.where(empty, 1.0, l)[:, None]
  lse_ref[...] = jnp.where(empty, -jnp.inf, m * common.LN2 + jnp.log(jnp.where(empty, 1.0, l)))


@functools.partial(jax.jit, static_argnames=("cfg",))
def decode(q, k, v, q_pos, lengths, offset, cfg: common.DecodeConfig):
  """One launch of the decode kernel.

  Args:
    q: ``[B, K, R, Hp]`` packed query rows (R a power of two >= 16, Hp the padded head dim).
    k, v: ``[B, S, K, Hp]`` the cache (this shard's), S a multiple of ``cfg.chunks *
      cfg.block_kv``; q's dtype or FP8 (``fp8.fold`` took the descales out).
    q_pos: int32 ``[B, R]`` positions of the rows, or None for the last T slots below each
      row's length.
    lengths: int32 ``[B]`` visible slots per row (global positions).
    offset: int32 ``[1]`` global position of this shard's slot 0.
    cfg: the kernel's static configuration.

  Returns:
    ``(o [B, K, P, R, Hp], lse [B, K, P, R])`` float32: each chunk's normalised result and
    natural-log lse (``-inf`` where a chunk sees no slot of a row).
  """
  b, kh, rows, hp = q.shape
  s = k.shape[1]
  p = cfg.chunks
  given = q_pos is not None
  in_specs = [pl.BlockSpec((1,), lambda c, b_, h: (b_,)),
              pl.BlockSpec((1,), lambda c, b_, h: (0,))]
  args = [lengths, offset]
  if given:
    in_specs.append(pl.BlockSpec((None, rows), lambda c, b_, h: (b_, 0)))
    args.append(q_pos)
  cache = pl.BlockSpec((None, s, None, hp), lambda c, b_, h: (b_, 0, h, 0))
  in_specs += [pl.BlockSpec((None, None, rows, hp), lambda c, b_, h: (b_, h, 0, 0)), cache, cache]
  out_specs = [pl.BlockSpec((None, None, None, rows, hp), lambda c, b_, h: (b_, h, c, 0, 0)),
               pl.BlockSpec((None, None, None, rows), lambda c, b_, h: (b_, h, c, 0))]
  out_shape = [jax.ShapeDtypeStruct((b, kh, p, rows, hp), jnp.float32),
               jax.ShapeDtypeStruct((b, kh, p, rows), jnp.float32)]
  params = plgpu.CompilerParams(num_warps=cfg.num_warps or 4, num_stages=cfg.num_stages or 3)
  return pl.pallas_call(
      functools.partial(_kernel, cfg=cfg, given_positions=given), grid=(p, b, kh),
      in_specs=in_specs, out_specs=out_specs, out_shape=out_shape, compiler_params=params,
      interpret=cfg.interpret, name="pallas_ring_decode")(*args, q, k, v)
