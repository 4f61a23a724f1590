# `make demo` and `make test` set everything up on a machine with only python3 and pip.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test bench compile clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,tpu,notebooks]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m pallas_ring demo

test: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadgroup -q

bench: $(STAMP)
	$(PY) -m pallas_ring bench

compile: $(STAMP)
	$(PY) -m pallas_ring compile --topology v5e:2x4

clean:
	rm -rf $(VENV)
