#!/usr/bin/env bash
# Is the GPU executor right, and how fast is it? One command on a machine with a CUDA GPU,
# about 10 minutes, one JSON report:
#   scripts/gpu_check.sh [OUT_DIR]        (default gpu_check/; needs `make install` first)
# 1. the gpu-marked tests: CUDA kernels against the reference, generation against
#    transformers on the same GPU in fp32 and bf16, `pagedserve serve` on the GPU answering
#    the official client;
# 2. bench/kernels.py: paged decode attention against contiguous SDPA;
# 3. bench/throughput.py: the in-process engine on a sharegpt-shaped trace.
# Each part runs even when an earlier one fails; the report says which failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu_check}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$OUT/gpu.txt"
PAGEDSERVE_TEST_DEVICE=cuda timeout 420 "$PY" -m pytest -m gpu -q -rs \
  --junitxml="$OUT/tests.xml" tests 2>&1 | tee "$OUT/tests.log"
timeout 120 "$PY" bench/kernels.py --device cuda --batch 1 32 256 --context 512 4096 \
  --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log"
timeout 180 "$PY" bench/throughput.py --systems pagedserve --preset sharegpt \
  --num-requests 100 --json "$OUT/throughput.json" 2>&1 | tee "$OUT/throughput.log"
"$PY" scripts/gpu_report.py "$OUT" | tee "$OUT/report.json"
