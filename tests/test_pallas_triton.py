"""The ``pallas_triton`` backend (interpret mode on CPU, native with PALLAS_RING_TEST_GPU=1)."""

from conformance import Conformance


class TestPallasTriton(Conformance):
  backend = "pallas_triton"
