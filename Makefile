# quantkit: `make install`, `make test`, `make demo`. Everything goes into .venv; torch is installed first
# (TORCH_SPEC, a CPU wheel by default) so that no other package pulls a CUDA build.
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install test test-unit demo bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test,tasks]"
	touch $@

install: $(VENV)/.installed

test: install
	$(BIN)/python -m pytest -q

test-unit: install
	$(BIN)/python -m pytest -q -m "not integration"

demo: install
	PATH="$(CURDIR)/$(BIN):$$PATH" bash scripts/demo.sh

bench: install
	$(BIN)/python scripts/bench_finalize.py

clean:
	rm -rf $(VENV) demo build dist *.egg-info
