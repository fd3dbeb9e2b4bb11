# Every target a developer runs. `make help` lists them.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.setup-stamp
PYTRITON := nvidia-pytriton==0.7.0

.DEFAULT_GOAL := help
.PHONY: help setup serve test test-fast lint doctor tiny bench clean

help: ## list the targets
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

setup: $(STAMP) ## create .venv and install everything (idempotent)

# Re-run only when what we install changes. torch first, alone, so the pinned
# wheel (CPU here, CUDA on GPU hosts) is what the rest resolves against.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt torch==2.13.0
	$(PIP) install -q -c constraints.txt -e '.[dev]'
	# pytriton only carries a real tritonserver binary + python backend stubs;
	# its own dependencies (numpy 2, ...) must not come along.
	$(PIP) install -q --no-deps $(PYTRITON)
	touch $(STAMP)

serve: setup ## serve the tiny default model on a real Triton server (127.0.0.1:8000/8001/8002)
	$(PY) -m backend.serve $(ARGS)

test: setup ## run the whole test suite
	$(PY) -m pytest -q $(ARGS)

test-fast: setup ## tests without the slow (server) ones
	$(PY) -m pytest -q -m "not slow" $(ARGS)

lint: setup ## ruff
	$(VENV)/bin/ruff check .

doctor: setup ## check the environment is consistent
	$(PY) -m tools.doctor

tiny: setup ## write the tiny checkpoint to .cache/tiny
	$(PY) -m tools.make_tiny_checkpoint .cache/tiny --preset tiny

bench: setup ## engine benchmark on the tiny model (CPU); ARGS="--preset flash-shaped ..." on a GPU
	$(PY) -m backend.engine.bench $(ARGS)

clean: ## remove the venv and caches
	rm -rf $(VENV) .cache .pytest_cache .ruff_cache
