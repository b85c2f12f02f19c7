# The README's two set-up commands. Both create .venv when it is missing and install the pinned
# development set (requirements-dev.txt: torch==2.13.0 CPU build and friends) plus polytrain in editable mode.
#   make demo   -> `polytrain train` with its defaults (local CPU workers, embedded digits data)
#   make test   -> the whole pytest suite on PYTEST_WORKERS pytest-xdist workers (a module's tests on one of them;
#                  tests marked serial alone), then its 15 slowest tests
# pip compiles no bytecode (18,000 files); tools/warm_bytecode.py then compiles the 5,000 that runs import.
# PIP_ARGS passes extra options to pip, e.g. PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu"
# on a machine whose PyPI would otherwise hand out a CUDA build of torch.
PYTHON ?= python3
VENV ?= .venv
PIP_ARGS ?=
PYTEST_WORKERS ?= 2
PY := $(VENV)/bin/python
STAMP := $(VENV)/.polytrain-installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml requirements-dev.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile --disable-pip-version-check $(PIP_ARGS) -r requirements-dev.txt
	$(PY) -m pip install -q --no-compile --disable-pip-version-check $(PIP_ARGS) --no-deps -e .
	env -u PYTHONDONTWRITEBYTECODE $(PY) tools/warm_bytecode.py
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/polytrain train

test: $(STAMP)
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadscope --no-loadscope-reorder --durations=15

bench: $(STAMP)
	$(VENV)/bin/polytrain bench

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
