#!/usr/bin/env bash
# Regenerates the Python stubs in pagedserve/services/common/pb from proto/*.proto.
# The -I mapping makes the generated imports read "from pagedserve.services.common.pb import ...".
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc -Ipagedserve/services/common/pb=proto --python_out=. --pyi_out=. --grpc_python_out=. \
    proto/*.proto
