"""The ``pallas_tpu`` backend (interpret mode on CPU; compiled for TPU in test_lowering)."""

from conformance import Conformance


class TestPallasTpu(Conformance):
  backend = "pallas_tpu"
