#!/usr/bin/env bash
# The GPU checks of issue 5, as one script for a lent GPU machine (see docs/benchmarks.md):
# the kernel tests on CUDA (bfloat16 included), pagedserve_kernels/bench.py, and the default model's offline
# throughput, our engine vs transformers, on the GPU. Results go to $OUT (or ./gpu-results).
# Usage: scripts/gpu_check.sh [SHAREGPT_JSON]   (without a file: the random dataset)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python -m pytest -q tests/kernels 2>&1 | tee "$out/kernel-tests.log"
python -m pagedserve_kernels.bench --json "$out/kernels.json" 2>&1 | tee "$out/kernels-bench.log"
if [ $# -ge 1 ]; then
  dataset=(--dataset-name sharegpt --dataset-path "$1" --num-prompts 64)
else
  dataset=(--dataset-name random --num-prompts 64 --input-len 256 --output-len 256 --range-ratio 0.5)
fi
python -m pagedserve bench throughput --device cuda "${dataset[@]}" --kv-cache-memory 8GiB \
  --result-json "$out/throughput.json" 2>&1 | tr '\r' '\n' | grep -v "it/s\]\|tok/s\]" | tee "$out/throughput.log"
