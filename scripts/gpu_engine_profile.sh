#!/usr/bin/env bash
# Where the engine's time goes on a lent GPU machine (the second script for such a machine, after
# scripts/gpu_check.sh): a random-weight Llama-3.2-1B-shaped model (scripts/gpu_engine_check.py) through
# `bench throughput --device cuda` sampled by py-spy (every thread, idle included, raw stacks), the same
# run without overlap scheduling (--max-plans-in-flight 1), one request alone against transformers (the
# decode latency), and float32 greedy tokens against transformers for this shape (GQA 32/8).
# Usage: scripts/gpu_engine_profile.sh MODEL_FILES   (as scripts/gpu_check.sh; py-spy from ./.whl)
set -uo pipefail
cd "$(dirname "$0")/.."
files=$1
out=${OUT:-gpu-results}
mkdir -p "$out"
log=$out/profile-log.txt
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
model=/tmp/gpu-models/llama1b-shape
run() {  # run NAME SECONDS COMMAND...
  local name=$1 limit=$2 started=$SECONDS
  shift 2
  echo "===== $name: $*" >> "$log"
  timeout "$limit" "$@" 2>&1 | tr '\r' '\n' | grep -v -E "it/s\]|tok/s\]|s/it\]" >> "$log"
  printf '%-22s rc=%-3s %4d s\n' "$name" "${PIPESTATUS[0]}" $((SECONDS - started)) | tee -a "$out/profile-summary.txt"
}
run make-model 90 python3 scripts/gpu_engine_check.py make-model --config "$files/config.json" --shape llama-1b --tokenizer "$files" --out $model
random=(--dataset-name random --num-prompts 256 --input-len 256 --output-len 256 --range-ratio 0.5 --kv-cache-memory 16GiB)
run engine-py-spy 120 py-spy record --idle --threads --format raw --rate 100 -o /tmp/py-spy-1b.txt -- \
  python3 -m pagedserve bench throughput --device cuda --model $model "${random[@]}" --skip-hf
gzip -9 -c /tmp/py-spy-1b.txt > "$out/py-spy-1b.txt.gz"  # raw stacks at 250 Hz were over 16 MiB
run no-overlap 90 python3 -m pagedserve bench throughput --device cuda --model $model "${random[@]}" --skip-hf --max-plans-in-flight 1
run overlap 90 python3 -m pagedserve bench throughput --device cuda --model $model "${random[@]}" --skip-hf
run batch-1 90 python3 -m pagedserve bench throughput --device cuda --model $model --dataset-name random --num-prompts 1 \
  --input-len 256 --output-len 256 --range-ratio 0 --hf-batch-sizes 1
run greedy-float32-1b 120 python3 scripts/gpu_engine_check.py greedy --model $model --dtype float32 --num-prompts 16
echo "== excerpts"
grep -E "^=====|sequences equal|diverges|warm-up|pagedserve +[0-9]|hf-b|ratio|Error|Traceback" "$log" | cut -c1-200
cat "$out/profile-summary.txt"
