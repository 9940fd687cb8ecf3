#!/usr/bin/env bash
# The GPU checks, as one script for a lent GPU machine (see docs/benchmarks.md, "Kernels and the GPU
# path"): the engine's greedy tokens against transformers on the GPU, the kernel tests on CUDA, the
# default model's shape through `bench throughput --device cuda` (our engine vs transformers), the
# kernel benchmark, and a 1B-parameter Llama shape. Each step has a time limit and the next runs
# whatever the last did; logs go to $OUT/log.txt (or ./gpu-results), a summary is printed last.
#
# Usage: scripts/gpu_check.sh MODEL_FILES
#   MODEL_FILES: a folder with the default model's config.json and tokenizer files (the small files of
#   `pagedserve prepare-model`'s folder; its weights are too large to carry, so the models here have
#   random weights of the same shapes, scripts/gpu_engine_check.py). Python packages the machine
#   lacks are installed from ./.whl when it exists (wheels for its Python).
set -uo pipefail
cd "$(dirname "$0")/.."
files=$1
out=${OUT:-gpu-results}
mkdir -p "$out"
log=$out/log.txt
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
models=/tmp/gpu-models

deadline=$((SECONDS + ${GPU_CHECK_SECONDS:-450}))  # the whole script's time; a step gets what is left
# step NAME SECONDS COMMAND...: runs COMMAND under a time limit (SECONDS or what is left), its output into
# the log; skipped when under 20 s are left
step() {
  local name=$1 limit=$2 started=$SECONDS rc
  shift 2
  limit=$((limit < deadline - SECONDS ? limit : deadline - SECONDS))
  if [ "$limit" -lt 20 ]; then
    printf '%-24s skipped: the time is spent\n' "$name" | tee -a "$out/summary.txt"
    return
  fi
  echo "===== $name: $*" >> "$log"
  timeout "$limit" "$@" 2>&1 | tr '\r' '\n' | grep -v -E "it/s\]|tok/s\]|s/it\]" >> "$log"
  rc=${PIPESTATUS[0]}
  printf '%-24s rc=%-3s %4d s (limit %d)\n' "$name" "$rc" $((SECONDS - started)) "$limit" | tee -a "$out/summary.txt"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c 'import sys, torch, triton, transformers; print(sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
} 2>&1 | tee "$out/gpu.txt"

step imports 60 python3 -c "import tests.conftest, pagedserve.cli, pagedserve.llm, pagedserve_kernels.bench, xdist"
step make-models 120 bash -c 'python3 scripts/gpu_engine_check.py make-model --config "$1/config.json" --tokenizer "$1" \
  --out "$2/smollm2-shape" && python3 scripts/gpu_engine_check.py make-model --config "$1/config.json" --shape llama-1b \
  --tokenizer "$1" --out "$2/llama1b-shape"' make-models "$files" "$models"
step greedy-float32 120 python3 scripts/gpu_engine_check.py greedy --model $models/smollm2-shape --dtype float32
step kernel-tests 150 python3 -m pytest -q -n 8 -p no:cacheprovider tests/kernels
random=(--dataset-name random --num-prompts 256 --input-len 256 --output-len 256 --range-ratio 0.5)
step throughput-135m 120 python3 -m pagedserve bench throughput --device cuda --model $models/smollm2-shape \
  "${random[@]}" --kv-cache-memory 16GiB --hf-batch-sizes 256 --result-json "$out/throughput-135m.json"
step kernel-bench 100 python3 -m pagedserve_kernels.bench --json "$out/kernels.json"
step throughput-1b 120 python3 -m pagedserve bench throughput --device cuda --model $models/llama1b-shape \
  "${random[@]}" --kv-cache-memory 16GiB --hf-batch-sizes 256 --result-json "$out/throughput-1b.json"
step greedy-bfloat16 60 python3 scripts/gpu_engine_check.py greedy --model $models/smollm2-shape --dtype bfloat16

echo; echo "== log excerpts"
grep -E "^=====|sequences equal|diverges|passed|failed|error|Error|PASS|FAIL|ratio|pagedserve +[0-9]|hf-b|GB/s|Traceback" "$log" | cut -c1-220 | tail -n 120
echo; echo "== summary"; cat "$out/summary.txt"
