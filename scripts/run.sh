#!/usr/bin/env bash
# Sets up what is not set up yet (scripts/setup.sh), starts the stack on the default model
# (pagedserve up; extra arguments go to it, PAGEDSERVE_PORT sets its --port), streams one chat
# completion through it, then keeps the stack running until Ctrl-C (exit status 130; the stack's
# processes and this script's temporary log are gone by then).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate

log=$(mktemp -t pagedserve-run.XXXXXX)
stack=""
cleanup() {
  set +e  # every step of the clean-up runs, whatever the one before returned
  if [ -n "$stack" ] && kill -0 "$stack" 2>/dev/null; then
    echo "== stopping the stack"
    kill -INT "$stack" 2>/dev/null
    wait "$stack"
  fi
  rm -f "$log"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

echo "== starting the stack (pagedserve up): Redis, a scheduler, a worker and the gateway"
# tee ignores Ctrl-C, so the stack's last lines (its shutdown) still show
pagedserve up ${PAGEDSERVE_PORT:+--port "$PAGEDSERVE_PORT"} "$@" > >(trap '' INT; exec tee "$log") 2>&1 &
stack=$!
until grep -q "pagedserve is up" "$log"; do
  if ! kill -0 "$stack" 2>/dev/null; then
    wait "$stack" || true
    echo "the stack failed to start (see its output above)" >&2
    exit 1
  fi
  sleep 0.2
done
target="127.0.0.1:$(sed -n 's/^  gRPC API: *.*:\([0-9]*\)$/\1/p' "$log")"
echo
echo "== streaming a completion from $target"
pagedserve complete --target "$target" --chat --temperature 0 --max-tokens 128 \
  --prompt "Explain what a KV cache is in two sentences."
echo
echo "== the stack keeps running; Ctrl-C stops it"
# `up` exits 0 only when asked to stop (1 when the stack fails, which set -e passes on); bash runs no INT
# trap once its child has handled the Ctrl-C itself, so the status is set here
wait "$stack"
exit 130
