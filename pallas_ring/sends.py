"""A ring step's sends: a tree of arrays sent over the ring's axis (``send``; ``rotate``: sent and
received as a tree), as one buffer of the widest word their bytes allow where the ring asks for
it (``RingStatic.pack_sends``: XLA:GPU keeps one collective in flight at a time, so separate
permutes would not all overlap the kernel). ``packer`` packs and unpacks, so that a forward step
can send on the buffer it received as it came."""

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


def packer(tree, st):
  """``(pack, unpack)`` for trees shaped like ``tree``: ``pack`` gives what a ring step sends
  (one buffer where ``st.pack_sends``, else the tree itself), ``unpack`` the tree back."""
  leaves, treedef = jax.tree.flatten(tree)
  if not st.pack_sends or len(leaves) < 2:
    return (lambda t: t), (lambda t: t)
  like = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
  return (lambda t: pack_buffers(jax.tree.leaves(t)),
          lambda buf: jax.tree.unflatten(treedef, unpack_buffers(buf, like)))


def send(payload, st, shift: int = 1):
  """Sends every array of ``payload`` to the device ``shift`` ranks on. ``st``: the ring's
  ``ring.RingStatic`` (its axis and size)."""
  perm = _perm(st.ring_size, shift)
  return jax.tree.map(lambda x: lax.ppermute(x, st.axis_name, perm), payload)


def rotate(tree, st, shift: int = 1):
  """Sends every array of ``tree`` to the device ``shift`` ranks on (one collective where
  ``st.pack_sends``)."""
  pack, unpack = packer(tree, st)
  return unpack(send(pack(tree), st, shift))


__all__ = ["rotate", "packer", "send", "pack_buffers", "unpack_buffers"]
