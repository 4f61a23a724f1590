# `make demo` and `make test` set everything up on a machine with only python3 and pip.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The demo needs the package alone (JAX, Flax): no libtpu, no Jupyter.
DEMO_STAMP := $(VENV)/.installed-demo

.PHONY: demo test quick bench compile wheel clean

$(DEMO_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	touch $(DEMO_STAMP)

# Everything the tests use: the test tools, libtpu (TPU programs compiled on this machine) and the
# notebooks' Jupyter.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,tpu,notebooks]"
	touch $(STAMP)

demo: $(DEMO_STAMP)
	$(PY) -m pallas_ring demo

# The full suite, as CI runs it (about 65 minutes on 2 cores, the README's number; --durations
# lists the slowest).
test: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadgroup -q --durations=15

# The edit-test loop (about 10 minutes on 2 cores): everything not marked slow, i.e. the first case
# of each parametrized test (tests/conftest.py), with fewer hypothesis examples.
quick: $(STAMP)
	HYPOTHESIS_PROFILE=quick $(PY) -m pytest -n 2 --dist loadgroup -q -m "not slow"

bench: $(STAMP)
	$(PY) -m pallas_ring bench

compile: $(STAMP)
	$(PY) -m pallas_ring compile --topology v5e:2x4

# A wheel to upload to Colab (the notebooks' first cell installs it): dist/pallas_ring-*.whl
wheel: $(DEMO_STAMP)
	$(PY) -m pip wheel --no-deps -w dist .

clean:
	rm -rf $(VENV) dist
