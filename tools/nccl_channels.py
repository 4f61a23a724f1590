"""Whether NCCL's channel count changes what the ring's sends take from its kernels.

    NCCL_NVLS_ENABLE=0 PYTHONPATH=. python tools/nccl_channels.py [TOKENS_PER_GPU,...]

NCCL runs a send/receive as CTAs of its own (one per channel) beside the attention kernel they
overlap, so fewer channels leave the kernel more SMs but may slow the transfer. For each NCCL
setting below (each in its own process: NCCL reads its environment when its communicators
start) this times, on all local GPUs, ``bench.ring``'s rows for the dense contiguous ring at
each TOKENS_PER_GPU (default 8192,32768), MHA 16/16, H=128, bf16, forward and
forward+backward, against all-gather + cuDNN and one GPU doing the same work, on the device
clock.
"""

from __future__ import annotations

import os
import subprocess
import sys

SETTINGS = {
    "default": {},
    "NCCL_MAX_NCHANNELS=2": {"NCCL_MAX_NCHANNELS": "2"},
    "NCCL_MAX_NCHANNELS=8": {"NCCL_MAX_NCHANNELS": "8"},
    "NCCL_MIN_NCHANNELS=32": {"NCCL_MIN_NCHANNELS": "32"},
}


def child(tokens):
  from pallas_ring import bench  # pylint: disable=import-outside-toplevel
  with bench.clock("device"):
    bench.ring(tokens, n=16, cases=(("ring", "contiguous", False),), log=print)


def main(tokens: str):
  for name, env in SETTINGS.items():
    print(f"== {name}", flush=True)
    proc = subprocess.run([sys.executable, __file__, "--child", tokens],
                          env={**os.environ, **env}, capture_output=True, text=True,
                          check=False)
    lines = [l for l in proc.stdout.splitlines() if "/GPU" in l]
    print("\n".join(lines) if lines else proc.stderr[-2000:], flush=True)


if __name__ == "__main__":
  if sys.argv[1:2] == ["--child"]:
    child(tuple(int(t) for t in sys.argv[2].split(",")))
  else:
    main(sys.argv[1] if len(sys.argv) > 1 else "8192,32768")
