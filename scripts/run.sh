#!/usr/bin/env bash
# Sets up everything, starts the stack on the default model (pagedserve up), streams one chat
# completion through it, then keeps the stack running until Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate

PORT=${PAGEDSERVE_PORT:-50051}
log=$(mktemp)
pagedserve up --port "$PORT" "$@" > >(tee "$log") 2>&1 &
stack=$!
trap 'kill -INT $stack 2>/dev/null; wait $stack; rm -f "$log"' EXIT
trap 'exit 130' INT TERM
until grep -q "pagedserve is up" "$log"; do
  if ! kill -0 $stack 2>/dev/null; then echo "the stack failed to start" >&2; exit 1; fi
  sleep 1
done
echo
echo "== streaming a completion from 127.0.0.1:$PORT"
pagedserve complete --target "127.0.0.1:$PORT" --chat --temperature 0 --max-tokens 128 \
  --prompt "Write a haiku about paged memory."
echo
echo "== the stack keeps running; Ctrl-C stops it"
wait $stack
