"""The engine core imports no service: ``services/*`` are shells around ``pagedserve.engine``."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import pkgutil, importlib, sys
import pagedserve.engine, pagedserve.text
for package in (pagedserve.engine, pagedserve.text):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(info.name)
import pagedserve.llm
print(sorted({m.split(".")[0] for m in sys.modules if m.split(".")[0] in ("services", "grpc", "redis")}))
"""


def test_engine_text_and_llm_import_no_service_grpc_or_redis():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
