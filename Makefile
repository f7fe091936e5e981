# Two commands on a fresh machine:  `make demo` (the main job on the bundled model) and `make test`.
# Both create .venv and install what they need. torch is pinned first: on a CPU machine
# `pip install torch==2.13.0` takes the CPU wheel, while an unpinned torch pulls GBs of CUDA packages.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(PY) -m jobs.demo

test: $(VENV)/.installed
	$(PY) -m pytest -q

bench: $(VENV)/.installed
	$(PY) -m jobs.bench

.PHONY: install demo test bench
