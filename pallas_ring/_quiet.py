"""Keeps libtpu quiet, and out of other processes' way, on machines without a TPU.

With ``jax[tpu]`` installed (used here to compile TPU programs on a CPU host), libtpu prints a
screen of errors on any machine without TPU chips ("Failed to find host bounds", "unexpected worker
hostname", a source trace). Naming a local worker and an accelerator type silences it; the
variables only matter to libtpu, are set only when unset, and only where no TPU chip exists, so
a real TPU host is never affected. Compiling for any TPU topology still works.

libtpu also takes a host-wide lock file when it loads (``/tmp/libtpu_lockfile``), so a second JAX
process of an environment with ``jax[tpu]`` failed to compile TPU programs ("Internal error when
accessing libtpu multi-process lockfile") while the first lived. Without TPU chips there is no
device to guard: ``ALLOW_MULTIPLE_LIBTPU_LOAD`` lets libtpu load beside other processes.
"""

from __future__ import annotations

import glob
import os

_GOOGLE_PCI_VENDOR = "0x1ae0"


def has_tpu_chips() -> bool:
  """True when this host has TPU chips (Google PCI devices or accel device files)."""
  if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
    return True
  for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
    try:
      with open(vendor) as f:
        if f.read().strip() == _GOOGLE_PCI_VENDOR:
          return True
    except OSError:
      continue
  return False


def quiet_libtpu() -> None:
  """Sets libtpu's host description on hosts without TPU chips (before JAX initialises)."""
  if has_tpu_chips():
    return
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
