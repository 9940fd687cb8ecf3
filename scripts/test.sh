#!/usr/bin/env bash
# Sets up everything (scripts/setup.sh) and runs the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
exec python -m pytest -q "$@"
