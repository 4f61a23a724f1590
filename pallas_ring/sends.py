"""A ring step's sends: ``rotate`` a tree of arrays over the ring's axis, as one packed byte
buffer where the ring asks for it (``RingStatic.pack_sends``: XLA:GPU keeps one collective in
flight at a time, so separate permutes would not all overlap the kernel)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def _perm(r, shift=1):
  return [(i, (i + shift) % r) for i in range(r)]


def _word(arrays):
  """The widest unsigned dtype (4, 2 or 1 bytes) dividing every array's byte size: the packed
  buffer's element (XLA:GPU packs and unpacks 4-byte words faster than bytes: BENCHMARKS.md)."""
  size = next(w for w in (4, 2, 1) if all(x.size * x.dtype.itemsize % w == 0 for x in arrays))
  return jnp.dtype(f"uint{8 * size}")


def pack_buffers(arrays):
  """One unsigned-integer buffer holding the bytes of ``arrays``, one after the other."""
  word = _word(arrays)

  def words(x):
    ratio = word.itemsize // x.dtype.itemsize  # (elements per word, when above 1)
    x = x.reshape(-1, ratio) if ratio > 1 else x
    return lax.bitcast_convert_type(x, word).reshape(-1)

  return jnp.concatenate([words(x) for x in arrays])


def unpack_buffers(buf, like):
  """The arrays shaped like ``like`` from ``pack_buffers``'s buffer ``buf``."""
  word, out, start = buf.dtype, [], 0
  for x in like:
    n = x.size * x.dtype.itemsize // word.itemsize
    piece = buf[start:start + n]
    ratio = x.dtype.itemsize // word.itemsize  # (words per element, when above 1)
    piece = piece.reshape(-1, ratio) if ratio > 1 else piece
    out.append(lax.bitcast_convert_type(piece, x.dtype).reshape(x.shape))
    start += n
  return out


def rotate(tree, st, shift: int = 1):
  """Sends every array of ``tree`` to the device ``shift`` ranks on (one collective if
  packed). ``st``: the ring's ``ring.RingStatic`` (its axis, size and ``pack_sends``)."""
  send = lambda x: lax.ppermute(x, st.axis_name, _perm(st.ring_size, shift))
  leaves, treedef = jax.tree.flatten(tree)
  if not st.pack_sends or len(leaves) < 2:
    return jax.tree.unflatten(treedef, [send(x) for x in leaves])
  return jax.tree.unflatten(treedef, unpack_buffers(send(pack_buffers(leaves)), leaves))


__all__ = ["rotate", "pack_buffers", "unpack_buffers"]
