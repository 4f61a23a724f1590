# `make demo` and `make test` set everything up on a machine with only python3 and pip.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The demo needs the package alone (JAX, Flax): no libtpu, no Jupyter.
DEMO_STAMP := $(VENV)/.installed-demo

.PHONY: demo test test-all quick bench compile wheel clean

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

# Every test, as CI runs it (about 25 minutes on 2 cores, the README's number; --durations lists
# the slowest): parametrized ones on their representative cases (-m "not slow": each backend, mask
# class, layout and strategy; tests/conftest.py picks them).
test: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadgroup -q -m "not slow" --durations=15

# The whole suite: every case and hypothesis's full example counts (about 65 minutes on 2 cores).
test-all: $(STAMP)
	HYPOTHESIS_PROFILE=all $(PY) -m pytest -n 2 --dist loadgroup -q --durations=15

# The edit-test loop (about 14 minutes on 2 cores): the first case of each test, without the costly
# ones CI adds (marked ci: the demo, notebooks, training runs...), with fewer hypothesis examples.
quick: $(STAMP)
	HYPOTHESIS_PROFILE=quick $(PY) -m pytest -n 2 --dist loadgroup -q -m "not slow and not ci"

bench: $(STAMP)
	$(PY) -m pallas_ring bench

compile: $(STAMP)
	$(PY) -m pallas_ring compile --topology v5e:2x4

# A wheel to upload to Colab (the notebooks' first cell installs it): dist/pallas_ring-*.whl
wheel: $(DEMO_STAMP)
	$(PY) -m pip wheel --no-deps -w dist .

clean:
	rm -rf $(VENV) dist
