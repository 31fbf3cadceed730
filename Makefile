# make test: a fresh virtual environment with the package and its test extras, then the CPU suite.
# make gpu-test: the GPU suite (on a machine with an NVIDIA GPU, nvcc and PyTorch).
PYTHON ?= python3
VENV   ?= .venv

$(VENV)/.installed: pyproject.toml setup.py $(wildcard native/src/*) native/include/gpu_census.h
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q '.[test]'
	touch $@

install: $(VENV)/.installed

test: install
	$(VENV)/bin/python -m pytest -q

gpu-test:
	$(PYTHON) -m pytest -q -m gpu tests/gpu tests/integration/test_metrics_nvml.py

.PHONY: install test gpu-test
