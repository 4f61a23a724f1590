"""Multi-host, as every TPU pod slice beyond one host is: two processes of 4 CPU devices each
form one 8-device mesh through ``jax.distributed`` (gloo), build global arrays from per-host data
in layout order, and run ``sharded_attention`` (ring and all_gather, zigzag causal) forward and
backward; both equal the dense reference (``multihost_worker.py``)."""

import os
import pathlib
import socket
import subprocess
import sys

import pytest


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


@pytest.mark.ci
def test_sharded_attention_across_two_processes():
  here = pathlib.Path(__file__).parent
  port = str(_free_port())
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = os.pathsep.join([str(here.parent), env.get("PYTHONPATH", "")])
  procs = [subprocess.Popen([sys.executable, str(here / "multihost_worker.py"), port, str(i)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
           for i in (0, 1)]
  outs = [p.communicate(timeout=600)[0] for p in procs]
  for i, (p, out) in enumerate(zip(procs, outs)):
    assert p.returncode == 0, out[-3000:]
    lines = [l for l in out.splitlines() if f"process {i} of 2, 8 devices:" in l]
    assert [l.split()[0] for l in lines] == ["ring", "all_gather"], out[-3000:]
    for line in lines:
      errs = [float(e) for e in line.split(":")[-1].split()]
      assert len(errs) == 4 and max(errs) < 1e-5, line
