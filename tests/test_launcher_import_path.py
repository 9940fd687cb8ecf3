"""The services `pagedserve up` starts import pagedserve's dependencies, not files of the folder it runs in:
``python -m`` puts that folder first on the import path, where a user's ``grpc.py`` or ``redis.py`` would
replace the dependency in every service."""

from __future__ import annotations

import subprocess
from pathlib import Path

from pagedserve.launcher import service_argv

SHADOW = 'raise SystemExit("imported the grpc.py of the folder `up` runs in")\n'


def test_a_service_started_in_a_folder_with_a_grpc_py_imports_the_real_grpc(tmp_path: Path):
    (tmp_path / "grpc.py").write_text(SHADOW)
    result = subprocess.run(service_argv("health", "--target", "127.0.0.1:1"), cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert "grpc.py" not in result.stdout + result.stderr
    assert result.stdout.startswith("UNREACHABLE: no gRPC service answers at 127.0.0.1:1"), result
    assert result.returncode == 1


def test_plain_python_m_would_have_imported_it(tmp_path: Path):
    """The hazard the ``-P`` guards against, shown on the command line `up` used before."""
    (tmp_path / "grpc.py").write_text(SHADOW)
    argv = [arg for arg in service_argv("health", "--target", "127.0.0.1:1") if arg != "-P"]
    result = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert "imported the grpc.py of the folder `up` runs in" in result.stderr
