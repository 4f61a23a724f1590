"""One process of tests/test_multihost.py: ``python multihost_worker.py PORT PROCESS_ID``.

Two such processes of 4 CPU devices each form one 8-device mesh through ``jax.distributed``
(gloo collectives), as the hosts of a TPU pod slice do. Each builds its global arrays from its
own rows of the data (layout order) and runs ``sharded_attention`` (ring and all_gather, zigzag
causal) forward and backward; it prints the relative errors against the dense reference computed
on the whole (tiny) problem, which every process can build from the shared seed.
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, pid = int(sys.argv[1]), int(sys.argv[2])
jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=pid,
                           initialization_timeout=120)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import pallas_ring as pr  # noqa: E402
from pallas_ring import masks, reference  # noqa: E402

B, T, N, K, H = 1, 256, 4, 2, 32
mesh = jax.make_mesh((8,), ("sp",))
R = mesh.shape["sp"]
rng = np.random.default_rng(0)  # the same data on every host; each places only its shards
full = {n: rng.standard_normal((B, T, h, H)).astype(np.float32)
        for n, h in (("q", N), ("k", K), ("v", K), ("do", N))}
ordered = {n: np.asarray(pr.layouts.permute(jnp.asarray(x), "zigzag", R)) for n, x in full.items()}
sharding = NamedSharding(mesh, P(None, "sp"))


def global_array(x):
  """This host's rows of ``x`` (layout order) -> one global array over both hosts."""
  rows = T // jax.process_count()
  mine = x[:, pid * rows:(pid + 1) * rows]
  return jax.make_array_from_process_local_data(sharding, mine, x.shape)


q, k, v, do = (global_array(ordered[n]) for n in ("q", "k", "v", "do"))
ref_out, ref_vjp = jax.vjp(lambda q, k, v: reference.attention(q, k, v, mask=masks.Causal())[0],
                           *(jnp.asarray(full[n]) for n in ("q", "k", "v")))
ref_grads = ref_vjp(jnp.asarray(full["do"]))


def rel(got, want):
  got = np.asarray(pr.layouts.unpermute(jnp.asarray(got), "zigzag", R), np.float64)
  want = np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def gathered(x):
  return multihost_utils.process_allgather(x, tiled=True)


for strategy in ("ring", "all_gather"):
  cfg = pr.SequenceParallelConfig(axis_name="sp", layout="zigzag", strategy=strategy,
                                  backend="xla")
  fn = lambda q, k, v: pr.sharded_attention(q, k, v, mesh=mesh, config=cfg, mask=masks.Causal())
  out, vjp = jax.vjp(jax.jit(fn), q, k, v)
  grads = vjp(do)
  errs = [rel(gathered(out), ref_out)] + [rel(gathered(g), r) for g, r in zip(grads, ref_grads)]
  print(f"{strategy} process {pid} of {jax.process_count()}, {jax.device_count()} devices: "
        + " ".join(f"{e:.2e}" for e in errs), flush=True)
jax.distributed.shutdown()
