"""The ``xla`` backend (blockwise jnp): every feature, float64 too."""

from conformance import Conformance


class TestXla(Conformance):
  backend = "xla"
